"""Tool calls: parsers, schema checks and bindings, and their errors as observations."""

from __future__ import annotations

import re

import pytest

from temper.envs import make_environment
from temper.envs.tools import (
    ToolCall,
    ToolCallError,
    call_action,
    call_content,
    call_id,
    parse_hermes,
    parse_llama3_json,
    parse_mistral,
    parse_pythonic,
    parse_tool_code,
    tool_table,
)
from temper.jobspec import SpecError, ToolSpec, parse_spec

TASK = {"id": "t", "kind": "code", "prompt": "Fix it.", "spec": {}}
GRADE = ToolSpec.model_validate(
    {
        "function": {
            "name": "grade",
            "description": "run the grader on a file",
            "parameters": {
                "type": "object",
                "properties": {"file": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["file"],
                "additionalProperties": False,
            },
        },
        "command": "python grade.py {file}",
    }
)


def env(parser: str = "hermes", tools=None):
    return make_environment("code", TASK, max_turns=4, action_format=parser, tools=tools)


def test_hermes_reads_every_call_in_order():
    text = (
        'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    )
    assert parse_hermes(text) == [
        ToolCall("bash", {"command": "ls"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    action = env().parse(text, turn=0)
    assert action.kind == "sandbox" and action.command == {"kind": "run_command", "command": "ls"}
    assert action.more == [{"kind": "run_python", "code": "print(1)"}] and action.note is None
    assert not action.submit_after


def test_several_calls_get_one_observation_each_and_a_submit_ends_the_turn():
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call>'.format
    text = call("bash", '{"command": "ls"}') + call("submit", "{}") + call("bash", '{"command": "pwd"}')
    e = env(tools=[{"function": {"name": "bash"}}, {"function": {"name": "submit"}}])
    action = e.parse(text, turn=0)
    assert action.kind == "sandbox" and action.more is None and action.submit_after
    assert "1 tool call(s) after submit were ignored" in e.observe(action, {"exit_code": 0})[-1]
    two = e.parse(call("bash", '{"command": "ls"}') + call("bash", '{"command": "pwd"}'), turn=0)
    texts = e.observe(two, {"exit_code": 0, "stdout": "a.py"}, [{"exit_code": 1, "stderr": "boom"}])
    assert len(texts) == 2 and "a.py" in texts[0] and "boom" in texts[1] and "exit code 1" in texts[1]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "never closed"),
        ("<tool_call>{name: bash}</tool_call>", "not valid JSON"),
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            "unknown tool 'rm_rf'; available: bash",
        ),
        (
            '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>',
            "arguments.command is required",
        ),
        ('<tool_call>{"name": "bash", "arguments": {"command": 3}}</tool_call>', "must be of type string"),
        (
            '<tool_call>{"name": "write_file", "arguments": {"path": "/etc/x", "content": ""}}</tool_call>',
            "inside",
        ),
        (
            '<tool_call>{"name": "write_file", "arguments": {"path": "src/", "content": ""}}</tool_call>',
            "path 'src/' must be relative",
        ),
        ('<tool_call>["bash"]</tool_call>', 'with a string "name"'),
    ],
)
def test_bad_calls_become_an_observation_with_the_error(text, error):
    e = env()
    action = e.parse(text, turn=0)
    assert action.kind == "invalid" and not action.format_ok
    assert error in (action.error or "")
    (observation,) = e.observe(action, None)
    assert observation.startswith(f"Error: {action.error}") and "<tool_call>" in observation


def test_llama3_json_calls_and_plain_text():
    assert parse_llama3_json('<|python_tag|>{"name": "python", "parameters": {"code": "1"}}') == [
        ToolCall("python", {"code": "1"})
    ]
    two = '{"name": "bash", "parameters": {"command": "ls"}}; {"name": "submit", "parameters": {}}'
    assert [c.name for c in parse_llama3_json(two)] == ["bash", "submit"]
    assert parse_llama3_json("I think the answer is 4.") == []
    with pytest.raises(ToolCallError, match="text after"):
        parse_llama3_json('{"name": "bash", "parameters": {"command": "ls"}} and then')
    action = env("llama3_json").parse(two, turn=0)
    assert action.kind == "sandbox" and action.submit_after


def test_a_command_template_quotes_its_arguments_and_checks_the_schema():
    tools = tool_table([GRADE])
    assert call_action(ToolCall("grade", {"file": "a b; rm -rf /"}), tools) == {
        "kind": "run_command",
        "command": "python grade.py 'a b; rm -rf /'",
    }
    with pytest.raises(ToolCallError, match="arguments.extra is not a parameter"):
        call_action(ToolCall("grade", {"file": "x", "extra": 1}), tools)
    with pytest.raises(ToolCallError, match="arguments.verbose must be of type boolean"):
        call_action(ToolCall("grade", {"file": "x", "verbose": "yes"}), tools)


def test_declared_tools_reach_the_template_and_replace_the_defaults():
    e = env(tools=[GRADE, {"function": {"name": "submit"}}])
    assert [s["function"]["name"] for s in e.tool_schemas() or []] == ["grade", "submit"]
    submit = e.tool_schemas()[1]["function"]  # type: ignore[index]
    assert submit["parameters"]["properties"] == {"answer": {"type": "string"}} and submit["description"]
    assert env("code_block").tool_schemas() is None  # fenced blocks: no function schemas
    assert env().parse(
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', turn=0
    ).kind == ("sandbox")
    assert e.parse(
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', turn=0
    ).kind == ("invalid")


def test_the_spec_refuses_bad_tools_by_field():
    base = {"name": "x", "policy": {"model": "m"}, "tasks": {"taskset": "t"}}

    def errors(tools) -> str:
        with pytest.raises(SpecError) as info:
            parse_spec({**base, "environment": {"tools": tools}})
        return str(info.value)

    assert "needs run (one of bash, python" in errors([{"function": {"name": "grep"}}])
    assert "placeholder {path}" in errors(
        [
            {
                "function": {"name": "cat", "parameters": {"type": "object", "properties": {}}},
                "command": "cat {path}",
            }
        ]
    )
    assert "duplicate names ['bash']" in errors(
        [{"function": {"name": "bash"}}, {"function": {"name": "bash"}}]
    )
    assert "environment.tools.0.run" in errors([{"function": {"name": "x"}, "run": "rm"}])
    assert "not a JSON schema type" in errors(
        [
            {
                "function": {
                    "name": "bash",
                    "parameters": {"type": "object", "properties": {"c": {"type": "str"}}},
                }
            }
        ]
    )


# --- Mistral, pythonic and Gemma's tool_code --------------------------------------------------------


def test_mistral_reads_v03_lists_with_and_without_the_marker():
    # Mistral-7B-Instruct-v0.3's own shape; the id is kept when it is nine letters and digits
    text = (
        '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls -la"}, "id": "Ab3dE6gH9"}, '
        '{"name": "python", "arguments": {"code": "print(1)"}}]'
    )
    assert parse_mistral(text) == [
        ToolCall("bash", {"command": "ls -la"}, "Ab3dE6gH9"),
        ToolCall("python", {"code": "print(1)"}),
    ]
    # decoded without special tokens the marker is gone: the bare list reads the same
    assert parse_mistral(text.removeprefix("[TOOL_CALLS]")) == parse_mistral(text)
    # text before the marker is the assistant's; an id of another shape is not kept
    assert parse_mistral(
        'Let me look. [TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}, "id": "call_1"}]'
    ) == [ToolCall("bash", {"command": "ls"})]
    assert (
        call_content('Let me look. [TOOL_CALLS] [{"name": "x", "arguments": {}}]', "mistral")
        == "Let me look."
    )
    assert parse_mistral("The answer is 4.") == [] and parse_mistral("[1, 2, 3] are the roots") == []
    action = env("mistral").parse(text, turn=0)
    assert action.kind == "sandbox" and action.command == {"kind": "run_command", "command": "ls -la"}
    assert [c["id"] for c in action.calls][0] == "Ab3dE6gH9" and len(action.calls) == 2


def test_mistral_reads_the_name_args_shape_of_later_tokenizers():
    text = '[TOOL_CALLS]bash[ARGS]{"command": "ls"}[TOOL_CALLS]python[CALL_ID]Zz9Yy8Xx7[ARGS]{"code": "1"}'
    assert parse_mistral(text) == [
        ToolCall("bash", {"command": "ls"}),
        ToolCall("python", {"code": "1"}, "Zz9Yy8Xx7"),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}', "not valid JSON"),
        (
            '[TOOL_CALLS] [{"name": "bash", "arguments": {}}] and then I will',
            "text after the list of tool calls",
        ),
        ("[TOOL_CALLS] []", "non-empty JSON list of calls"),
        ('[TOOL_CALLS] [{"arguments": {}}]', 'a string "name"'),
        ('[TOOL_CALLS] [{"name": "bash", "arguments": [1]}]', "must be a JSON object"),
        ("[TOOL_CALLS] let me think", "followed by a JSON list of calls or by name[ARGS]"),
        ('[TOOL_CALLS]ba sh[ARGS]{"command": "ls"}', "is not a tool name"),
        ("[TOOL_CALLS]bash[ARGS]{oops", "arguments of 'bash' are not valid JSON"),
        (
            '[TOOL_CALLS] [{"name": "a", "arguments": {}}][TOOL_CALLS] [{"name": "b", "arguments": {}}]',
            "twice",
        ),
    ],
)
def test_malformed_mistral_calls_say_what_is_wrong(text, error):
    with pytest.raises(ToolCallError, match=re.escape(error)):
        parse_mistral(text)
    action = env("mistral").parse(text, turn=0)  # an observation, never a crash
    assert action.kind == "invalid" and error in action.error


def test_pythonic_reads_a_list_of_calls():
    text = '[bash(command="ls -la"), python(code=\'print("hi")\'), grade(file="a.py", verbose=True)]'
    assert parse_pythonic(text) == [
        ToolCall("bash", {"command": "ls -la"}),
        ToolCall("python", {"code": 'print("hi")'}),
        ToolCall("grade", {"file": "a.py", "verbose": True}),
    ]
    assert parse_pythonic('<|python_start|>[submit(answer="42")]<|python_end|>') == [
        ToolCall("submit", {"answer": "42"})
    ]
    assert parse_pythonic("[web.search(query='x', limit=3)]") == [
        ToolCall("web.search", {"query": "x", "limit": 3})
    ]
    assert parse_pythonic("[]") == [] and parse_pythonic("The answer is 4.") == []
    action = env("pythonic").parse('[bash(command="ls")]', turn=0)
    assert (
        action.command == {"kind": "run_command", "command": "ls"}
        and action.calls[0]["function"]["name"] == "bash"
    )


def test_tool_code_reads_gemmas_blocks():
    text = (
        "I will list the files first.\n```tool_code\nbash(command=\"ls\")\nprint(python(code='1 + 1'))\n```\n"
        "Then:\n```tool_code\n[submit(answer=None)]\n```"
    )
    assert parse_tool_code(text) == [
        ToolCall("bash", {"command": "ls"}),
        ToolCall("python", {"code": "1 + 1"}),
        ToolCall("submit", {"answer": None}),
    ]
    assert call_content(text, "tool_code") == "I will list the files first.\n\nThen:"
    assert parse_tool_code("no code here, and a ```python\nprint(1)\n``` block is not a call") == []
    action = env("tool_code").parse('```tool_code\nbash(command="pytest -q")\n```', turn=0)
    assert action.command == {"kind": "run_command", "command": "pytest -q"}


@pytest.mark.parametrize(
    ("parser", "text", "error"),
    [
        ("pythonic", '[bash(command="ls"', "is not valid Python"),
        ("pythonic", "[bash('ls')]", "takes its arguments by name"),
        ("pythonic", "[bash(command=ls)]", "argument command is not a literal"),
        ("pythonic", "[bash(**kw)]", "**arguments are not accepted"),
        ("pythonic", "[1, 2]", "is not a function call"),
        ("pythonic", "[(lambda: 1)()]", "the called thing is not a tool name"),
        ("pythonic", "[bash(command='ls')] and more", "one Python list, [f(a=1), g()], and nothing after it"),
        ("tool_code", '```tool_code\nbash(command="ls")\n', "never closed"),
        ("tool_code", "```tool_code\nx = bash(command='ls')\n```", "not statements"),
        ("tool_code", '```tool_code\nbash(command="ls"\n```', "is not valid Python"),
        ("tool_code", "```tool_code\nbash(command=open('/etc/passwd').read())\n```", "is not a literal"),
    ],
)
def test_malformed_python_calls_say_what_is_wrong(parser, text, error):
    fn = {"pythonic": parse_pythonic, "tool_code": parse_tool_code}[parser]
    with pytest.raises(ToolCallError, match=re.escape(error)):
        fn(text)
    action = env(parser).parse(text, turn=0)
    assert action.kind == "invalid" and error in action.error


def test_call_ids_are_nine_letters_and_digits_and_stable():
    ids = {call_id("some reply", i) for i in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert call_id("some reply", 3) == call_id("some reply", 3) != call_id("other reply", 3)
