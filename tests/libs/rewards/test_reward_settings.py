"""Reward components with settings (``rewards: {name: {weight: ..., ...}}`` beside ``name:
weight``): each component validates its own, unknown ones are refused, the scorer hands
them to the component; and the transcript the grading components read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import BaseModel, ConfigDict

from temper.events import RewardComponent
from temper.jobspec import JobSpec, SpecError, parse_spec, reward_weights
from temper.rewards import Component, ScoreContext, Scorer
from temper.rewards.transcript import from_steps, from_trajectory
from temper.tasks.models import TaskSpec
from temper.trajectory import Trajectory, TurnRecord

BASE = {"name": "x", "policy": {"model": "m"}, "tasks": {"taskset": "t"}}


def spec(rewards: dict) -> JobSpec:
    return parse_spec({**BASE, "rewards": rewards})


def errors(rewards: dict) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as exc:
        spec(rewards)
    return exc.value.errors


def test_weights_and_settings_side_by_side_survive_the_stored_form():
    s = spec({"tests_passed": 1, "reward_model": {"weight": 0.5, "model": "/models/rm", "max_tokens": 512}})
    assert s.reward_weights() == {"tests_passed": 1.0, "reward_model": 0.5}
    assert s.reward_settings() == {"reward_model": {"model": "/models/rm", "max_tokens": 512}}
    stored = s.model_dump(mode="json")
    assert JobSpec.model_validate(stored) == s
    assert reward_weights(stored["rewards"]) == {"tests_passed": 1.0, "reward_model": 0.5}


def test_each_component_checks_its_own_settings():
    assert errors({"reward_model": {"weight": 1, "model": "/m", "temperature": 2}}) == [
        ("rewards.reward_model.temperature", "Extra inputs are not permitted")
    ]
    assert errors({"reward_model": 1.0}) == [("rewards.reward_model.model", "Field required")]
    assert errors({"reward_model": {"weight": 1, "model": "/m", "max_tokens": 3}})[0][0] == (
        "rewards.reward_model.max_tokens"
    )
    assert errors({"tests_passed": {"weight": 1, "strict": True}}) == [
        ("rewards.tests_passed", "tests_passed takes no settings besides weight (given: strict)")
    ]
    assert "needs its weight" in errors({"reward_model": {"model": "/m"}})[0][1]
    assert "a finite number" in errors({"tests_passed": {"weight": "high"}})[0][1]
    assert "a finite weight" in errors({"tests_passed": float("inf")})[0][1]


class ScaleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    scale: float = 1.0


class Scaled(Component):
    """Its value is its setting: what the scorer handed it."""

    name = "scaled"
    settings_model = ScaleSettings

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        return RewardComponent(value=self.settings(ctx).scale)


async def test_the_scorer_hands_each_component_its_settings():
    manager = SimpleNamespace(settings=SimpleNamespace(python="python3"))  # math runs nothing in a sandbox
    scorer = Scorer(manager, overrides={"scaled": Scaled()})  # type: ignore[arg-type]
    task = TaskSpec(id="m", kind="math", prompt="1+1?", answer="2")
    reward, comps = await scorer.score(
        task, {"answer": "2"}, {"answer_match": 1.0, "scaled": 0.5}, settings={"scaled": {"scale": 3.0}}
    )
    assert comps["scaled"].value == 3.0 and reward == 1.0 + 0.5 * 3.0
    _, comps = await scorer.score(task, {"answer": "2"}, {"scaled": 1.0})
    assert comps["scaled"].value == 1.0  # no settings given: the defaults


def step(kind: str, turn: int, result: dict, state: str = "done") -> SimpleNamespace:
    return SimpleNamespace(kind=kind, turn=turn, result=result, state=state)


def test_the_transcript_of_steps_and_of_the_trajectory_agree():
    steps = [
        step("inference", 0, {"text": "<tool_call>ls</tool_call>"}),
        step("sandbox", 0, {"observation": "a.py b.py"}),
        step("inference", 1, {"text": "bad", "observation": "Error: no action"}),  # no sandbox step
        step("inference", 2, {"text": "retried"}, state="failed"),  # not a turn the episode kept
        step("inference", 2, {"text": "done"}),
        step("reward", 2, {"reward": 1.0}),
    ]
    t = from_steps("List the files.", steps)
    assert t.messages == [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "<tool_call>ls</tool_call>"},
        {"role": "tool", "content": "a.py b.py"},
        {"role": "assistant", "content": "bad"},
        {"role": "tool", "content": "Error: no action"},
        {"role": "assistant", "content": "done"},
    ]
    assert t.last_reply() == "done" and t.as_text().startswith(
        "User: List the files.\n\nAssistant: <tool_call>"
    )
    traj = Trajectory(
        job_id="j", episode_id="e", task_id="t", group_id="g", segments=[], reward=0.0,
        turns=[TurnRecord(turn=0, action_text="<tool_call>ls</tool_call>", observation="a.py b.py"),
               TurnRecord(turn=1, action_text="bad", observation="Error: no action"),
               TurnRecord(turn=2, action_text="done")],
    )  # fmt: skip
    assert from_trajectory("List the files.", traj) == t and from_trajectory("x", traj).digest() != t.digest()
    assert from_steps("List the files.", steps, tool_role="user").messages[2]["role"] == "user"
