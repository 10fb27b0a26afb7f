"""The trajectory of one scored episode: what the trainer learns from and what a
researcher reads. Stored as JSON in object storage; the ``trajectories`` topic carries
its key (claim-check).

Tokens are kept exactly as sampled: the conversation is a list of segments, each either
the environment's text (``prompt``/``observation``, masked out of the loss) or the
model's own tokens with the logprobs and the policy version that produced each of them
(``token_versions``). With partial rollouts (``schedule.partial_rollouts``) one episode,
even one turn, can hold tokens of several versions; the trainer takes each token's own
behaviour logprob and counts staleness per token (docs/training.md, "Partial rollouts").
Each ``prompt`` segment starts a sequence of its own (:meth:`Trajectory.samples`): one per
episode, except where an agent rewrote its history between two model calls.

Schema versions: 1 had one ``policy_version`` per segment; 2 adds ``token_versions`` (a
version-1 segment reads as every token being its ``policy_version``'s).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from temper.events import InferenceResult

NOT_SAMPLED = -1  # the version of a token the model did not sample (prompt, observation)


def token_versions(result: InferenceResult) -> list[int]:
    """The version of each token of an inference result (a result from before per-token
    versions names one version for all)."""
    return list(result.token_versions) or [result.policy_version] * len(result.token_ids)


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["prompt", "model", "observation"]
    token_ids: list[int]
    logprobs: list[float] | None = Field(None, description="behaviour logprobs; model segments only")
    token_versions: list[int] | None = Field(
        None, description="the policy version that sampled each token; model segments only"
    )
    policy_version: int | None = Field(None, description="the version that sampled the segment's last token")
    text: str = ""

    @model_validator(mode="after")
    def _one_version_per_token(self) -> Segment:
        if self.role == "model" and self.token_versions is None:
            # schema 1: one version for the whole segment
            self.token_versions = [self.policy_version or 0] * len(self.token_ids)
        if self.token_versions is not None and len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_versions)} token versions for {len(self.token_ids)} tokens")
        return self

    def versions(self) -> list[int]:
        """The version of each token; :data:`NOT_SAMPLED` for the environment's text."""
        if self.role != "model" or self.token_versions is None:
            return [NOT_SAMPLED] * len(self.token_ids)
        return list(self.token_versions)


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
    schema_version: int = 2
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
    ended_by: str | None = Field(
        None,
        description="why the episode ended before its agent did: max_episode_s, max_episode_tokens, "
        "context_full; None when it submitted or used its turns",
    )

    def model_versions(self) -> list[int]:
        """The version of every token the model sampled, in order."""
        return [v for s in self.segments if s.role == "model" for v in s.versions()]

    @property
    def behaviour_version(self) -> int:
        """The oldest policy version that sampled any of the model's tokens: what
        ``schedule.max_staleness`` bounds."""
        return min(self.model_versions(), default=0)

    @property
    def versions_spanned(self) -> list[int]:
        """The distinct versions that sampled the model's tokens (two or more: a partial rollout)."""
        return sorted(set(self.model_versions()))

    def flat_versions(self) -> list[int]:
        """The version of each token of :meth:`flat`'s ids (:data:`NOT_SAMPLED` where masked)."""
        return [v for s in self.segments for v in s.versions()]

    def sample_versions(self) -> list[list[int]]:
        """The version of each token of each sequence of :meth:`samples` (:data:`NOT_SAMPLED`
        where masked)."""
        out: list[list[int]] = []
        for seg in self.segments:
            if seg.role == "prompt" or not out:
                out.append([])
            out[-1].extend(seg.versions())
        return out

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
