from __future__ import annotations

import pytest

from temper.envs import (
    ActionFormat,
    CodeEnvironment,
    MathEnvironment,
    ParsedAction,
    UnknownEnvironment,
    extract_answer,
    make_environment,
    render_result,
)
from temper.policy.tokenizer import default_tokenizer

TASK = {
    "id": "t1",
    "kind": "code",
    "prompt": "Fix add().",
    "spec": {"files": {"add.py": "def add(a, b):\n    return a - b\n"}},
}
FENCE = "```"


def code(**kw) -> CodeEnvironment:
    return make_environment("code", TASK, **kw)  # type: ignore[return-value]


def test_unknown_kind_names_the_choices():
    with pytest.raises(
        UnknownEnvironment, match=r"installed: agent \(temper\), code \(temper\), math \(temper\), shell"
    ):
        make_environment("chess", TASK)


def test_first_prompt_shows_the_files_and_is_chat_encoded():
    env = code(max_turns=3)
    tok = default_tokenizer()
    ids = env.first_prompt_ids(tok)
    text = tok.decode(ids, skip_special=False)
    assert "Fix add()." in text and "--- add.py" in text and "3 turns" in text
    assert text.startswith("<|bos|><|system|>") and text.endswith("<|assistant|>")


def test_hidden_files_are_named_without_their_content():
    task = {**TASK, "spec": {"files": {"add.py": "def add(a, b):\n    return a - b\n",
                                       "test_add.py": "assert add(1, 2) == 3\n"}}}  # fmt: skip
    shown = make_environment("code", task).user_prompt()
    assert "--- test_add.py\nassert add(1, 2) == 3" in shown
    hidden = make_environment("code", task, hide_files=["test_*"]).user_prompt()
    assert "--- test_add.py (not shown)" in hidden and "assert add" not in hidden
    assert "--- add.py\ndef add(a, b):" in hidden
    shell = make_environment("shell", task, hide_files=["*.py"]).user_prompt()
    assert "return a - b" not in shell and "--- add.py (not shown)" in shell

    from pydantic import ValidationError

    from temper.jobspec import EnvironmentSpec

    assert EnvironmentSpec(kind="shell", hide_files=["test_*"]).hide_files == ["test_*"]
    with pytest.raises(ValidationError, match="hide_files applies to .*code, shell.*not 'math'"):
        EnvironmentSpec(kind="math", hide_files=["secret.py"])


def test_a_job_can_replace_or_drop_the_system_prompt():
    assert [m["role"] for m in code().first_messages()] == ["system", "user"]
    assert code(system_prompt="Be brief.").first_messages()[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in code(system_prompt="").first_messages()] == ["user"]


@pytest.mark.parametrize(
    ("text", "command"),
    [
        (f"look\n{FENCE}bash\ncat add.py\n{FENCE}", {"kind": "run_command", "command": "cat add.py\n"}),
        (f"{FENCE}python\nprint(1)\n{FENCE}", {"kind": "run_python", "code": "print(1)\n"}),
        (
            f"{FENCE}python add.py\nx = 1\n{FENCE}",
            {"kind": "write_file", "path": "add.py", "content": "x = 1\n"},
        ),
        (
            f"{FENCE}file:src/a.txt\nhi\n{FENCE}",
            {"kind": "write_file", "path": "src/a.txt", "content": "hi\n"},
        ),
    ],
)
def test_code_blocks_become_sandbox_actions(text, command):
    action = code().parse(text, turn=0)
    assert action.kind == "sandbox" and action.command == command and action.format_ok


def test_block_then_submit_runs_then_submits():
    action = code().parse(f"{FENCE}python add.py\nx=1\n{FENCE}\nsubmit", turn=0)
    assert action.kind == "sandbox" and action.submit_after


def test_submit_alone_and_the_word_in_prose():
    assert code().parse("All tests pass.\n`submit`", turn=1).kind == "submit"
    assert code().parse("I will submit once the tests pass.", turn=1).kind == "invalid"


def test_a_path_through_the_current_directory_is_a_file_to_write():
    action = code().parse(f"{FENCE}python ./src/a.py\nx = 1\n{FENCE}", turn=0)
    assert action.command == {"kind": "write_file", "path": "./src/a.py", "content": "x = 1\n"}


def test_extra_blocks_are_noted_not_run():
    action = code().parse(f"{FENCE}bash\nls\n{FENCE}\n{FENCE}bash\npwd\n{FENCE}", turn=0)
    assert action.command == {"kind": "run_command", "command": "ls\n"} and "first block" in (
        action.note or ""
    )


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("no idea", "no action found"),
        (f"{FENCE}bash\nls", "never closed"),
        (f"{FENCE}\nls\n{FENCE}", "needs a language"),
        (f"{FENCE}python ../etc/passwd\nx\n{FENCE}", "relative path"),
        (f"{FENCE}python /abs.py\nx\n{FENCE}", "relative path"),
        # directories, not files: a lone write of one would fail only in the scorer (a
        # sampled reply of the example's warm-started policy did this)
        (f"{FENCE}oorn .\npolnbtionoy\nfroyys(x):\n{FENCE}", "cannot write '.'"),
        (f"{FENCE}python src/\nx\n{FENCE}", "relative path"),
        (f"{FENCE}python src/.\nx\n{FENCE}", "relative path"),
        (f"{FENCE}python src//a.py\nx\n{FENCE}", "relative path"),
    ],
)
def test_malformed_output_is_an_invalid_action_not_an_exception(text, error):
    env = code()
    action = env.parse(text, turn=0)
    assert action.kind == "invalid" and not action.format_ok and error in (action.error or "")
    (obs,) = env.observe(action, None)
    assert obs.startswith("Error: ") and "```bash" in obs


def test_tool_calls():
    env = code(action_format=ActionFormat.tool_call)
    ok = env.parse('<tool>{"name": "bash", "arguments": {"command": "pytest -q"}}</tool>', turn=0)
    assert ok.command == {"kind": "run_command", "command": "pytest -q"}
    w = env.parse(
        '<tool>{"name": "write_file", "arguments": {"path": "a.py", "content": "x"}}</tool>', turn=0
    )
    assert w.command == {"kind": "write_file", "path": "a.py", "content": "x"}
    dot = env.parse('<tool>{"name": "write_file", "arguments": {"path": ".", "content": "x"}}</tool>', turn=0)
    assert dot.kind == "invalid" and "relative" in (dot.error or "")
    assert env.parse('<tool>{"name": "submit"}</tool>', turn=0).kind == "submit"
    for bad, why in [
        ("<tool>{nope}</tool>", "not valid JSON"),
        ('<tool>{"name": "rm"}</tool>', "unknown tool"),
        ('<tool>{"name": "bash", "arguments": {}}</tool>', "needs"),
        ('<tool>{"name": "bash"', "never closed"),
        ("just text", "no tool call"),
    ]:
        action = env.parse(bad, turn=0)
        assert action.kind == "invalid" and why in (action.error or ""), bad


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the result is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("work...\n#### 1,234", "1,234"),
        ("Final answer: 7.", "7"),
        ("**Answer:** $x = 3$", "3"),
        ("no answer here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_math_answer_extraction(text, answer):
    assert extract_answer(text) == answer


def test_math_tool_use_and_submission():
    env: MathEnvironment = make_environment("math", {"id": "m", "kind": "math", "prompt": "2+2?"})  # type: ignore[assignment]
    run = env.parse(f"{FENCE}python\nprint(2+2)\n{FENCE}", turn=0)
    assert run.kind == "sandbox" and run.command == {"kind": "run_python", "code": "print(2+2)\n"}
    done = env.parse("\\boxed{4}", turn=1)
    assert done.kind == "submit"
    assert env.submission(done, final_text="\\boxed{4}", snapshot_key=None, session_id="e")["answer"] == "4"
    assert env.parse("I think it's four", turn=0).kind == "invalid"


def test_observation_text_reports_exit_kill_and_cuts_floods():
    cmd = {"kind": "run_command", "command": "yes"}
    flood = render_result(
        cmd,
        {
            "exit_code": None,
            "kill_reason": "output",
            "stdout": "y\n" * 50_000,
            "stdout_truncated": True,
            "wall_s": 0.5,
        },
        1000,
    )
    assert "killed (too much output)" in flood and "characters cut" in flood and len(flood) < 1500
    ok = render_result(cmd, {"exit_code": 1, "stderr": "Traceback\nAssertionError", "wall_s": 0.01}, 1000)
    assert "exit code 1" in ok and "AssertionError" in ok
    assert "(no output)" in render_result(cmd, {"exit_code": 0}, 1000)
    assert (
        render_result({"kind": "write_file", "path": "a", "content": "xy"}, {}, 100) == "Wrote a (2 bytes)."
    )


def test_observation_ids_extend_token_wise_and_keep_sampled_ids():
    env = code()
    tok = default_tokenizer()
    prompt = env.first_prompt_ids(tok)
    sampled = tok.encode("```bash\nls\n```")  # stopped without <|end|>
    obs = env.observation_ids(tok, sampled, "add.py")
    full = prompt + sampled + obs
    assert full[: len(prompt) + len(sampled)] == prompt + sampled
    assert tok.decode(obs, skip_special=False) == "<|end|><|tool|>add.py<|end|><|assistant|>"
    end = tok.stop_ids[0]
    closed = env.observation_ids(tok, [*sampled, end], "x")
    assert tok.decode(closed, skip_special=False) == "<|tool|>x<|end|><|assistant|>"


def test_parsed_action_round_trips():
    a = ParsedAction("sandbox", command={"kind": "run_python", "code": "1"}, submit_after=True)
    assert ParsedAction.from_dict(a.to_dict()) == a


def test_the_shell_environment_runs_only_bash_and_submits_the_workspace():
    env = make_environment("shell", {**TASK, "kind": "shell"}, max_turns=5)
    assert env.kind == "shell" and [t.function.name for t in env.tools] == ["bash", "submit"]
    assert "5 turns" in env.system_prompt() and "hidden tests check the workspace" in env.system_prompt()
    action = env.parse(f"{FENCE}bash\nls -la\n{FENCE}\nsubmit", turn=0)
    assert action.kind == "sandbox" and action.submit_after
    assert action.command == {"kind": "run_command", "command": "ls -la\n"}
    assert env.parse("done\nsubmit", turn=1).kind == "submit"
    python = env.parse(f"{FENCE}python\nprint(1)\n{FENCE}", turn=0)
    assert python.kind == "invalid" and "only ```bash blocks run here" in (python.error or "")
    assert "only ```bash" in env.observe(python, None)[0]  # the error is the observation
    writes = env.parse(f"{FENCE}python x.py\nprint(1)\n{FENCE}", turn=0)
    assert writes.kind == "invalid"  # no file writes but through bash
    sub = env.submission(action, final_text="t", snapshot_key="snap", session_id="s")
    assert sub == {"kind": "shell", "session_id": "s", "snapshot_key": "snap", "final_text": "t"}


def test_the_shell_environment_with_tool_calls():
    env = make_environment("shell", TASK, action_format=ActionFormat.tool_call)
    action = env.parse('<tool>{"name": "bash", "arguments": {"command": "pwd"}}</tool>', turn=0)
    assert action.command == {"kind": "run_command", "command": "pwd"}
    other = env.parse('<tool>{"name": "python", "arguments": {"code": "1"}}</tool>', turn=0)
    assert other.kind == "invalid" and "available: bash, submit" in (other.error or "")
    hermes = make_environment("shell", TASK, action_format="hermes")
    assert [s["function"]["name"] for s in hermes.tool_schemas() or []] == ["bash", "submit"]
    call = hermes.parse(
        '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": ""}}</tool_call>', turn=0
    )
    assert call.kind == "invalid" and "unknown tool 'write_file'" in (call.error or "")


def test_tools_in_prompt_names_gives_the_template_each_tools_name_only():
    from pydantic import ValidationError

    from temper.envs import environment_options
    from temper.jobspec import EnvironmentSpec

    spec = EnvironmentSpec(kind="code", action_format="hermes", tools_in_prompt="names")
    env = make_environment("code", TASK, **environment_options(spec))
    full = code(action_format="hermes")
    assert env.tool_schemas() == [
        {"type": "function", "function": {"name": t.function.name}} for t in full.tools
    ]
    names = [t["function"]["name"] for t in env.tool_schemas()]
    assert names == ["bash", "python", "write_file", "read_file", "submit"]
    tok = default_tokenizer()
    short, whole = env.first_prompt_ids(tok), full.first_prompt_ids(tok)
    described = full.tools[0].function.description
    assert described and described in tok.decode(whole) and described not in tok.decode(short)
    assert '"name": "write_file"' in tok.decode(short) and len(short) < len(whole) * 0.7
    env.check_template(tok)  # the door renders what the episodes will
    # the model's calls are still parsed against the whole tool: its arguments and command
    action = env.parse('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>', turn=0)
    assert action.kind == "sandbox" and action.format_ok and action.calls[0]["function"]["name"] == "bash"

    with pytest.raises(ValidationError, match="tools_in_prompt applies to function-calling formats"):
        EnvironmentSpec(kind="code", action_format="code_block", tools_in_prompt="names")
    with pytest.raises(ValidationError, match="tools_in_prompt: not with kind agent"):
        EnvironmentSpec(
            kind="agent", action_format="hermes", tools_in_prompt="names", agent={"command": "true"}
        )
    with pytest.raises(ValidationError, match="tools_in_prompt"):
        EnvironmentSpec(kind="code", action_format="hermes", tools_in_prompt="short")
