"""Conversations as task sets (kind chat): OpenAI fine-tuning lines upload as they are,
training marks are checked per message, and bad lines name their line and message."""

from __future__ import annotations

import json

import pytest

from temper.tasks.models import TaskFormatError, TaskKind, TaskSpec, parse_tasks


def jsonl(*items: dict) -> str:
    return "".join(json.dumps(i) + "\n" for i in items)


GOOD = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "weight": 0},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5", "train": True},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
}  # fmt: skip


def test_an_openai_fine_tuning_line_is_a_chat_task():
    [task] = parse_tasks(jsonl(GOOD), filename="data.jsonl")
    assert (task.id, task.kind, task.prompt) == ("line-1", TaskKind.chat, "hi")
    assert [m.trained for m in task.messages] == [False, False, False, False, True, False, True]
    # OpenAI's JSON-string arguments are kept as the object templates render
    assert task.messages[4].tool_calls[0].function.arguments == {"a": 2, "b": 3}
    again = TaskSpec.from_row(task.id, "chat", task.prompt, task.spec_dict(), {})
    assert again == task and again.prompt_hash == task.prompt_hash


def test_the_same_question_answered_twice_is_not_a_duplicate():
    other = json.loads(json.dumps(GOOD))
    other["messages"][-1]["content"] = "five"
    a, b = parse_tasks(jsonl(GOOD, other), filename="data.jsonl")
    assert a.prompt == b.prompt and a.prompt_hash != b.prompt_hash


@pytest.mark.parametrize(
    ("messages", "field", "message"),
    [
        ([{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}],
         "messages.0", "weight applies to assistant messages only (this one is user)"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 1, "train": False}],
         "messages.1", "train: false and weight: 1 disagree"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 2}],
         "messages.1.weight", "Input should be 0 or 1"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}],
         "(task)", "no assistant turn is trained"),
        ([{"role": "user", "content": "q"}], "(task)", "ends with a user message"),
        ([{"role": "assistant", "content": "a"}], "(task)", "starts with a system or user message"),
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}, {"role": "assistant", "content": "a"}],
         "(task)", "messages.1: a tool message follows an assistant"),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
         "messages.1.tool_calls.0.function", "arguments is not valid JSON"),
        ([{"role": "robot", "content": "q"}], "messages.0.role", "Input should be 'system', 'user'"),
        ([{"role": "user", "content": [{"type": "text", "text": "q"}]}, {"role": "assistant", "content": "a"}],
         "messages.0.content", "Input should be a valid string"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "refusal": None}],
         "messages.1.refusal", "Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_a_bad_conversation_names_its_line_and_message(messages, field, message):
    with pytest.raises(TaskFormatError) as exc:
        parse_tasks(jsonl(GOOD, {"messages": messages}), filename="data.jsonl")
    [(line, got_field, got)] = exc.value.errors
    assert (line, got_field) == (2, field) and message in got, exc.value.errors


def test_chat_fields_belong_to_chat_tasks_and_run_fields_do_not():
    with pytest.raises(TaskFormatError, match="a chat task has no tests"):
        parse_tasks(jsonl({**GOOD, "id": "a", "kind": "chat", "tests": "assert 1"}), filename="d.jsonl")
    code = {"id": "b", "prompt": "p", "tests": "assert 1", "messages": GOOD["messages"], "kind": "code"}
    with pytest.raises(TaskFormatError, match="apply to chat tasks only"):
        parse_tasks(jsonl(code), filename="d.jsonl")
