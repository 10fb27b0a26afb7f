"""The trajectory of one scored episode: what the trainer learns from and what a
researcher reads. Stored as JSON in object storage; the ``trajectories`` topic carries
its key (claim-check).

Tokens are kept exactly as sampled: the conversation is a list of segments, each either
the environment's text (``prompt``/``observation``, masked out of the loss) or the
model's own tokens with the logprobs and policy version that produced them. Each
``prompt`` segment starts a sequence of its own (:meth:`Trajectory.samples`): one per
episode, except where an agent rewrote its history between two model calls.
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
        logprob of each token (0.0 where masked), of a trajectory that is one sequence."""
        samples = self.samples()
        if len(samples) != 1:
            raise ValueError(f"the trajectory is {len(samples)} sequences, not one: read samples()")
        return samples[0]

    def samples(self) -> list[tuple[list[int], list[bool], list[float]]]:
        """The token sequences the trainer learns from, each as :meth:`flat` gives one: a
        sequence starts at each ``prompt`` segment. An episode is one sequence when every
        prompt extended the one before token for token; an agent that rewrote its history
        between two model calls (``temper.agent_traces``) starts another with the call whose
        prompt did not."""
        out: list[tuple[list[int], list[bool], list[float]]] = []
        for seg in self.segments:
            if seg.role == "prompt" or not out:
                out.append(([], [], []))
            ids, mask, logprobs = out[-1]
            ids.extend(seg.token_ids)
            own = seg.role == "model"
            mask.extend([own] * len(seg.token_ids))
            if own:
                if seg.logprobs is None or len(seg.logprobs) != len(seg.token_ids):
                    raise ValueError("a model segment needs one logprob per token")
                logprobs.extend(seg.logprobs)
            else:
                logprobs.extend([0.0] * len(seg.token_ids))
        return out
