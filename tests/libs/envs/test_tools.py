"""Tool calls: parsers, schema checks and bindings, and their errors as observations."""

from __future__ import annotations

import pytest

from temper.envs import make_environment
from temper.envs.tools import (
    ToolCall,
    ToolCallError,
    call_action,
    parse_hermes,
    parse_llama3_json,
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
