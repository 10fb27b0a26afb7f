"""The trainer's supervised jobs (``sft``, ``dpo``, ``reward_model``: no episodes, a fixed
data set): one step of each running job in turn, a version every ``checkpoint_every``
steps and after the last. :class:`services.trainer.training.JobTrainer` takes this half
from :class:`SupervisedJobs`; the data and the step itself are
:mod:`services.trainer.supervised`'s."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.trainer import publishing, supervised
from temper.jobspec import JobSpec
from temper.logs import log_context, log_event
from temper.training import StepStats

if TYPE_CHECKING:
    from services.trainer.buffer import TrainingJob
    from services.trainer.ranks import Ranks
    from temper.db import Database
    from temper.settings.trainer import TrainerSettings
    from temper.storage import ObjectStore

log = logging.getLogger("temper.trainer")


class SupervisedJobs:
    """The sft-job half of the trainer; the other half (``JobTrainer``) holds the jobs,
    the ranks and the publishing."""

    db: Database
    store: ObjectStore
    settings: TrainerSettings
    ranks: Ranks
    on_step: Callable[[str, StepStats], None] | None

    def __init__(self) -> None:
        self._sft_checked_at = 0.0
        self._sft_running: list[str] = []  # the running sft jobs this process owns
        self._tok_dir: str | None = None

    if TYPE_CHECKING:  # JobTrainer's, which this half calls

        async def job(self, job_id: str) -> TrainingJob: ...

        async def _publish(self, job: TrainingJob, stats: StepStats | None) -> int | None: ...

        def _observe(self, job: TrainingJob, stats: StepStats) -> None: ...

    SFT_CHECK_S = 1.0  # how often the running sft jobs are looked up

    async def train_sft(self) -> bool:
        """One step of each running sft job this process owns (looked up every
        ``SFT_CHECK_S``); True when some job has steps left."""
        if time.monotonic() - self._sft_checked_at >= self.SFT_CHECK_S:
            self._sft_checked_at = time.monotonic()
            self._sft_running = await supervised.running_sft_jobs(self.db, self.settings.job_id)
        more = False
        for job_id in self._sft_running:
            with log_context(job_id=job_id):
                more = await self._train_sft_one(job_id) or more
        return more

    async def _train_sft_one(self, job_id: str) -> bool:
        if self.ranks.sharded:
            await publishing.set_stuck_reason(self.db, job_id, supervised.SHARDED_REFUSAL)
            return False
        job = await self.job(job_id)
        if job.sft_error is not None:
            return False
        async with job.train_lock:
            if job.conversations is None:
                try:
                    job.conversations = await self._sft_data(job.spec)
                except Exception as exc:  # noqa: BLE001 - the job says why; the trainer goes on
                    job.sft_error = f"{job.spec.algorithm.name} data: {exc}"[:500]
                    await publishing.set_stuck_reason(self.db, job_id, job.sft_error)
                    log_event(log, "sft job cannot train", logging.ERROR, error=job.sft_error)
                    return False
            n = len(job.conversations)
            _, total = job.spec.sft_steps(n)
            if job.learner.step_count >= total:
                return False
            batch = [job.conversations[i] for i in job.spec.sft_batch(n, job.learner.step_count)]
            stats = await asyncio.to_thread(supervised.step_of(job.spec, job.learner), batch)
            job.seconds_since_checkpoint += stats.seconds
            if not stats.updated:  # a non-finite gradient: the same batch would come again
                job.sft_error = (
                    f"{job.spec.algorithm.name} step {stats.step + 1}: the gradient is not finite "
                    f"(grad norm {stats.grad_norm})"
                )
                await publishing.set_stuck_reason(self.db, job_id, job.sft_error)
                return False
            job.steps_since_checkpoint += 1
            job.history.append(stats.as_dict())
            self._observe(job, stats)
            last = job.learner.step_count >= total
            if last or job.steps_since_checkpoint >= job.spec.algorithm.checkpoint_every:
                await self._publish(job, stats)
        if self.on_step is not None:
            self.on_step(job.job_id, stats)
        return not last

    async def _sft_data(self, spec: JobSpec) -> supervised.Encoded:
        """The job's conversations encoded with the tokenizer its policy renders with."""
        from temper.policy.tokenizer import fetch_policy_tokenizer, policy_tokenizer

        await fetch_policy_tokenizer(self.store, spec.policy.model, spec.policy.init, self._tokenizer_cache)
        tok = policy_tokenizer(spec.policy.model, spec.policy.init)
        rows = await supervised.conversations(self.db, spec)
        if not rows:
            raise ValueError(f"task set {spec.tasks.taskset} has no {spec.data_kind} task to train on")
        return await asyncio.to_thread(supervised.encode_tasks, tok, rows, spec)

    @property
    def _tokenizer_cache(self) -> str:
        """Where tokenizers of object-store model directories are fetched to (made once)."""
        import tempfile

        if self._tok_dir is None:
            self._tok_dir = tempfile.mkdtemp(prefix="temper-trainer-tokenizers-")
        return self._tok_dir
