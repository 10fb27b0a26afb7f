from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.inference_gateway.backends import (
    Backend,
    BackendError,
    BackendResult,
    CpuServerBackend,
    ErrorKind,
    GenerateRequest,
    Served,
)
from services.inference_gateway.router import BreakerState, CircuitBreaker, RequestFailed, Router
from temper.events import SamplingParams
from temper.policy import default_tokenizer, encode_chat
from temper.settings.inference import BackendSpec, InferenceSettings

pytestmark = pytest.mark.timeout(60)


class FakeBackend(Backend):
    def __init__(self, name: str, *, delay: float = 0.0, fail: ErrorKind | None = None) -> None:
        super().__init__(BackendSpec(name=name, url=f"http://{name}"), model_name="m")
        self.delay, self.fail, self.calls, self.up = delay, fail, 0, True

    async def complete(self, req: GenerateRequest) -> BackendResult:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise BackendError(self.fail, "injected")
        return BackendResult(req.prompt_ids, [1], [-0.5], "x", "length", None, req.version, self.name)

    async def load_weights(
        self, *, version: int, path: Path | None = None, key: str | None = None, job_id: str | None = None
    ) -> float:
        return 0.0

    async def served(self) -> Served:
        return Served(base="m")

    async def release(self, job_id: str) -> float:
        return 0.0

    async def health(self) -> bool:
        return self.up


def settings(**kw) -> InferenceSettings:  # noqa: ANN003
    base = {
        "max_retries": 2,
        "retry_backoff_s": 0.001,
        "max_inflight_per_backend": 4,
        "breaker_failures": 2,
        "breaker_reset_s": 0.2,
        "request_timeout_s": 5.0,
    }
    return InferenceSettings(**{**base, **kw})


async def test_episodes_stick_to_one_backend() -> None:
    backends = [FakeBackend(f"b{i}") for i in range(3)]
    router = Router(backends, settings())
    for ep in (f"ep-{i}" for i in range(30)):
        used = set()
        for _ in range(4):
            res = await router.generate(GenerateRequest([1, 2], episode_id=ep))
            used.add(res.backend)
        assert used == {router.sticky_target(ep)}
    assert all(b.calls > 0 for b in backends)  # the ring spreads episodes


async def test_bounded_load_spills_a_hot_episode_to_another_backend() -> None:
    backends = [FakeBackend("b0", delay=0.05), FakeBackend("b1", delay=0.05)]
    router = Router(backends, settings(max_inflight_per_backend=8, load_factor=1.25))
    results = await asyncio.gather(
        *(router.generate(GenerateRequest([1], episode_id="hot")) for _ in range(8))
    )
    by = {b.name: sum(r.backend == b.name for r in results) for b in backends}
    assert by[router.sticky_target("hot")] >= 4 and min(by.values()) >= 2


async def test_bounded_inflight_and_has_capacity() -> None:
    b = FakeBackend("b0", delay=0.1)
    router = Router([b], settings(max_inflight_per_backend=2))
    tasks = [asyncio.create_task(router.generate(GenerateRequest([1]))) for _ in range(5)]
    await asyncio.sleep(0.03)
    assert router.slots["b0"].outstanding == 2 and not router.has_capacity()
    assert len(await asyncio.gather(*tasks)) == 5  # the rest waited for capacity, none failed
    assert router.has_capacity()


async def test_retry_on_another_backend_and_breaker_opens() -> None:
    bad, good = FakeBackend("bad", fail=ErrorKind.server), FakeBackend("good")
    router = Router([bad, good], settings())
    ep = next(f"e{i}" for i in range(100) if router.sticky_target(f"e{i}") == "bad")
    for _ in range(3):
        assert (await router.generate(GenerateRequest([1], episode_id=ep))).backend == "good"
    assert router.slots["bad"].breaker.state is BreakerState.open
    calls = bad.calls
    await router.generate(GenerateRequest([1], episode_id=ep))
    assert bad.calls == calls  # open: not tried
    bad.fail = None
    await asyncio.sleep(0.25)  # half-open after reset_s: one trial, which succeeds
    assert (await router.generate(GenerateRequest([1], episode_id=ep))).backend == "bad"
    assert router.slots["bad"].breaker.state is BreakerState.closed


async def test_retry_budget_ends_in_a_failure_with_the_reason() -> None:
    backends = [FakeBackend("a", fail=ErrorKind.timeout), FakeBackend("b", fail=ErrorKind.timeout)]
    router = Router(backends, settings(max_retries=2, breaker_failures=10))
    with pytest.raises(RequestFailed) as e:
        await router.generate(GenerateRequest([1]))
    assert e.value.attempts == 3 and "timeout" in e.value.reason
    client_err = Router([FakeBackend("c", fail=ErrorKind.client)], settings())
    with pytest.raises(RequestFailed) as e2:
        await client_err.generate(GenerateRequest([1]))
    assert e2.value.attempts == 1  # a bad request is not retried


async def test_an_open_circuit_keeps_the_error_that_opened_it_in_the_reason() -> None:
    router = Router([FakeBackend("only", fail=ErrorKind.server)], settings(breaker_failures=1))
    with pytest.raises(RequestFailed) as e:
        await router.generate(GenerateRequest([1]))
    assert e.value.reason.startswith("failed after 3 attempt(s): no backend available")
    assert e.value.reason.endswith("; before that only: server_error: injected")  # not only "circuit open"


def test_breaker_half_open_lets_one_trial_through() -> None:
    now = [0.0]
    br = CircuitBreaker(failures_to_open=1, reset_s=1.0, clock=lambda: now[0])
    br.failure()
    assert br.state is BreakerState.open and not br.can_try()
    now[0] = 1.5
    assert br.can_try()
    br.begin()
    assert br.state is BreakerState.half_open and not br.can_try()
    br.failure()
    assert br.state is BreakerState.open


async def test_failover_when_a_real_engine_is_killed(two_cpu_server_processes) -> None:  # noqa: ANN001
    a, b = two_cpu_server_processes
    backends = [
        CpuServerBackend(
            BackendSpec(name=n, url=s.url), model_name="temper-policy", timeout_s=10, connect_timeout_s=1
        )
        for n, s in (("e0", a), ("e1", b))
    ]
    router = Router(backends, settings(health_interval_s=0.2))
    await router.start()
    try:
        tok = default_tokenizer()
        prompt = encode_chat(tok, [{"role": "user", "content": "failover"}])
        req = GenerateRequest(prompt, SamplingParams(max_tokens=4, seed=1), episode_id="ep-1")
        first = await router.generate(req)
        victim = a if first.backend == "e0" else b
        victim.kill()
        results = await asyncio.gather(*(router.generate(req) for _ in range(4)))
        assert {r.backend for r in results} == {"e1" if first.backend == "e0" else "e0"}
        assert all(r.token_ids == first.token_ids for r in results)  # same weights seed, same request seed
        assert not router.slots[first.backend].healthy
    finally:
        await router.stop()
