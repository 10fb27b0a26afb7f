"""An episode's budgets, and the times that must agree with them.

``environment.max_episode_s`` gives an episode a wall-clock deadline from its start
(``episodes.deadline_at``); ``environment.max_episode_tokens`` caps the tokens its model
samples over all its turns (``episodes.model_tokens``). Reaching either ends the episode
and scores what it left (``ended_by`` on its trajectory): it is not failed. A failed
episode leaves its group, so a policy that dawdles or rambles would be dropped from the
advantage instead of earning the low reward its workspace gets; scoring it is what the
out-of-context case already does (``context_full``).

What agrees with them:
- each turn's ``max_tokens`` is at most the tokens left (:func:`max_tokens`);
- a step's lease ends at the deadline at the latest (:func:`lease_end`), so a step still
  out then is cut by the lease reaper, which ends the episode instead of retrying;
- the episode's sandbox session is kept at least until the deadline (the request's
  ``keep_s``, :func:`session_keep_s`; without a deadline: as long as the episode may wait on
  one step before it fails), so no session is reaped under a live episode.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from temper.db import Episode
from temper.jobspec import JobSpec
from temper.settings import DispatcherSettings

MAX_EPISODE_S = "max_episode_s"
MAX_EPISODE_TOKENS = "max_episode_tokens"
SESSION_SLACK_S = 5.0  # past the deadline, for the reaper to see it and the reward to be issued


def deadline_of(spec: JobSpec, started: datetime) -> datetime | None:
    """The wall-clock deadline of an episode started at ``started`` (None: no limit)."""
    limit = spec.environment.max_episode_s
    return None if limit is None else started + timedelta(seconds=limit)


def tokens_left(ep: Episode, spec: JobSpec) -> int | None:
    """Tokens the episode's model may still sample (None: no limit)."""
    budget = spec.environment.max_episode_tokens
    return None if budget is None else max(0, budget - (ep.model_tokens or 0))


def max_tokens(ep: Episode, spec: JobSpec) -> int:
    """A turn's ``max_tokens``: the job's, or the tokens left when fewer."""
    left = tokens_left(ep, spec)
    wanted = spec.policy.sampling.max_tokens
    return wanted if left is None else max(1, min(wanted, left))


def reached(ep: Episode, spec: JobSpec, now: datetime, *, inference_next: bool) -> str | None:
    """Which budget ends the episode before its next step, or None. The token budget only
    stops another model turn (an action sampled within it still runs)."""
    if ep.deadline_at is not None and now >= ep.deadline_at:
        return MAX_EPISODE_S
    if inference_next and tokens_left(ep, spec) == 0:
        return MAX_EPISODE_TOKENS
    return None


def lease_end(ep: Episode, kind: str, lease: datetime) -> datetime:
    """A step's lease, ending at the episode's deadline at the latest (the reward step,
    which scores what is there, is not cut)."""
    if kind == "reward" or ep.deadline_at is None:
        return lease
    return min(lease, ep.deadline_at)


def session_keep_s(ep: Episode, settings: DispatcherSettings, now: datetime) -> float:
    """How long, after a sandbox step, the episode may still need its session: until its
    deadline (and the reaper's next look), else the longest it may wait on one step before
    it fails (``max_step_attempts`` leases)."""
    slack = settings.reaper_interval_s + SESSION_SLACK_S
    if ep.deadline_at is not None:
        return max(0.0, (ep.deadline_at - now).total_seconds()) + slack
    return settings.max_step_attempts * settings.lease_s + slack
