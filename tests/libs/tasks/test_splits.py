"""Held-out tasks: a task set split at upload by seed or by a metadata field, the part
stored on each task's row, and every training path drawing from the train part only."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from fastapi import FastAPI
from pydantic import ValidationError
from sqlalchemy import select

from services.dispatcher.api.tasksets import make_router
from temper.db import Task, TaskSet, Tenant
from temper.storage import LocalStore
from temper.tasks import service
from temper.tasks.models import parse_tasks
from temper.tasks.splits import HeldOut, SplitError, held_out_ids

pytestmark = pytest.mark.timeout(60)


def tasks_jsonl(n: int, *, field: str | None = None) -> str:
    lines = []
    for i in range(n):
        meta = {field: "test" if i % 4 == 0 else "train"} if field else {}
        lines.append(json.dumps({"id": f"t{i:02d}", "kind": "math", "prompt": f"{i}+1?", "answer": str(i + 1),
                                 "metadata": meta}))  # fmt: skip
    return "\n".join(lines) + "\n"


def test_a_split_by_seed_holds_out_round_fraction_whatever_the_order_and_depends_on_the_seed():
    tasks = parse_tasks(tasks_jsonl(20))
    rule = HeldOut(fraction=0.25, seed=3)
    held = held_out_ids(tasks, rule)
    assert len(held) == 5
    shuffled = list(tasks)
    random.Random(1).shuffle(shuffled)
    assert held_out_ids(shuffled, rule) == held  # the ids and the seed decide, not the file's order
    assert held_out_ids(tasks, HeldOut(fraction=0.25, seed=3)) == held  # and again
    others = {frozenset(held_out_ids(tasks, HeldOut(fraction=0.25, seed=s))) for s in range(10)}
    assert len(others) > 5  # another seed, another choice


def test_a_split_by_field_holds_out_the_tasks_with_those_values():
    tasks = parse_tasks(tasks_jsonl(12, field="split"))
    assert held_out_ids(tasks, HeldOut(field="split", values=["test"])) == {"t00", "t04", "t08"}


def test_bad_rules_are_refused_with_what_is_wrong():
    tasks = parse_tasks(tasks_jsonl(4, field="split"))
    with pytest.raises(SplitError, match="holds out none of the 4 tasks"):
        held_out_ids(tasks, HeldOut(fraction=0.1))
    with pytest.raises(SplitError, match="holds out all 4 tasks"):
        held_out_ids(tasks, HeldOut(field="split", values=["test", "train"]))
    with pytest.raises(SplitError, match="holds out none"):
        held_out_ids(tasks, HeldOut(field="origin", values=["x"]))
    for bad, words in (
        ({}, "one of the two"),
        ({"fraction": 0.2, "field": "split", "values": ["a"]}, "one of the two"),
        ({"field": "split"}, "needs the values"),
        ({"fraction": 0.2, "values": ["a"]}, "values apply to a split by field"),
        ({"fraction": 1.0}, "less than 1"),
    ):
        with pytest.raises(ValidationError, match=words):
            HeldOut.model_validate(bad)


async def test_the_upload_stores_each_tasks_part_and_training_draws_from_train_only(database, tmp_path):
    async with database.session() as s:
        s.add(Tenant(id="acme", name="acme"))

    class Rt:  # the parts of Runtime the routes use
        db = database
        store = LocalStore(tmp_path / "objects")

    app = FastAPI()
    app.state.runtime = Rt()
    app.include_router(make_router(lambda: "acme", enqueue=lambda ts: "v"))
    ndjson = {"content-type": "application/x-ndjson"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/tasksets?name=split&held_out_fraction=0.25&held_out_seed=7",
                              content=tasks_jsonl(20), headers=ndjson)  # fmt: skip
        assert r.status_code == 201, r.text
        view = r.json()
        assert view["held_out"] == {"fraction": 0.25, "seed": 7, "values": [], "tasks": 20, "held_out": 5}
        by_field = await client.post(
            "/v1/tasksets?name=byfield&held_out_field=split&held_out_values=test",
            content=tasks_jsonl(12, field="split"), headers=ndjson,
        )  # fmt: skip
        assert by_field.status_code == 201 and by_field.json()["held_out"]["held_out"] == 3, by_field.text
        # bad rules: 422 naming what is wrong, and nothing stored
        bad = await client.post("/v1/tasksets?name=none&held_out_fraction=0.01", content=tasks_jsonl(20),
                                headers=ndjson)  # fmt: skip
        assert bad.status_code == 422 and "holds out none of the 20 tasks" in bad.text, bad.text
        bad = await client.post("/v1/tasksets?held_out_field=split", content=tasks_jsonl(4), headers=ndjson)
        assert bad.status_code == 422 and "needs the values" in bad.text, bad.text
        shown = (await client.get(f"/v1/tasksets/{view['id']}")).json()
        parts = {t["key"]: t["split"] for t in shown["tasks"]}
    wanted = held_out_ids(parse_tasks(tasks_jsonl(20)), HeldOut(fraction=0.25, seed=7))
    assert {k for k, part in parts.items() if part == "held_out"} == wanted
    async with database.session() as s:
        assert await s.scalar(select(TaskSet.id).where(TaskSet.name == "none")) is None
        train = {t.key for t in await service.sampleable_tasks(s, view["id"])}
        held = {t.key for t in await service.sampleable_tasks(s, view["id"], "held_out")}
        every = {t.key for t in await service.sampleable_tasks(s, view["id"], "all")}
        stored = dict(
            (await s.execute(select(Task.key, Task.split).where(Task.task_set_id == view["id"]))).all()
        )
    assert held == wanted and train == every - wanted and len(every) == 20
    assert {k for k, part in stored.items() if part == "held_out"} == wanted
