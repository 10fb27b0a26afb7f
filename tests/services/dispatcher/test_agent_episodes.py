"""Agent episodes (``environment.kind: agent``) through the dispatcher: the episode starts
its agent's run as a sandbox step (the episode's base URL and key in the command's
environment, an allowlist network that reaches the gateway), the agent calls the policy
through the gateway's proxy with the real ``openai`` client, and when the run ends the
reward request carries its answer and the trajectory is built from the recorded calls. A
run that never called the model fails its episode at once with what the program said.
The sandbox worker and the scorer are test doubles; the gateway's agent proxy is real.
On SQLite and on the real Postgres."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from episode_peers import Peers, episodes_of, job_spec, seed, start_harness, steps_of, submit_job, wait_for
from sqlalchemy import select

from services.inference_gateway.agents import AgentProxy
from services.inference_gateway.app import proxy_app
from services.inference_gateway.inference import Inference
from temper.agent_traces import calls_of, key_hash
from temper.db import AgentKey, Job
from temper.events import RewardRequest, SandboxRequest, SandboxResult, Topics
from temper.settings.inference import InferenceSettings
from temper.trajectory import Trajectory
from tests.services.inference_gateway.test_agent_proxy import CALL_TEXT, TOK, ScriptedPolicy

pytestmark = pytest.mark.timeout(60)
GATEWAY = "http://gateway.test:8001"
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
AGENT = {"command": "python3 agent.py", "files": {"agent.py": "print('an agent')\n"}}


class AgentWorker(Peers):
    """A sandbox worker double that runs each agent's program as a coroutine: the loop an
    ``openai`` agent has (call with tools, run the call, send the result, stop on an answer),
    against the gateway's real agent proxy at the base URL and with the key the request
    gives. The task ``t2``'s program dies before calling (its image lacks the package)."""

    app: Any = None

    async def answer(self, msg: Any) -> None:
        if not isinstance(msg, SandboxRequest):
            return await super().answer(msg)
        env = msg.action["env"]
        if env["TEMPER_TASK_ID"] == "t2":
            result = {"exit_code": 1, "stdout": "", "stderr": "ModuleNotFoundError: No module named 'openai'"}
        else:
            result = {"exit_code": 0, "stdout": f"thinking...\n{await self.agent(env)}\n", "stderr": ""}
        reply = SandboxResult(
            job_id=msg.job_id,
            episode_id=msg.episode_id,
            turn=msg.turn,
            attempt=msg.attempt,
            session_id=msg.session_id,
            result={**result, "wall_s": 0.5, "cpu_s": 0.1},
            snapshot_key=f"snapshots/{msg.session_id}/0.tar.gz",
            worker="agent-worker",
        )
        assert self.runtime.bus is not None
        await self.runtime.bus.send_message(Topics.SANDBOX_RESULTS, reply)

    async def agent(self, env: dict[str, str]) -> str:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app))
        client = openai.AsyncOpenAI(
            base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], http_client=http
        )
        messages: list[Any] = [{"role": "user", "content": env["TEMPER_TASK_PROMPT"]}]
        for _ in range(int(env["TEMPER_MAX_CALLS"])):
            reply = await client.chat.completions.create(
                model=env["TEMPER_MODEL"], messages=messages, tools=[PYTHON]
            )
            message = reply.choices[0].message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message)
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "391"})
        return "no answer"


async def test_an_agent_episode_runs_its_agent_and_trains_on_its_recorded_calls(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers_class=AgentWorker, agent_url=GATEWAY)
    try:
        await seed(h.db, tasks={"t1": {"prompt": "What is 17 * 23?"}, "t2": {"prompt": "What is 2 + 2?"}})
        policy = ScriptedPolicy([CALL_TEXT, "The answer is\n391"])
        inference = Inference(
            InferenceSettings(backends=[], checkpoint_cache_dir=str(tmp_path / "c")), backends=[policy]
        )
        await inference.start(health_loop=False)
        agents = AgentProxy(inference, database=lambda: h.db, store=lambda: h.runtime.store)
        h.peers.app = proxy_app(inference, agents=agents)  # type: ignore[attr-defined]
        spec = job_spec(
            policy={"model": "m", "sampling": {"max_tokens": 64}},
            environment={"kind": "agent", "action_format": "hermes", "max_turns": 4, "agent": AGENT},
            tasks__group_size=1,
            schedule__episodes_per_iteration=2,
            rewards={"answer_match": 1.0},
        )
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _finished(h.db, job), what="both episodes finished")
        eps = {e.task_id: e for e in await episodes_of(h.db, job)}
        ok, dead = eps["t1"], eps["t2"]

        [run] = [m for m in h.peers.requests["sandbox"] if m.episode_id == ok.id]
        assert isinstance(run, SandboxRequest) and run.turn == 0 and h.peers.requests["inference"] == []
        env = run.action["env"]
        assert run.action["kind"] == "run_command" and run.action["command"] == "python3 agent.py"
        assert (
            env["OPENAI_BASE_URL"] == f"{GATEWAY}/agent/{ok.id}/v1"
            and env["TEMPER_TASK_PROMPT"] == "What is 17 * 23?"
        )
        assert run.action["timeout_s"] == 300.0 and run.limits is not None
        assert run.limits["network"] == "allowlist" and run.limits["allow"] == ["gateway.test:8001"]
        assert run.files["agent.py"] == "print('an agent')\n" and "add.py" in run.files
        async with h.db.session() as s:
            keys = list((await s.execute(select(AgentKey).where(AgentKey.episode_id == ok.id))).scalars())
        assert [k.key_hash for k in keys] == [key_hash(env["OPENAI_API_KEY"])]  # the key itself is not kept

        assert ok.state == "scored"
        [reward] = [m for m in h.peers.requests["reward"] if m.episode_id == ok.id]
        assert isinstance(reward, RewardRequest) and reward.turns_used == 2
        assert reward.submission["kind"] == "agent" and reward.submission["answer"] == "391"
        assert reward.submission["snapshot_key"] == f"snapshots/{ok.id}/0.tar.gz"
        steps = await steps_of(h.db, ok.id)
        assert [(s.turn, s.kind, s.state) for s in steps] == [(0, "sandbox", "done"), (0, "reward", "done")]
        assert steps[0].result is not None and steps[0].result["calls"] == 2

        traj = Trajectory.model_validate_json(await h.runtime.store.get(ok.trajectory_key))  # type: ignore[union-attr,arg-type]
        async with h.db.engine.connect() as conn:
            one, two = await calls_of(conn, h.runtime.store, ok.id)  # type: ignore[arg-type]
        assert [s.role for s in traj.segments] == ["prompt", "model", "observation", "model"]
        [(ids, mask, logprobs)] = traj.samples()
        assert ids == [*two.prompt_ids, *two.token_ids]
        assert [i for i, m in zip(ids, mask, strict=True) if m] == [*one.token_ids, *two.token_ids]
        assert TOK.decode(traj.segments[2].token_ids, skip_special=False) == "<|tool|>391<|end|><|assistant|>"
        assert [t.action["tool_calls"][0]["function"]["name"] for t in traj.turns[:1]] == ["python"]
        assert ok.inference_tokens == len(one.prompt_ids) + len(one.token_ids) + len(two.prompt_ids) + len(
            two.token_ids
        )

        assert dead.state == "failed" and dead.state_reason is not None
        assert dead.state_reason.startswith("agent_error: the agent made no model call (exit code 1):")
        assert "No module named 'openai'" in dead.state_reason
    finally:
        await h.stop()


async def test_an_agent_job_without_a_gateway_address_fails_its_episodes_with_the_reason(
    tmp_path, database_url
):
    h = await start_harness(tmp_path, database_url, peers_class=AgentWorker)  # TEMPER_AGENT__URL unset
    try:
        await seed(h.db, tasks={"t1": {}})
        spec = job_spec(
            environment={"kind": "agent", "action_format": "hermes", "agent": AGENT},
            tasks__group_size=1,
            schedule__episodes_per_iteration=1,
        )
        job = await submit_job(h.db, spec)
        await wait_for(lambda: _finished(h.db, job), what="the episode finished")
        [ep] = await episodes_of(h.db, job)
        assert ep.state == "failed" and "TEMPER_AGENT__URL is not set" in (ep.state_reason or "")
        assert h.peers.requests["sandbox"] == []
    finally:
        await h.stop()


async def _finished(db: Any, job: str) -> bool:
    eps = await episodes_of(db, job)
    async with db.session() as s:
        state = await s.scalar(select(Job.state).where(Job.id == job))
    return bool(eps) and all(e.state in ("scored", "failed", "trained") for e in eps) and state is not None


def test_the_agent_spec_is_checked_at_validation():
    from temper.jobspec import SpecError, parse_spec

    base = job_spec()
    for env, said in (
        ({"kind": "agent", "action_format": "hermes"}, "kind agent needs agent.command"),
        ({"kind": "agent", "agent": AGENT}, "action_format names the tool-call parser"),
        (
            {"kind": "agent", "action_format": "hermes", "agent": AGENT, "system_prompt": "x"},
            "system_prompt: not with",
        ),
        ({"kind": "code", "agent": AGENT}, "agent applies to kind agent only"),
        (
            {"kind": "agent", "action_format": "hermes", "agent": AGENT, "max_episode_tokens": 100},
            "max_episode_tokens: not with kind agent",
        ),
        (
            {"kind": "agent", "action_format": "hermes", "agent": AGENT, "max_episode_s": 60},
            "max_episode_s: not with kind agent",
        ),
        (
            {
                "kind": "agent",
                "action_format": "hermes",
                "agent": {"command": "x", "files": {"../up.py": "x"}},
            },
            "a relative path inside the workspace",
        ),
    ):
        with pytest.raises(SpecError, match=said):
            parse_spec({**base, "environment": env})
    ok = parse_spec(
        {**base, "environment": {"kind": "agent", "action_format": "qwen3_coder", "agent": AGENT}}
    )
    assert ok.environment.agent is not None and json.loads(ok.model_dump_json())["environment"]["agent"] == {
        "command": "python3 agent.py",
        "files": {"agent.py": "print('an agent')\n"},
    }
