"""A burst on the real stack: ten times the steady load submitted at once.

The steady load is one small LoRA job whose concurrency (8 episodes) exactly fills the
gateway (one backend, 8 requests in flight at most). The burst is ten such jobs submitted
together, each sampling its own adapter on the one base model: 80 episodes want an answer at once, so the gateway pauses its consumer and the
requests wait in Kafka. The test checks that Kafka absorbs it (the gateway's consumer lag
rises, then drains to zero), that nothing is dropped (every job completes, each episode
scored once and trained once, no dead letter), and that memory does not follow the burst.

Where the memory bounds come from: every consumer holds at most its own concurrency's
worth of messages however long the queue in Kafka is (the gateway its backends'
``max_inflight``, the scorer its 8 slots, the dispatcher one fetched batch; the sandbox
worker, which pauses at its session slots, idles here: single-turn math episodes run no
action), so a burst must not show in their memory: each stays within
``STEADY_GROWTH`` of what the same process peaked at under the steady load. The trainer is
the exception by design: it holds each job's policy and optimizer while the job trains, so
its bound is the steady peak plus ``TRAINER_MB_PER_JOB`` for each job beyond the first
(the tiny preset: 0.4M parameters, about 7 MB of fp32 weights, gradients and AdamW state,
plus its reference copy and allocator slack)."""

from __future__ import annotations

import threading
import time

import pytest

from temper.events import Topics
from tests.faults.harness import FaultStack, small_spec

pytestmark = [pytest.mark.kafka, pytest.mark.postgres, pytest.mark.s3, pytest.mark.slow]

BURST_JOBS = 10
STEADY_GROWTH_MB = 80.0  # allocator noise and a few more request objects, not the queue
TRAINER_MB_PER_JOB = 40.0
LAG_GROUP, LAG_TOPIC = "TEMPER_INFERENCE__REQUESTS_GROUP", Topics.INFERENCE_REQUESTS


class LagWatch:
    """Samples the gateway group's lag on the request topic in a thread."""

    def __init__(self, stack: FaultStack) -> None:
        self.stack, self.samples = stack, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LagWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.stack.group_lag(LAG_GROUP, LAG_TOPIC))
            self._stop.wait(0.25)


@pytest.mark.timeout(420)
def test_ten_times_the_steady_load_at_once_is_absorbed_and_drained(fault_stack):
    # 64 sampled tokens an answer (the tiny policy rarely stops sooner), so that a batch of
    # answers takes long enough for the queue behind it to be seen
    # LoRA jobs: many jobs share the gateway's one backend only with adapters (a backend
    # holds one job's full weights at most, so ten full-weight jobs would run one by one)
    spec = small_spec(
        "steady",
        **{
            "schedule.iterations": 2,
            "policy.sampling.max_tokens": 64,
            "algorithm.lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        },
    )
    stack: FaultStack = fault_stack(spec)
    stack.start()
    stack.submit()
    stack.assert_each_episode_scored_and_trained_once(stack.wait_job(150))
    steady = {name: stack.peak_rss_mb(name) for name in stack.services}
    assert stack.api is not None
    stack.api._call("PATCH", "/v1/tenants/default", json={"max_concurrent_episodes": 8 * BURST_JOBS})

    t0 = time.monotonic()
    with LagWatch(stack) as lag:
        jobs = [stack.api.submit({**stack.spec, "name": f"burst-{i}"})["id"] for i in range(BURST_JOBS)]
        submitted_s = time.monotonic() - t0

        def finished() -> bool:
            return all(stack.facts(j).job.state in ("completed", "failed", "cancelled") for j in jobs)

        stack.wait(f"the {BURST_JOBS} burst jobs to finish", finished, 300, every_s=1.0)
        drained_s = time.monotonic() - t0
        # the last sample must see the queue empty: wait for one taken after the jobs ended
        taken = len(lag.samples)
        stack.wait("a lag sample after the burst", lambda: len(lag.samples) > taken, 30)
    burst = {name: stack.peak_rss_mb(name) for name in stack.services}
    print(  # noqa: T201 - the figures the test measures
        f"\nBURST {BURST_JOBS} jobs submitted in {submitted_s:.1f}s, drained in {drained_s:.1f}s; "
        f"gateway lag peak {max(lag.samples)}, last {lag.samples[-1]}; peak RSS MB steady -> burst: "
        + ", ".join(f"{n} {steady[n]:.0f} -> {burst[n]:.0f}" for n in stack.services)
    )

    for job in jobs:  # nothing dropped
        stack.assert_each_episode_scored_and_trained_once(stack.facts(job))
    assert not stack.dead_letters([stack.job_id, *jobs])
    # Kafka held the burst: more requests waited than the gateway may hold, then none
    assert max(lag.samples) > 8, lag.samples
    assert lag.samples[-1] == 0, lag.samples[-10:]
    for name, peak in burst.items():
        if name == "trainer":
            bound = steady[name] + TRAINER_MB_PER_JOB * BURST_JOBS
        else:
            bound = steady[name] + STEADY_GROWTH_MB
        assert peak <= bound, f"{name} peaked at {peak:.0f} MB in the burst, bound {bound:.0f} MB ({steady})"
