"""Episodes on models whose chat templates are shaped as real ones ship (Qwen2.5, Llama
3.1, Mistral v0.3, Gemma 3: ``tests/libs/policy/templates``), end to end through the
episode state machine with test doubles of its peers: multi-turn episodes with tool calls
in each model's own format are scored, and their trajectories are token-exact (the whole
conversation as the template renders it, calls as OpenAI ``tool_calls``, results with
their ``tool_call_id``); a template that cannot render a turn fails the episode at once
with its own error, never a lease expiry, and the job fails saying so."""

from __future__ import annotations

import time

import pytest
from episode_peers import (
    episodes_of,
    job_spec,
    job_state,
    seed,
    start_harness,
    steps_of,
    submit_job,
    wait_for,
)

from temper.envs import make_environment
from temper.events import InferenceRequest, InferenceResult
from temper.policy import ChatTokenizer
from temper.storage import object_key
from temper.trajectory import Trajectory
from tests.libs.policy.real_templates import SHIPPED, hub_tokenizer

pytestmark = pytest.mark.timeout(120)

TASKS = {f"m{i}": {"kind": "math", "prompt": "Compute 17 * 23.", "spec": {}} for i in range(2)}


def _spec(model: str, name: str, **env):
    s = SHIPPED[name]
    environment = {
        "kind": "math",
        "max_turns": 3,
        "action_format": s.parser,
        **({"tool_role": s.tool_role} if s.tool_role else {}),
        **s.job,
        **env,
    }
    return job_spec(
        policy__model=model,
        environment=environment,
        rewards={"answer_match": 1.0},
        tasks__group_size=2,
        schedule__episodes_per_iteration=2,
    )


def _model_says(h, tok: ChatTokenizer, name: str) -> None:
    """The fake gateway answers as the model would: a python call in its format, then the answer."""
    answer = h.peers.reply
    s = SHIPPED[name]

    def reply(msg):
        if not isinstance(msg, InferenceRequest):
            return answer(msg)
        text = s.call_text("print(17 * 23)") if msg.turn == 0 else s.answer
        ids = [*tok.encode(text), tok.end_of_turn_ids[0]]
        return InferenceResult(
            job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt,
            token_ids=ids, logprobs=[-0.5] * len(ids), text=tok.decode(ids),  # the engine drops specials
            finish_reason="stop", policy_version=0, backend="fake",
        )  # fmt: skip

    h.peers.reply = reply


@pytest.mark.parametrize("name", sorted(SHIPPED))
async def test_multi_turn_episodes_with_tools_are_scored_token_exact(tmp_path, database_url, name):
    model = tmp_path / name
    tok = hub_tokenizer(name, model)
    h = await start_harness(tmp_path, database_url)
    _model_says(h, tok, name)
    try:
        await seed(h.db, tasks=TASKS)
        job = await submit_job(h.db, _spec(str(model), name))

        async def ended() -> bool:
            return await job_state(h.db, job) in ("completed", "failed")

        await wait_for(ended, limit_s=60, what="the job ended")
        eps = await episodes_of(h.db, job)
        assert {e.state for e in eps} == {"scored"}, [e.state_reason for e in eps]
        ep = eps[0]
        steps = await steps_of(h.db, ep.id)
        assert [(s.turn, s.kind) for s in steps] == [
            (0, "inference"),
            (0, "sandbox"),
            (1, "inference"),
            (1, "reward"),
        ]
        action = steps[0].result["action"]
        assert action["command"] == {"kind": "run_python", "code": "print(17 * 23)"}, action

        traj = Trajectory.model_validate_json(
            await h.runtime.store.get(object_key("acme", job, "trajectories", f"{ep.id}.json"))  # type: ignore[union-attr]
        )
        ids, mask, _ = traj.flat()
        model_ids = [i for i, m in zip(ids, mask, strict=True) if m]
        assert model_ids == steps[0].result["token_ids"] + steps[2].result["token_ids"]

        env = make_environment(
            "math", TASKS["m0"], action_format=SHIPPED[name].parser, tool_role=SHIPPED[name].tool_role,
            **SHIPPED[name].job,
        )  # fmt: skip
        observation = steps[1].result["observation"]
        calls = action["calls"]
        if SHIPPED[name].tool_role == "user":
            call = {"role": "assistant", "content": SHIPPED[name].call_text("print(17 * 23)")}
        else:
            call = {"role": "assistant", "content": "", "tool_calls": calls}
        conversation = [
            *env.first_messages(),
            call,
            *env.observation_messages([observation], calls=calls),
            {"role": "assistant", "content": SHIPPED[name].answer},
        ]
        whole = tok.render(conversation, tools=env.tool_schemas(), add_generation_prompt=False)
        assert [*ids, *tok.close_turn(ids)] == whole
    finally:
        await h.stop()


async def test_a_template_error_in_an_episode_fails_it_at_once_with_the_error(tmp_path, database_url):
    """Gemma 3's template with tool results in the tool role (a job that went around the
    door): the result of the first tool call cannot be rendered. The episode fails as
    soon as the sandbox answers, with the template's words, after one attempt; the job
    fails because every episode did."""
    model = tmp_path / "gemma"
    tok = hub_tokenizer("gemma3", model)
    h = await start_harness(tmp_path, database_url, lease_s=300.0)  # a lease expiry would take minutes
    _model_says(h, tok, "gemma3")
    try:
        await seed(h.db, tasks=TASKS)
        started = time.monotonic()
        job = await submit_job(h.db, _spec(str(model), "gemma3", tool_role="tool"))

        async def ended() -> bool:
            return await job_state(h.db, job) in ("completed", "failed")

        await wait_for(ended, limit_s=30, what="the job ended")
        assert time.monotonic() - started < 20, "no lease waited out"
        eps = await episodes_of(h.db, job)
        alternate = "Conversation roles must alternate user/assistant/user/assistant/..."
        for ep in eps:
            assert ep.state == "failed" and ep.state_reason.startswith("template_error: "), ep.state_reason
            assert alternate in ep.state_reason and "attempts" not in ep.state_reason
            steps = await steps_of(h.db, ep.id)
            assert [(s.kind, s.state, s.attempt) for s in steps] == [
                ("inference", "done", 0),
                ("sandbox", "done", 0),
            ]
        async with h.db.session() as s:
            from temper.db import Job

            row = await s.get(Job, job)
            assert (
                row.state == "failed" and "2 x template_error: the chat template failed: " in row.state_reason
            )
            assert alternate in row.state_reason
    finally:
        await h.stop()
