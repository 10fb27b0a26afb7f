"""Preference pairs (``kind: preference``), the data of reward_model and dpo jobs: the
explicit-prompt and implicit-prompt forms, stored split, and every malformed pair refused
with its line."""

from __future__ import annotations

import json

import pytest

from temper.tasks.models import TaskFormatError, parse_tasks


def lines(*items: dict) -> str:
    return "".join(json.dumps(i) + "\n" for i in items)


U = {"role": "user", "content": "Say apple."}


def a(text: str, **marks) -> dict:
    return {"role": "assistant", "content": text, **marks}


def test_both_forms_store_the_prompt_and_the_two_continuations():
    implicit = {"chosen": [U, a("apple")], "rejected": [U, a("pear")]}
    explicit = {"messages": [U], "chosen": [a("apple")], "rejected": [a("pear")]}
    multi = {
        "chosen": [U, a("let me see"), {"role": "user", "content": "well?"}, a("apple")],
        "rejected": [U, a("let me see"), {"role": "user", "content": "well?"}, a("no")],
    }
    tasks = parse_tasks(lines(implicit, explicit, multi), filename="p.jsonl")
    assert [t.kind for t in tasks] == ["preference"] * 3 and [t.id for t in tasks] == [
        "line-1",
        "line-2",
        "line-3",
    ]
    for t in tasks[:2]:
        assert t.prompt == "Say apple." and [m.content for m in t.messages or []] == ["Say apple."]
        assert [m.content for m in t.chosen or []] == ["apple"] and [m.content for m in t.rejected or []] == [
            "pear"
        ]
    assert tasks[0].prompt_hash == tasks[1].prompt_hash  # the same pair whole: a duplicate
    assert [m.content for m in tasks[2].messages or []] == ["Say apple.", "let me see", "well?"]
    assert [m["content"] for m in tasks[2].spec_dict()["chosen"]] == ["apple"]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"chosen": [U, a("x")], "rejected": [U, a("x")]}, "the same conversation, or one only extends"),
        ({"chosen": [U, a("x")], "rejected": [U, a("x"), U, a("y")]}, "one only extends the other"),
        (
            {"chosen": [U, a("x")], "rejected": [{"role": "user", "content": "other"}, a("y")]},
            "share no first message",
        ),
        (
            {
                "chosen": [U, a("x"), {"role": "user", "content": "p"}, a("y")],
                "rejected": [U, a("x"), {"role": "user", "content": "q"}, a("y")],
            },
            "first differ at message 2, which is not an assistant turn",
        ),
        (
            {"messages": [U], "chosen": [U], "rejected": [a("y")]},
            "chosen.0: a continuation starts with an assistant",
        ),
        ({"messages": [U], "chosen": [a("x")], "rejected": [a("x")]}, "the same continuation"),
        (
            {"messages": [U], "chosen": [a("x"), U], "rejected": [a("y")]},
            "chosen (after the 1 prompt messages)",
        ),
        (
            {"messages": [U, a("x")], "chosen": [a("y")], "rejected": [a("z")]},
            "the prompt ends before an assistant",
        ),
        (
            {"messages": [{**U}], "chosen": [a("x", weight=0)], "rejected": [a("y")]},
            "no assistant turn is trained",
        ),
        ({"kind": "preference", "messages": [U], "chosen": [a("x")]}, "needs chosen and rejected"),
        (
            {"kind": "chat", "messages": [U, a("x")], "chosen": [a("y")]},
            "chosen and rejected apply to preference",
        ),
        (
            {"kind": "preference", "messages": [U], "chosen": [a("x")], "rejected": [a("y")], "answer": "3"},
            "has no answer",
        ),
    ],
)
def test_a_bad_pair_is_refused_naming_its_line(item, message):
    with pytest.raises(TaskFormatError) as exc:
        parse_tasks(lines({"chosen": [U, a("ok")], "rejected": [U, a("no")]}, item), filename="p.jsonl")
    assert [line for line, _, _ in exc.value.errors] == [2]
    assert message in str(exc.value), str(exc.value)
