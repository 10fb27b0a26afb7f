"""The trajectory of one scored episode: what the trainer learns from and what a
researcher reads. Stored as JSON in object storage; the ``trajectories`` topic carries
its key (claim-check).

Tokens are kept exactly as sampled: the conversation is a list of segments, each either
the environment's text (``prompt``/``observation``, masked out of the loss) or the
model's own tokens with the logprobs and policy version that produced them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prompt", "model", "observation"]
    token_ids: list[int]
    logprobs: list[float] | None = Field(None, description="behaviour logprobs; model segments only")
    policy_version: int | None = None
    text: str = ""


class TurnRecord(BaseModel):
    """One turn as a person reads it in a transcript."""

    model_config = ConfigDict(extra="forbid")
    turn: int
    action_text: str
    action: dict[str, Any] = {}
    observation: str = ""
    kill_reason: str | None = None
    exit_code: int | None = None
    policy_version: int | None = None
    timings: dict[str, float] = {}


class Trajectory(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_version: int = 1
    job_id: str
    episode_id: str
    task_id: str
    group_id: str
    iteration: int = 0
    segments: list[Segment]
    turns: list[TurnRecord] = []
    reward: float
    rewards: dict[str, Any] = {}
    timings: dict[str, float] = {}

    @property
    def behaviour_version(self) -> int:
        """The oldest policy version that produced any of the model's tokens."""
        versions = [
            s.policy_version for s in self.segments if s.role == "model" and s.policy_version is not None
        ]
        return min(versions) if versions else 0

    def flat(self) -> tuple[list[int], list[bool], list[float]]:
        """All token ids, a mask that is True on the model's own tokens, and the behaviour
        logprob of each token (0.0 where masked)."""
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        for seg in self.segments:
            ids.extend(seg.token_ids)
            own = seg.role == "model"
            mask.extend([own] * len(seg.token_ids))
            if own:
                if seg.logprobs is None or len(seg.logprobs) != len(seg.token_ids):
                    raise ValueError("a model segment needs one logprob per token")
                logprobs.extend(seg.logprobs)
            else:
                logprobs.extend([0.0] * len(seg.token_ids))
        return ids, mask, logprobs
