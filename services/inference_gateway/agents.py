"""The agent proxy: each agent episode's own OpenAI-compatible base URL on the gateway
(``/agent/<episode>/v1``, docs/agents.md).

A call is taken only with the episode's key (``temper.agent_traces.credential``), runs on
the episode's job's weights with the job's tokenizer and sampling, extends the episode's
conversation token for token where its messages extend the last call's
(``sessions.py``), and is recorded durably (``temper.agent_traces.record_call``: the body
in object storage, then its row) before it is answered. The job's
``environment.max_turns`` bounds the calls of one agent run; ``policy.sampling`` gives the
temperature and ``top_p`` and caps ``max_tokens`` (the trainer learns from the
distribution the job samples with), and the answer's ``X-Temper-Sampling`` header says what
was used.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, select

from services.inference_gateway.backends import GenerateRequest
from services.inference_gateway.chat import BadRequest, ChatAnswer, read_tool_calls, refused_fields
from services.inference_gateway.inference import Inference
from services.inference_gateway.router import RequestFailed
from services.inference_gateway.schemas import ChatBody
from services.inference_gateway.sessions import ChatSessions
from services.inference_gateway.versions import JobModel
from temper import metrics
from temper.agent_traces import (
    CallRecord,
    Credential,
    KeyRefused,
    call_count,
    credential,
    last_call,
    record_call,
)
from temper.clock import utcnow
from temper.db import Database, Job
from temper.events import SamplingParams
from temper.jobspec import JobSpec
from temper.logs import log_context, log_event
from temper.policy import ChatTokenizer, assistant_stop_ids
from temper.policy.tokenizer import TemplateError, fetch_policy_tokenizer, policy_tokenizer
from temper.storage import ObjectStore

log = logging.getLogger("services.inference_gateway.agents")

_JOB_SPEC = select(Job.__table__.c.spec).where(Job.__table__.c.id == bindparam("job_id"))
OUTCOMES = ("answered", "refused", "over_budget", "bad_request", "failed")


class Unavailable(RuntimeError):
    """The proxy cannot take calls here: no database or object store (503)."""


class OverBudget(Exception):
    """The agent run made all the calls its job allows (429)."""


@dataclass
class AgentJob:
    """What a job's agent calls run with."""

    model: JobModel
    tokenizer: ChatTokenizer
    sessions: ChatSessions
    parser: str
    max_calls: int
    sampling: Any  # temper.jobspec.Sampling
    name: str


class AgentProxy:
    """Built by the gateway component; ``database`` and ``store`` are read when a call
    comes (the runtime opens them at start)."""

    def __init__(
        self,
        inference: Inference,
        *,
        database: Callable[[], Database | None],
        store: Callable[[], ObjectStore | None],
    ) -> None:
        metrics.zero(metrics.AGENT_CALLS, *OUTCOMES)
        self.inference = inference
        self.database = database
        self.store = store
        self.cache_dir = Path(tempfile.gettempdir()) / "temper-tokenizers"
        self._jobs: OrderedDict[str, AgentJob] = OrderedDict()
        self._inflight: Counter[str] = Counter()  # calls being answered, per episode run

    def _parts(self) -> tuple[Database, ObjectStore]:
        db, store = self.database(), self.store()
        if db is None or store is None:
            raise Unavailable("the agent proxy needs the database and the object store (distributed mode)")
        return db, store

    async def authorize(self, episode_id: str, authorization: str | None) -> Credential:
        """The call's credential from its ``Authorization: Bearer <key>`` (KeyRefused)."""
        db, _ = self._parts()
        scheme, _, key = (authorization or "").partition(" ")
        try:
            return await credential(
                db, key.strip() if scheme.lower() == "bearer" else None, episode_id, now=utcnow()
            )
        except KeyRefused:
            metrics.AGENT_CALLS.labels("refused").inc()
            raise

    async def job(self, job_id: str) -> AgentJob:
        found = self._jobs.get(job_id)
        if found is not None:
            return found
        db, store = self._parts()
        async with db.engine.connect() as conn:
            raw = (await conn.execute(_JOB_SPEC, {"job_id": job_id})).scalar_one()
        spec = JobSpec.model_validate(raw)
        p = spec.policy
        await fetch_policy_tokenizer(store, p.model, p.init, self.cache_dir)
        tok = await asyncio.to_thread(policy_tokenizer, p.model, p.init)
        found = AgentJob(
            model=JobModel(base=p.init or p.model, pool=p.backend_pool),
            tokenizer=tok,
            sessions=ChatSessions(tok),
            parser=spec.environment.action_format,
            max_calls=spec.environment.max_turns,
            sampling=p.sampling,
            name=p.model,
        )
        self._jobs[job_id] = found
        while len(self._jobs) > 256:
            self._jobs.popitem(last=False)
        return found

    def sampling(self, job: AgentJob, body: ChatBody, tok: ChatTokenizer) -> SamplingParams:
        """The job's temperature and ``top_p``; the call's ``max_tokens`` up to the job's;
        the call's and the job's stop strings; the template's stop ids; the call's seed."""
        s = job.sampling
        asked = body.max_completion_tokens or body.max_tokens or s.max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_tokens=min(asked, s.max_tokens),
            temperature=s.temperature,
            top_p=s.top_p,
            seed=body.seed,
            stop=list(dict.fromkeys([*stop, *s.stop])),
            stop_token_ids=assistant_stop_ids(tok),
        )

    async def chat(self, cred: Credential, body: ChatBody) -> tuple[ChatAnswer, AgentJob, SamplingParams]:
        """Answer one call of ``cred``'s episode, recorded before it returns. Raises
        :class:`BadRequest` (400), :class:`OverBudget` (429), :class:`RequestFailed` (502)."""
        with log_context(job_id=cred.job_id, episode_id=cred.episode_id, attempt=cred.attempt):
            try:
                return await self._chat(cred, body)
            except (BadRequest, TemplateError):
                metrics.AGENT_CALLS.labels("bad_request").inc()
                raise
            except OverBudget:
                metrics.AGENT_CALLS.labels("over_budget").inc()
                raise
            except Exception:
                metrics.AGENT_CALLS.labels("failed").inc()
                raise

    async def _chat(self, cred: Credential, body: ChatBody) -> tuple[ChatAnswer, AgentJob, SamplingParams]:
        refused = refused_fields(body)
        if refused:
            raise BadRequest(refused)
        db, store = self._parts()
        job = await self.job(cred.job_id)
        run = f"{cred.episode_id}:{cred.attempt}"  # a retried run starts its conversation afresh
        async with db.engine.connect() as conn:
            made = await call_count(conn, cred.episode_id, cred.attempt)
        if made + self._inflight[run] >= job.max_calls:
            raise OverBudget(
                f"the agent run made {made} of its {job.max_calls} model calls "
                "(environment.max_turns); no more are answered"
            )
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tok = job.tokenizer
        if not job.sessions.has(run):  # a gateway that did not answer the last call resumes from its record
            last = await last_call(db, store, cred.episode_id, cred.attempt)
            if last is not None:
                job.sessions.remember(
                    run, last.messages, last.prompt_ids, last.reply, last.token_ids, last.tools
                )
        try:
            prompt_ids, extends = job.sessions.prompt(run, messages, body.tools)
        except ValueError as exc:  # TemplateError is one: the template's own words
            raise BadRequest(str(exc)) from exc
        sampling = self.sampling(job, body, tok)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.inference.jobs[cred.job_id] = job.model
        self._inflight[run] += 1
        try:
            res = await self.inference.generate(
                GenerateRequest(
                    prompt_ids, sampling, episode_id=cred.episode_id, request_id=rid, job_id=cred.job_id
                ),
                job.model,
            )
        finally:
            self._inflight[run] -= 1
            if not self._inflight[run]:
                del self._inflight[run]
        content, tool_calls = res.text, list[dict[str, Any]]()
        if body.tools and body.tool_choice != "none":
            content, tool_calls = read_tool_calls(
                tok, res, job.parser, parallel=body.parallel_tool_calls is not False, tools=body.tools
            )
        answer = ChatAnswer(rid, body.model or job.name, res, content, tool_calls)
        record = CallRecord(
            request_id=rid,
            episode_id=cred.episode_id,
            job_id=cred.job_id,
            attempt=cred.attempt,
            prompt_ids=res.prompt_ids,
            token_ids=res.token_ids,
            logprobs=res.logprobs,
            policy_version=res.policy_version,
            backend=res.backend,
            finish_reason=res.finish_reason,
            text=res.text,
            messages=job.sessions.normalise(messages),
            tools=body.tools,
            reply=answer.message(),
            sampling=sampling.model_dump(exclude={"stop_token_ids"}),
            extends=extends,
        )
        await record_call(db, store, cred.tenant_id, record)
        job.sessions.remember(run, messages, res.prompt_ids, answer.message(), res.token_ids, body.tools)
        metrics.AGENT_CALLS.labels("answered").inc()
        log_event(
            log,
            "agent call answered",
            request_id=rid,
            call=made + 1,
            prompt_tokens=len(res.prompt_ids),
            completion_tokens=len(res.token_ids),
            policy_version=res.policy_version,
            extends=extends,
            tool_calls=len(tool_calls),
        )
        return answer, job, sampling


__all__ = ["AgentProxy", "BadRequest", "KeyRefused", "OverBudget", "RequestFailed", "Unavailable"]
