"""What an awaited result does to its episode: record it on its step, then issue the next
command (a sandbox step, the next turn's inference, or the reward request) as a new step
row and an outbox message, moving the episode with ``temper.lifecycle``.

Nothing here writes the database: the caller locked the rows, and writes what changed and
the new steps with ``temper.db.rows.write`` in its transaction. The one read is the prompt
of an inference step whose output was malformed (its next prompt extends it): the locking
query leaves the answered step's request out, since every other path only counts it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from services.dispatcher import deadlines
from services.dispatcher.fairshare import inference_tokens, sandbox_cpu_s, sandbox_memory_gb_s
from services.dispatcher.leases import TOPIC_FOR_KIND, lease_until
from temper import metrics
from temper.clock import utcnow
from temper.db import Episode, Step, rows
from temper.db.core import CoreTx
from temper.db.rows import HasInfo
from temper.envs import Environment, EnvKind, ParsedAction
from temper.events import (
    InferenceRequest,
    InferenceResult,
    Message,
    RewardRequest,
    SamplingParams,
    SandboxRequest,
    SandboxResult,
)
from temper.jobspec import JobSpec
from temper.lifecycle import EpisodeState, complete_step, new_step, transition_episode
from temper.outbox import enqueue
from temper.policy.tokenizer import ChatTokenizer, assistant_stop_ids
from temper.settings import DispatcherSettings
from temper.trajectory import token_versions

E = EpisodeState


def observe_step(step: Step) -> None:
    if step.created_at is not None and step.completed_at is not None:
        seconds = (step.completed_at - step.created_at).total_seconds()
        metrics.TURN_SECONDS.labels(step.kind).observe(max(0.0, seconds))


# What any sandbox can hold (file_size_mb and workspace_mb are at least 1 MiB): a workspace
# this small is written by a session and by the scorer's fresh run alike.
LONE_WRITE_MAX_BYTES = 512 * 1024


def lone_write(env: Environment, action: ParsedAction, turn: int) -> dict[str, str] | None:
    """The workspace a code episode ends with when its first and last action only writes a
    file: the task's starting files with that file. A sandbox session would hold exactly
    these (no earlier action ran, the environment has no setup program, nothing runs after
    the write), and the reward's run writes its submission's files into a fresh sandbox
    itself, so the reward is the same without a session. None for anything else: a command,
    several of them, an earlier turn, a base64 file or a workspace past
    :data:`LONE_WRITE_MAX_BYTES` (where a sandbox's limits could refuse the write)."""
    command = action.command or {}
    if (
        env.kind != EnvKind.code
        or turn != 0
        or not (action.submit_after or env.is_last_turn(turn))
        or action.more
        or command.get("kind") != "write_file"
        or command.get("encoding", "utf-8") != "utf-8"
        or env.setup_actions()
    ):
        return None
    path = posixpath.normpath(str(command.get("path") or ""))  # as a snapshot names it
    files = {posixpath.normpath(p): text for p, text in env.setup_files().items()}
    if _collides(path, files):
        return None  # the sandbox's write fails and the model reads why, as with any failed write
    files[path] = str(command.get("content") or "")
    if sum(len(text.encode()) for text in files.values()) > LONE_WRITE_MAX_BYTES:
        return None
    return files


def _collides(path: str, files: dict[str, str]) -> bool:
    """Whether writing ``path`` over ``files`` would fail: a directory of one of them
    (``src`` beside ``src/a.py``), or below one of them (``a.py/b``). The scorer writes a
    lone write's files itself, and a write it cannot make is no reward, so such a write
    takes a session, where it fails as the model's own error."""
    parents = {posixpath.dirname(p) for p in files}
    below = {path[:i] for i, ch in enumerate(path) if ch == "/"}
    return any(path == d or d.startswith(path + "/") for d in parents if d) or bool(below & files.keys())


class Turns:
    """Builds the next command of an episode. ``tok_of`` gives a job's policy tokenizer."""

    def __init__(self, settings: DispatcherSettings, tok_of: Callable[[JobSpec], ChatTokenizer]) -> None:
        self.settings = settings
        self.tok_of = tok_of

    def issue(self, tx: HasInfo, ep: Episode, kind: str, message: Message, *, extra_s: float = 0.0) -> Step:
        """A new step (attempt 0) and its command; the episode waits on it. The step is new:
        the caller writes it."""
        lease = deadlines.lease_end(ep, kind, lease_until(self.settings, kind, extra_s))
        step = new_step(
            episode_id=ep.id,
            turn=message.turn or 0,
            kind=kind,
            request=message.model_dump(mode="json"),
            lease_expires_at=lease,
        )
        ep.turn = message.turn or 0
        ep.attempt = 0
        ep.lease_expires_at = lease
        enqueue(tx, TOPIC_FOR_KIND[kind], message)
        return step

    def inference_request(
        self, ep: Episode, spec: JobSpec, prompt_ids: list[int], *, turn: int
    ) -> InferenceRequest:
        s = spec.policy.sampling
        return InferenceRequest(
            job_id=ep.job_id,
            episode_id=ep.id,
            turn=turn,
            model=spec.policy.model,
            init=spec.policy.init,
            pool=spec.policy.backend_pool,
            prompt_ids=prompt_ids,
            sampling=SamplingParams(
                max_tokens=deadlines.max_tokens(ep, spec),
                temperature=s.temperature,
                top_p=s.top_p,
                stop=list(s.stop),
                stop_token_ids=assistant_stop_ids(self.tok_of(spec)),
            ),
            partial_rollout=bool(ep.partial_rollouts),
        )

    async def take_inference(
        self,
        tx: CoreTx,
        ep: Episode,
        step: Step,
        msg: InferenceResult,
        spec: JobSpec,
        env: Environment,
        prompt_tokens: int,
    ) -> Step:
        """Record the awaited inference result on ``step`` (asked with a prompt of
        ``prompt_tokens``); returns the step it issues."""
        ep.inference_tokens = (ep.inference_tokens or 0) + inference_tokens(prompt_tokens, msg)
        ep.model_tokens = (ep.model_tokens or 0) + len(msg.token_ids)
        tok = self.tok_of(spec)
        text = msg.text or tok.decode(msg.token_ids)
        # parsers read the reply with its special tokens (Mistral's [TOOL_CALLS] is one)
        action = env.parse(tok.parse_text(msg.token_ids, text), turn=step.turn)
        versions = token_versions(msg)
        complete_step(
            step,
            {
                "token_ids": msg.token_ids,
                "logprobs": msg.logprobs,
                "token_versions": versions,
                "text": text,
                "finish_reason": msg.finish_reason,
                "policy_version": msg.policy_version,
                "backend": msg.backend,
                "answered_at": msg.occurred_at.isoformat(),
                "action": action.to_dict(),
            },
        )
        observe_step(step)
        oldest = min(versions, default=msg.policy_version)
        if ep.behaviour_version is None or oldest < ep.behaviour_version:
            ep.behaviour_version = oldest
        turn = step.turn
        if action.kind == "sandbox" and (why := deadlines.reached(ep, spec, utcnow(), inference_next=False)):
            return self.end_early(tx, ep, spec, env, step.result, why)
        if action.kind == "sandbox":
            assert action.command is not None
            files = lone_write(env, action, turn)
            if files is not None:
                # the episode ends with one write into its starting files: the scorer's fresh
                # run writes the same files itself, so no session is started for it
                ep.timings = {**ep.timings, "scored_without_session": True}
                return self.issue_reward(tx, ep, spec, env, action, final_text=text, files=files)
            limits = env.limits or None
            request = SandboxRequest(
                job_id=ep.job_id,
                episode_id=ep.id,
                turn=turn,
                session_id=ep.session_id or ep.id,
                action=action.command,
                more_actions=action.more or [],
                limits=limits,
                snapshot_key=ep.snapshot_key,
                files=env.setup_files() if ep.snapshot_key is None else {},
                setup=env.setup_actions() if ep.snapshot_key is None else [],
                keep_s=deadlines.session_keep_s(ep, self.settings, utcnow()),
            )
            # The lease covers the actions' own wall-clock limits on top of the hop.
            actions = 1 + len(action.more or [])
            wall_s = actions * float((limits or {}).get("wall_s", 0.0))
            issued = self.issue(tx, ep, "sandbox", request, extra_s=wall_s)
            transition_episode(tx, ep, E.acting)
            return issued
        if not action.format_ok:
            ep.format_errors = (ep.format_errors or 0) + 1
        if action.kind == "submit" or env.is_last_turn(turn):
            return self.issue_reward(tx, ep, spec, env, action, final_text=text)
        # A malformed action: its error is the observation, and the model tries again.
        observations = env.observe(action, None)
        step.result = {**(step.result or {}), "observation": observations[0]}
        if "request" not in rows.loaded_columns(step):
            await rows.load(tx, step, "request")
        return self.next_turn(tx, ep, spec, env, step, observations)

    def take_sandbox(
        self,
        tx: HasInfo,
        ep: Episode,
        step: Step,
        inference: Step,
        msg: SandboxResult,
        spec: JobSpec,
        env: Environment,
    ) -> Step:
        """Record the awaited sandbox result on ``step``; returns the step it issues."""
        assert inference.result is not None
        ep.sandbox_cpu_s = (ep.sandbox_cpu_s or 0.0) + sandbox_cpu_s(msg)
        ep.sandbox_memory_gb_s = (ep.sandbox_memory_gb_s or 0.0) + sandbox_memory_gb_s(msg)
        action = ParsedAction.from_dict(inference.result["action"])
        observations = env.observe(action, msg.result, msg.more_results)
        complete_step(
            step,
            {
                "exec": msg.result,
                **({"more_exec": msg.more_results} if msg.more_results else {}),
                "worker": msg.worker,
                "snapshot_key": msg.snapshot_key,
                "observation": "\n\n".join(observations),
                **({"observations": observations} if len(observations) > 1 else {}),
            },
        )
        observe_step(step)
        if msg.snapshot_key:
            ep.snapshot_key = msg.snapshot_key
        if action.submit_after or env.is_last_turn(step.turn):
            return self.issue_reward(tx, ep, spec, env, action, final_text=inference.result.get("text", ""))
        return self.next_turn(tx, ep, spec, env, inference, observations)

    def next_turn(
        self,
        tx: HasInfo,
        ep: Episode,
        spec: JobSpec,
        env: Environment,
        inference: Step,
        observations: list[str],
    ) -> Step:
        """Extend the conversation token-wise with ``observations`` (one message per tool
        call) and ask for the next action. Raises :class:`~temper.policy.TemplateError`
        where the chat template cannot render them."""
        sampled = inference.result["token_ids"] if inference.result else []
        # the results answer the turn's calls (their tool messages carry the calls' ids);
        # a template that cannot render them raises TemplateError: the episode fails at once
        calls = ((inference.result or {}).get("action") or {}).get("calls")
        prompt = [
            *inference.request["prompt_ids"],
            *sampled,
            *env.observation_ids(self.tok_of(spec), sampled, observations, calls=calls),
        ]
        if why := deadlines.reached(ep, spec, utcnow(), inference_next=True):
            return self.end_early(tx, ep, spec, env, inference.result, why)
        if len(prompt) + spec.policy.sampling.max_tokens > self.settings.max_context_tokens:
            # Out of context: score what there is.
            ep.timings = {**ep.timings, "context_full": True}
            return self.end_early(tx, ep, spec, env, inference.result, "context_full")
        issued = self.issue(
            tx, ep, "inference", self.inference_request(ep, spec, prompt, turn=inference.turn + 1)
        )
        transition_episode(tx, ep, E.awaiting_action)
        return issued

    def end_early(
        self,
        tx: HasInfo,
        ep: Episode,
        spec: JobSpec,
        env: Environment,
        result: dict[str, Any] | None,
        why: str,
    ) -> Step:
        """End the episode before its agent did (a budget of ``deadlines.py``, or the context
        is full) and score what it left (``result``: its last inference result, if one is at
        hand); ``why`` goes on its trajectory as ``ended_by``."""
        ep.timings = {**ep.timings, "ended_by": why}
        result = result or {}
        action = ParsedAction.from_dict(result.get("action", {"kind": "invalid"}))
        return self.issue_reward(tx, ep, spec, env, action, final_text=result.get("text", ""))

    def issue_reward(
        self,
        tx: HasInfo,
        ep: Episode,
        spec: JobSpec,
        env: Environment,
        action: ParsedAction,
        *,
        final_text: str,
        files: dict[str, str] | None = None,
        turns_used: int | None = None,
    ) -> Step:
        """Ask for the episode's reward; ``files``: the workspace it ended with, when no
        session holds it (:func:`lone_write`); ``turns_used`` defaults to its turns (an
        agent's run counts its model calls)."""
        format_ok = not ep.format_errors  # over every turn, this one included
        submission = env.submission(
            action if action.kind != "invalid" else None,
            final_text=final_text,
            snapshot_key=ep.snapshot_key,
            session_id=ep.session_id or ep.id,
        )
        if files is not None:
            submission = {**submission, "files": files}
        request = RewardRequest(
            job_id=ep.job_id,
            episode_id=ep.id,
            turn=ep.turn,
            task_id=ep.task_id,
            taskset_id=env.task.meta.get("task_set_id") or spec.tasks.taskset,
            submission=submission,
            weights=spec.reward_weights(),
            settings=spec.reward_settings(),
            turns_used=ep.turn + 1 if turns_used is None else turns_used,
            max_turns=env.max_turns,
            format_ok=format_ok,
        )
        issued = self.issue(tx, ep, "reward", request)
        transition_episode(tx, ep, E.scoring)
        return issued
