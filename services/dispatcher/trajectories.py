"""From an episode's step rows (or, for an agent episode, its recorded model calls) to its
:class:`temper.trajectory.Trajectory`.

Token exactness comes from how prompts are built: the prompt of turn t+1 is the prompt
of turn t, then the ids the model sampled, then the observation ids. So the segments
are cut from the stored prompts, never re-tokenised. An agent's calls are cut the same
way where each prompt extends the one before (the gateway extends a conversation token
for token); a call whose prompt does not (the agent rewrote its history) starts a
sequence of its own, its whole prompt a new ``prompt`` segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from temper.agent_traces import CallRecord
from temper.db import Episode, Step
from temper.events import RewardResult
from temper.lifecycle import StepState
from temper.policy.tokenizer import ChatTokenizer
from temper.trajectory import Segment, Trajectory, TurnRecord


def _seconds(step: Step | None) -> float | None:
    if step is None or step.created_at is None or step.completed_at is None:
        return None
    return round((step.completed_at - step.created_at).total_seconds(), 6)


def build_trajectory(
    ep: Episode, steps: Sequence[Step], reward: RewardResult, tok: ChatTokenizer, *, finished_at: datetime
) -> Trajectory:
    by_kind: dict[tuple[int, str], Step] = {(s.turn, s.kind): s for s in steps}
    inference = sorted(
        (s for s in steps if s.kind == "inference" and s.state == StepState.done), key=lambda s: s.turn
    )
    segments: list[Segment] = []
    turns: list[TurnRecord] = []
    covered = 0  # ids of the conversation already cut into segments
    totals = {"inference_s": 0.0, "sandbox_s": 0.0}
    for st in inference:
        prompt: list[int] = st.request["prompt_ids"]
        result = st.result or {}
        new = prompt[covered:]
        if new:
            role = "prompt" if covered == 0 else "observation"
            segments.append(Segment(role=role, token_ids=new, text=tok.decode(new, skip_special=False)))
        sampled = result.get("token_ids", [])
        segments.append(
            Segment(
                role="model",
                token_ids=sampled,
                logprobs=result.get("logprobs", []),
                # a step recorded before per-token versions: every token is the result's version
                token_versions=result.get("token_versions")
                or [result.get("policy_version") or 0] * len(sampled),
                policy_version=result.get("policy_version"),
                text=result.get("text", ""),
            )
        )
        covered = len(prompt) + len(sampled)
        sandbox = by_kind.get((st.turn, "sandbox"))
        exec_result = ((sandbox.result or {}).get("exec") or {}) if sandbox else {}
        observation = (
            (sandbox.result or {}).get("observation", "") if sandbox else result.get("observation", "")
        )
        timing = {}
        for name, s in (("inference_s", st), ("sandbox_s", sandbox)):
            secs = _seconds(s)
            if secs is not None:
                timing[name] = secs
                totals[name] += secs
        turns.append(
            TurnRecord(
                turn=st.turn,
                action_text=result.get("text", ""),
                action=result.get("action", {}),
                observation=observation or "",
                kill_reason=exec_result.get("kill_reason"),
                exit_code=exec_result.get("exit_code"),
                policy_version=result.get("policy_version"),
                timings=timing,
            )
        )
    timings = {"inference_s": round(totals["inference_s"], 6), "sandbox_s": round(totals["sandbox_s"], 6)}
    return _assemble(
        ep,
        segments,
        turns,
        reward,
        timings,
        reward_step=by_kind.get((ep.turn, "reward")),
        finished_at=finished_at,
        ended_by=(ep.timings or {}).get("ended_by"),
    )


def build_agent_trajectory(
    ep: Episode,
    steps: Sequence[Step],
    calls: Sequence[CallRecord],
    reward: RewardResult,
    tok: ChatTokenizer,
    *,
    finished_at: datetime,
) -> Trajectory:
    """The trajectory of an agent episode from its model calls, in the order the gateway
    recorded them: the ids and logprobs the gateway sampled, cut at each prompt's
    extension, a new sequence at each prompt that does not extend the one before."""
    segments: list[Segment] = []
    turns: list[TurnRecord] = []
    covered: list[int] = []  # the last call's prompt and sampled ids
    for i, call in enumerate(calls):
        prompt = call.prompt_ids
        if covered and prompt[: len(covered)] == covered:
            new = prompt[len(covered) :]
            if new:
                text = tok.decode(new, skip_special=False)
                segments.append(Segment(role="observation", token_ids=new, text=text))
                turns[-1].observation = text
        else:
            segments.append(
                Segment(role="prompt", token_ids=prompt, text=tok.decode(prompt, skip_special=False))
            )
        segments.append(
            Segment(
                role="model",
                token_ids=call.token_ids,
                logprobs=call.logprobs,
                policy_version=call.policy_version,
                text=call.text,
            )
        )
        covered = [*prompt, *call.token_ids]
        turns.append(
            TurnRecord(
                turn=i,
                action_text=call.text,
                action={"tool_calls": call.reply.get("tool_calls") or [], "extends": call.extends},
                policy_version=call.policy_version,
            )
        )
    run = next((s for s in steps if s.kind == "sandbox"), None)
    exec_result = ((run.result or {}).get("exec") or {}) if run is not None else {}
    if turns:  # how the agent's run ended goes with its last call
        turns[-1].exit_code = exec_result.get("exit_code")
        turns[-1].kill_reason = exec_result.get("kill_reason")
    return _assemble(
        ep,
        segments,
        turns,
        reward,
        {"sandbox_s": _seconds(run) or 0.0},
        reward_step=next((s for s in steps if s.kind == "reward"), None),
        finished_at=finished_at,
        calls=len(calls),
        sequences=sum(1 for s in segments if s.role == "prompt"),
    )


def _assemble(
    ep: Episode,
    segments: list[Segment],
    turns: list[TurnRecord],
    reward: RewardResult,
    timings: dict[str, float],
    *,
    reward_step: Step | None,
    finished_at: datetime,
    ended_by: str | None = None,
    **counts: int,
) -> Trajectory:
    """The trajectory of either kind of episode: its segments and turns, the reward with
    its components (and the kind's own ``counts``), and the episode's times, measured to
    ``finished_at``."""
    started = float((ep.timings or {}).get("started_at") or finished_at.timestamp())
    scoring_s = 0.0
    if reward_step is not None and reward_step.created_at is not None:
        scoring_s = round(finished_at.timestamp() - reward_step.created_at.timestamp(), 6)
    return Trajectory(
        job_id=ep.job_id,
        episode_id=ep.id,
        task_id=ep.task_id,
        group_id=ep.group_id,
        iteration=ep.iteration,
        segments=segments,
        turns=turns,
        reward=reward.reward,
        rewards={
            "components": {k: v.model_dump(mode="json") for k, v in reward.components.items()},
            "format_ok": not ep.format_errors,
            **counts,
        },
        timings={"total_s": round(finished_at.timestamp() - started, 6), **timings, "scoring_s": scoring_s},
        ended_by=ended_by,
    )
