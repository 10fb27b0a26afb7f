"""The one lifespan every service uses (temper.runtime.running / service_app) and the
typed per-topic handlers (Runtime.consume_handlers), on the in-process bus."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from temper.events import InferenceResult, PolicyUpdate, Topics
from temper.runtime import Runtime, handled_type, running, service_app
from temper.settings import BusKind, BusSettings, Settings, StorageKind, StorageSettings


def make_runtime(tmp_path: Path) -> Runtime:
    settings = Settings(
        bus=BusSettings(kind=BusKind.inprocess, partitions=2, retry_backoff_s=0.01),
        storage=StorageSettings(kind=StorageKind.local, root=tmp_path / "objects"),
        data_dir=tmp_path,
    )
    return Runtime(settings, service="test", needs_db=False)


class Recorder:
    def __init__(self, name: str, log: list[str], *, fail_start: bool = False, fail_stop: bool = False):
        self.name, self.log, self.fail_start, self.fail_stop = name, log, fail_start, fail_stop

    async def start(self) -> None:
        self.log.append(f"start {self.name}")
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")

    async def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError(f"{self.name} cannot stop")


async def test_components_start_in_order_and_stop_in_reverse(tmp_path):
    runtime, log = make_runtime(tmp_path), []
    async with running(runtime, [Recorder("a", log), Recorder("b", log)]):
        assert runtime.bus is not None
        log.append("serving")
    assert log == ["start a", "start b", "serving", "stop b", "stop a"]


async def test_a_failed_start_stops_what_started_and_raises_its_error(tmp_path):
    runtime, log = make_runtime(tmp_path), []
    components = [Recorder("a", log), Recorder("b", log, fail_start=True), Recorder("c", log)]
    with pytest.raises(RuntimeError, match="b cannot start"):
        async with running(runtime, components):
            pytest.fail("must not serve")
    # b is stopped too (it may have half-started); c never started
    assert log == ["start a", "start b", "stop b", "stop a"]


async def test_a_failing_stop_does_not_keep_the_others_running(tmp_path, capfd):
    runtime, log = make_runtime(tmp_path), []
    async with running(runtime, [Recorder("a", log), Recorder("b", log, fail_stop=True)]):
        pass
    assert log == ["start a", "start b", "stop b", "stop a"]
    assert "stopping Recorder failed" in capfd.readouterr().err  # the runtime's JSON log


async def test_service_app_serves_health_and_metrics_from_the_runtime(tmp_path):
    runtime, log = make_runtime(tmp_path), []
    app = service_app(runtime, Recorder("a", log), title="test service")
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            health = await client.get("/health")
            metrics = await client.get("/metrics")
    assert health.status_code == 200 and health.json()["service"] == "test"
    assert set(health.json()["components"]) == {"bus", "storage"}
    assert metrics.status_code == 200
    assert app.state.runtime is runtime and log == ["start a", "stop a"]


def result(episode: str) -> InferenceResult:
    return InferenceResult(job_id="j", episode_id=episode, turn=0, attempt=0, policy_version=0)


async def test_typed_handlers_get_their_topic_and_skip_other_types(tmp_path):
    runtime = make_runtime(tmp_path)
    got: list[tuple[str, str]] = []
    done = asyncio.Event()

    async def on_inference_result(message: InferenceResult) -> None:
        got.append(("inference", message.episode_id or ""))
        if len(got) == 2:
            done.set()

    async def on_policy_update(message: PolicyUpdate) -> None:
        got.append(("policy", message.job_id or ""))

    async with running(runtime, []):
        assert runtime.bus is not None
        await runtime.consume_handlers(
            {Topics.INFERENCE_RESULTS: on_inference_result, Topics.POLICY_UPDATES: on_policy_update}
        )
        await runtime.bus.send_message(Topics.INFERENCE_RESULTS, result("e1"))
        # a message of the wrong type on a topic reaches no handler
        await runtime.bus.send_message(Topics.POLICY_UPDATES, result("wrong"))
        await runtime.bus.send_message(Topics.INFERENCE_RESULTS, result("e2"))
        await asyncio.wait_for(done.wait(), 10)
    assert sorted(got) == [("inference", "e1"), ("inference", "e2")]


def test_a_handler_must_name_its_message_type():
    async def untyped(message) -> None:  # type: ignore[no-untyped-def]
        pass

    async def typed(message: PolicyUpdate) -> None:
        pass

    assert handled_type(typed) is PolicyUpdate
    with pytest.raises(TypeError, match="must annotate its first parameter with a message class"):
        handled_type(untyped)
