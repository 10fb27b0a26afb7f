"""Agent episodes' base URLs on the gateway (``/agent/<episode>/v1``), driven by the real
``openai`` client as an unchanged agent harness drives them: tool calls in OpenAI's shape,
``stream: true``, per-episode keys (one episode cannot write into another's trace), the
job's call budget, every call recorded durably (a row and its body) before it is
answered, and the trajectory built from the records token for token (a rewritten history
becomes a sequence of its own). On SQLite and on the real Postgres."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from services.dispatcher.trajectories import build_agent_trajectory
from services.inference_gateway.agents import AgentProxy
from services.inference_gateway.app import proxy_app
from services.inference_gateway.backends import Backend, BackendResult, GenerateRequest, Served
from services.inference_gateway.inference import Inference
from temper import metrics
from temper.agent_traces import calls_of, issue_key
from temper.clock import utcnow
from temper.db import AgentCall, Database, Episode, Job, Tenant
from temper.events import RewardResult
from temper.jobspec import parse_spec
from temper.policy import default_tokenizer
from temper.settings.inference import BackendSpec, InferenceSettings
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(60)
TOK = default_tokenizer()
EOT = TOK.end_of_turn_ids[0]
PYTHON = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
CALL_TEXT = '<tool_call>{"name": "python", "arguments": {"code": "print(17 * 23)"}}</tool_call>'
SPEC = {
    "name": "agents",
    "policy": {"model": "m", "sampling": {"temperature": 0.7, "top_p": 0.9, "max_tokens": 64}},
    "tasks": {"taskset": "ts", "group_size": 1},
    "schedule": {"episodes_per_iteration": 1},
    "environment": {
        "kind": "agent",
        "action_format": "hermes",
        "max_turns": 3,
        "agent": {"command": "python3 agent.py"},
    },
    "rewards": {"answer_match": 1.0},
}


class ScriptedPolicy(Backend):
    """Answers each call with the next scripted reply (its token ids, then the end-of-turn
    token), logprobs -0.01 × (position + 1), policy version 2; records what it was asked."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(BackendSpec(name="scripted", url="http://scripted"), model_name="m")
        self.replies = list(replies)
        self.asked: list[GenerateRequest] = []

    async def complete(self, req: GenerateRequest) -> BackendResult:
        self.asked.append(req)
        ids = [*TOK.encode(self.replies.pop(0)), EOT]
        return BackendResult(
            prompt_ids=req.prompt_ids,
            token_ids=ids,
            logprobs=[-0.01 * (i + 1) for i in range(len(ids))],
            text=TOK.decode(ids),
            finish_reason="stop",
            stop_reason=EOT,
            policy_version=2,
            backend=self.name,
        )

    async def load_weights(self, **_: Any) -> float:
        return 0.0

    async def served(self) -> Served:
        return Served(base="m")

    async def release(self, job_id: str) -> float:
        return 0.0

    async def health(self) -> bool:
        return True


class Gateway:
    def __init__(
        self, database: Database, store: LocalStore, policy: ScriptedPolicy, inference: Inference
    ) -> None:
        self.database, self.store, self.policy, self.inference = database, store, policy, inference
        self.keys: dict[str, str] = {}

    def proxy(self) -> AgentProxy:
        """A proxy as a fresh gateway replica has it (no session in memory)."""
        return AgentProxy(self.inference, database=lambda: self.database, store=lambda: self.store)

    def client(
        self, episode: str, key: str | None = None, proxy: AgentProxy | None = None
    ) -> openai.AsyncOpenAI:
        app = proxy_app(self.inference, agents=proxy or self.proxy())
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        return openai.AsyncOpenAI(
            base_url=f"http://gateway/agent/{episode}/v1",
            api_key=key if key is not None else self.keys[episode],
            http_client=http,
        )

    async def calls(self, episode: str) -> list[Any]:
        async with self.database.engine.connect() as conn:
            return await calls_of(conn, self.store, episode)


async def make_gateway(
    database: Database, tmp_path: Path, replies: list[str], *, max_turns: int = 3
) -> Gateway:
    spec = parse_spec({**SPEC, "environment": {**SPEC["environment"], "max_turns": max_turns}})
    async with database.session() as s:
        s.add(Tenant(id="acme", name="Acme"))
        await s.flush()
        s.add(
            Job(
                id="job-a",
                tenant_id="acme",
                name="agents",
                spec=spec.model_dump(mode="json"),
                state="running",
            )
        )
        await s.flush()
        for ep, state in (
            ("ep-1", "acting"),
            ("ep-2", "acting"),
            ("ep-done", "scored"),
            ("ep-old", "acting"),
        ):
            s.add(Episode(id=ep, job_id="job-a", tenant_id="acme", task_id="t", group_id="g", state=state))
    keys = {}
    async with database.session() as s:
        for ep in ("ep-1", "ep-2", "ep-done", "ep-old"):
            ttl = timedelta(seconds=-1 if ep == "ep-old" else 600)
            keys[ep] = issue_key(
                s, episode_id=ep, job_id="job-a", tenant_id="acme", expires_at=utcnow() + ttl
            )
    policy = ScriptedPolicy(replies)
    inference = Inference(
        InferenceSettings(backends=[], checkpoint_cache_dir=str(tmp_path / "c")), backends=[policy]
    )
    await inference.start(health_loop=False)
    gw = Gateway(database, LocalStore(tmp_path / "objects"), policy, inference)
    gw.keys = keys
    return gw


async def test_an_openai_client_agent_calls_tools_and_every_call_is_recorded_token_exact(database, tmp_path):
    gw = await make_gateway(database, tmp_path, [CALL_TEXT, "The answer is 391."])
    client = gw.client("ep-1")
    messages: list[Any] = [{"role": "user", "content": "What is 17 * 23? Use python."}]
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=messages, tools=[PYTHON], max_tokens=500, temperature=0.0
    )
    # the job's sampling, the call's max_tokens capped at the job's: said in a header
    assert raw.headers["x-temper-sampling"] == "temperature=0.7; top_p=0.9; max_tokens=64"
    first = raw.parse()
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls or []
    assert call.function.name == "python" and json.loads(call.function.arguments) == {
        "code": "print(17 * 23)"
    }
    sampled = gw.policy.asked[0].sampling
    assert (sampled.temperature, sampled.top_p, sampled.max_tokens) == (0.7, 0.9, 64)
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "391"}]

    stream = await client.chat.completions.create(
        model="m", messages=messages, tools=[PYTHON], stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The answer is 391."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(TOK.encode("The answer is 391.")) + 1

    one, two = await gw.calls("ep-1")
    async with database.engine.connect() as conn:
        rows = (await conn.execute(select(AgentCall.extends, AgentCall.attempt, AgentCall.body_key))).all()
    assert [(r[0], r[1]) for r in rows] == [(False, 0), (True, 0)]
    assert all(r[2].startswith("tenants/acme/jobs/job-a/agent-calls/ep-1/") for r in rows)
    # the second prompt is the first prompt, the ids sampled, then the tool turn: never re-tokenised
    head = [*one.prompt_ids, *one.token_ids]
    assert two.prompt_ids[: len(head)] == head
    assert TOK.decode(two.prompt_ids[len(head) :], skip_special=False) == "<|tool|>391<|end|><|assistant|>"
    assert one.token_ids == [*TOK.encode(CALL_TEXT), EOT] and one.policy_version == 2
    assert one.reply["tool_calls"][0]["id"] == call.id

    reward = RewardResult(job_id="job-a", episode_id="ep-1", task_id="t", reward=1.0)
    ep = Episode(
        id="ep-1",
        job_id="job-a",
        tenant_id="acme",
        task_id="t",
        group_id="g",
        turn=0,
        iteration=0,
        timings={},
    )
    traj = build_agent_trajectory(ep, [], [one, two], reward, TOK, finished_at=utcnow())
    assert [s.role for s in traj.segments] == ["prompt", "model", "observation", "model"]
    [(ids, mask, logprobs)] = traj.samples()
    assert ids == [*two.prompt_ids, *two.token_ids]
    model_positions = [i for i, m in enumerate(mask) if m]
    assert [ids[i] for i in model_positions] == [*one.token_ids, *two.token_ids]
    assert [logprobs[i] for i in model_positions] == [*one.logprobs, *two.logprobs]
    assert traj.behaviour_version == 2 and traj.rewards["calls"] == 2


async def test_a_rewritten_history_becomes_a_separate_token_exact_sample(database, tmp_path):
    gw = await make_gateway(database, tmp_path, [CALL_TEXT, "391."])
    client = gw.client("ep-1")
    user = {"role": "user", "content": "What is 17 * 23?"}
    first = await client.chat.completions.create(model="m", messages=[user], tools=[PYTHON])
    # the agent compacts its history: the call and its result become a note in the user turn
    rewritten = [{"role": "user", "content": "What is 17 * 23? (python printed 391)"}]
    await client.chat.completions.create(model="m", messages=rewritten, tools=[PYTHON])
    one, two = await gw.calls("ep-1")
    assert first.choices[0].message.tool_calls and not two.extends
    reward = RewardResult(job_id="job-a", episode_id="ep-1", task_id="t", reward=0.5)
    ep = Episode(
        id="ep-1",
        job_id="job-a",
        tenant_id="acme",
        task_id="t",
        group_id="g",
        turn=0,
        iteration=0,
        timings={},
    )
    traj = build_agent_trajectory(ep, [], [one, two], reward, TOK, finished_at=utcnow())
    assert [s.role for s in traj.segments] == ["prompt", "model", "prompt", "model"]
    samples = traj.samples()
    assert len(samples) == 2 and traj.rewards["sequences"] == 2
    for (ids, mask, logprobs), call in zip(samples, (one, two), strict=True):
        assert ids == [*call.prompt_ids, *call.token_ids]
        assert mask == [False] * len(call.prompt_ids) + [True] * len(call.token_ids)
        assert logprobs[len(call.prompt_ids) :] == call.logprobs
    assert two.prompt_ids == TOK.render([rewritten[0]], tools=[PYTHON])
    with pytest.raises(ValueError, match="2 sequences, not one"):
        traj.flat()


async def test_one_episode_cannot_write_into_another_episodes_trace(database, tmp_path):
    gw = await make_gateway(database, tmp_path, ["hi"] * 4)
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (gw.client("ep-1", key=gw.keys["ep-2"]), openai.PermissionDeniedError, "belongs to another episode"),
        (gw.client("ep-1", key="tmpa-not-a-key"), openai.AuthenticationError, "unknown key"),
        (gw.client("ep-done"), openai.PermissionDeniedError, "ep-done is scored"),
        (gw.client("ep-old"), openai.PermissionDeniedError, "key expired"),
    ]
    for client, error, said in cases:
        with pytest.raises(error, match=said):
            await client.chat.completions.create(model="m", messages=user)
    with pytest.raises(openai.PermissionDeniedError):
        await gw.client("ep-1", key=gw.keys["ep-2"]).models.list()
    app = proxy_app(gw.inference, agents=gw.proxy())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/agent/ep-1/v1/chat/completions", json={"messages": user})
        assert r.status_code == 401 and "no key" in r.json()["detail"]
    assert gw.policy.asked == [] and await gw.calls("ep-1") == [] and await gw.calls("ep-2") == []
    # the rightful key works, and its call lands in its own episode's trace only
    await gw.client("ep-2").chat.completions.create(model="m", messages=user)
    assert len(await gw.calls("ep-2")) == 1 and await gw.calls("ep-1") == []
    assert [m.id for m in (await gw.client("ep-2").models.list()).data] == ["m"]


async def test_the_jobs_call_budget_is_kept_and_the_client_is_told_not_to_retry(database, tmp_path):
    gw = await make_gateway(database, tmp_path, ["a", "b", "c"], max_turns=2)
    client = gw.client("ep-1")
    user = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        await client.chat.completions.create(model="m", messages=user)
    before = metrics.AGENT_CALLS.labels("over_budget")._value.get()
    with pytest.raises(openai.RateLimitError, match="made 2 of its 2 model calls"):
        await client.chat.completions.create(model="m", messages=user)
    assert metrics.AGENT_CALLS.labels("over_budget")._value.get() == before + 1  # x-should-retry: false
    assert len(gw.policy.asked) == 2 and len(await gw.calls("ep-1")) == 2


async def test_a_fresh_gateway_resumes_the_conversation_from_the_record(database, tmp_path):
    gw = await make_gateway(database, tmp_path, [CALL_TEXT, "391."])
    messages: list[Any] = [{"role": "user", "content": "17 * 23?"}]
    first = await gw.client("ep-1").chat.completions.create(model="m", messages=messages, tools=[PYTHON])
    [call] = first.choices[0].message.tool_calls or []
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "391"}]
    # another replica, which never saw the first call, answers the second
    await gw.client("ep-1", proxy=gw.proxy()).chat.completions.create(
        model="m", messages=messages, tools=[PYTHON]
    )
    one, two = await gw.calls("ep-1")
    assert two.extends and two.prompt_ids[: len(one.prompt_ids) + len(one.token_ids)] == [
        *one.prompt_ids,
        *one.token_ids,
    ]


async def test_fields_the_gateway_cannot_honour_are_refused_by_name(database, tmp_path):
    gw = await make_gateway(database, tmp_path, ["x"])
    client = gw.client("ep-1")
    user = [{"role": "user", "content": "hi"}]
    for extra, said in (
        ({"n": 2}, "n=2"),
        ({"tool_choice": "required", "tools": [PYTHON]}, "cannot force a call"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError, match=said):
            await client.chat.completions.create(model="m", messages=user, **extra)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(openai.BadRequestError, match="text parts only"):
        await client.chat.completions.create(model="m", messages=image)
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    await client.chat.completions.create(model="m", messages=parts)
    [only] = await gw.calls("ep-1")
    assert only.messages == [{"role": "user", "content": "hi"}] and gw.policy.asked[
        0
    ].prompt_ids == TOK.render([{"role": "user", "content": "hi"}])
