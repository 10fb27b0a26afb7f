"""What every service process shares: settings loaded with clear errors, JSON logs,
the database, bus and object store started in a fixed order, and the ``/health``
and ``/metrics`` endpoints.

A service builds a :class:`Runtime` and its components and hands them to
:func:`service_app`: one lifespan for every service, so all start, fail and stop alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import uvicorn
from fastapi import APIRouter, FastAPI, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from pydantic_settings import SettingsError

from temper import eventloop, metrics, problems
from temper.bus import Bus, BusUnavailable, Consumer, Record, make_bus
from temper.db import Database, DatabaseUnavailable
from temper.db.migrate import NotMigrated, check_migrated
from temper.events import BadMessage, Message, Topics, decode
from temper.logs import configure_logging, log_context, log_event
from temper.settings import Settings
from temper.storage import ObjectStore, S3Store, make_store

log = logging.getLogger("temper.runtime")


class StartupError(RuntimeError):
    """A component could not start; the message says which setting to check."""


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment; a bad value becomes one readable line per field."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except SettingsError as exc:  # a value the environment source could not even decode
        raise StartupError(f"invalid settings: {exc}") from None
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = "__".join(str(p) for p in err["loc"]).upper()
            name = f"TEMPER_{loc}" if loc else "settings"
            lines.append(f"{name}: {problems.message(err)}")
        raise StartupError("invalid settings:\n  " + "\n  ".join(lines)) from None


@dataclass
class Runtime:
    settings: Settings
    service: str
    needs_db: bool = True
    needs_bus: bool = True
    needs_store: bool = True
    db: Database | None = None
    bus: Bus | None = None
    store: ObjectStore | None = None
    # Extra health checks a service adds (name -> coroutine that raises when unhealthy).
    checks: dict[str, Callable[[], Awaitable[None]]] = field(default_factory=dict)
    # The outbox relays running in this process (their notify). A service that writes
    # outbox rows without a relay of its own (the trainer beside the dispatcher in one
    # process) calls notify_outbox(), so its commands go out now, not at the next sweep.
    outbox_relays: list[Callable[[], None]] = field(default_factory=list)
    # Called once this process's gateway recorded that it serves a new policy version: a
    # scheduler in the same process runs now (its staleness gate waits on that version).
    version_served: list[Callable[[], None]] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def notify_outbox(self) -> None:
        """Tell this process's outbox relays that rows were just committed."""
        for notify in self.outbox_relays:
            notify()

    def notify_version_served(self) -> None:
        """Tell this process's schedulers that its gateway serves a new policy version."""
        for wake in self.version_served:
            wake()

    async def start(self) -> None:
        log_settings = self.settings.log
        configure_logging(self.service, log_settings.level, log_settings.json_lines, log_settings.file)
        try:
            if self.needs_db:
                self.db = Database(self.settings.db)
                await self.db.check()
                await check_migrated(self.db)  # else the first query fails with "no such table"
            if self.needs_bus:
                self.bus = make_bus(self.settings)
                await self.bus.start()
                await self.bus.create_topics(Topics.ALL)
            if self.needs_store:
                self.store = make_store(self.settings)
                if isinstance(self.store, S3Store):
                    await self.store.ensure_bucket()
                await self.store.check()
        except (DatabaseUnavailable, BusUnavailable, NotMigrated) as exc:
            await self.stop()
            raise StartupError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - storage clients raise many kinds
            await self.stop()
            if self.needs_store and self.store is not None:
                raise StartupError(
                    f"cannot use the object store ({self.settings.storage.kind}) at "
                    f"TEMPER_STORAGE__ENDPOINT={self.settings.storage.endpoint!r}: {exc}"
                ) from None
            raise
        log_event(log, "service started", service=self.service, mode=str(self.settings.mode))

    async def consume(
        self,
        topics: tuple[str, ...] | list[str],
        handler: Callable[[Message], Awaitable[None]],
        *,
        group: str | None = None,
        concurrency: int = 1,
    ) -> Consumer:
        """Subscribe ``handler`` to typed messages; a message that does not parse goes
        to the dead-letter topic at once (see :class:`temper.bus.base.Delivery`)."""
        assert self.bus is not None, "consume() needs the bus"

        async def on_record(record: Record) -> None:
            message = decode(record.value)
            with log_context(
                job_id=message.job_id,
                episode_id=message.episode_id,
                turn=message.turn,
                attempt=message.attempt,
            ):
                await handler(message)

        return await self.bus.subscribe(
            list(topics), group or self.service, on_record, concurrency=concurrency
        )

    async def consume_handlers(
        self,
        handlers: Mapping[str, Callable[[Any], Awaitable[None]]],
        *,
        group: str | None = None,
        concurrency: int = 1,
        batch_handlers: Mapping[str, Callable[[list[Any]], Awaitable[None]]] | None = None,
    ) -> Consumer:
        """Subscribe one typed handler per topic (``{topic: handler}``), all in one group.

        Each handler's first parameter is annotated with the message class it takes
        (``async def on_result(message: InferenceResult)``); a message of another class on
        that topic is logged and skipped, so handlers need no ``isinstance`` chains.

        ``batch_handlers`` (``{topic: handler}``) take several messages of that topic and of
        distinct keys at once, all or nothing (see ``Bus.subscribe``'s ``batch_handler``):
        when a bus offers a batch, it goes to them; a batch with a message that does not
        parse or is of another class is declined, and its messages go one by one."""
        routes = {topic: (handler, handled_type(handler)) for topic, handler in handlers.items()}
        batch_routes = dict(batch_handlers or {})

        async def on_batch(records: list[Record]) -> bool:
            topic = records[0].topic
            batch_handler = batch_routes.get(topic)
            if batch_handler is None or any(r.topic != topic for r in records):
                return False
            expected = routes[topic][1]
            try:
                messages = [decode(r.value) for r in records]
            except BadMessage:
                return False
            if not all(isinstance(m, expected) for m in messages):
                return False
            await batch_handler(messages)
            return True

        async def on_record(record: Record) -> None:
            message = decode(record.value)
            handler, expected = routes[record.topic]
            with log_context(
                job_id=message.job_id,
                episode_id=message.episode_id,
                turn=message.turn,
                attempt=message.attempt,
            ):
                if not isinstance(message, expected):
                    log_event(
                        log,
                        "unexpected message type on topic",
                        logging.WARNING,
                        topic=record.topic,
                        type=message.type,
                        expected=expected.__name__,
                    )
                    return
                await handler(message)

        assert self.bus is not None, "consume_handlers() needs the bus"
        return await self.bus.subscribe(
            list(routes),
            group or self.service,
            on_record,
            concurrency=concurrency,
            batch_handler=on_batch if batch_routes else None,
        )

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run a background loop for the life of the service; a crash is logged loudly and
        shows in ``/health`` as ``task:<name>``. The runtime cancels it at ``stop()``; a
        component that must stop it earlier cancels the returned task itself."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s crashed", name)
                raise

        task = asyncio.create_task(guarded(), name=name)
        self._tasks.append(task)
        return task

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - already logged
                pass
        self._tasks.clear()
        if self.bus is not None:
            await self.bus.stop()
        if self.db is not None:
            await self.db.dispose()

    async def health(self) -> dict[str, str]:
        """Each component's state: ``ok`` or the error."""
        components: dict[str, Callable[[], Awaitable[None]]] = {}
        if self.db is not None:
            components["database"] = self.db.check
        if self.bus is not None:
            components["bus"] = self.bus.check
        if self.store is not None:
            components["storage"] = self.store.check
        components.update(self.checks)
        for task in self._tasks:
            if task.done() and not task.cancelled():
                components[f"task:{task.get_name()}"] = _raise_task_error(task)
        report = {}
        for name, check in components.items():
            try:
                await asyncio.wait_for(check(), 5)
                report[name] = "ok"
            except Exception as exc:  # noqa: BLE001 - report, don't raise
                report[name] = f"down: {exc.__class__.__name__}: {exc}"[:300]
        return report


def handled_type(handler: Callable[..., Awaitable[None]]) -> type[Message]:
    """The message class a handler's first parameter is annotated with."""
    params = list(inspect.signature(handler, eval_str=True).parameters.values())
    annotation = params[0].annotation if params else inspect.Parameter.empty
    if not (isinstance(annotation, type) and issubclass(annotation, Message)):
        raise TypeError(
            f"handler {getattr(handler, '__qualname__', handler)!r} must annotate its first "
            f"parameter with a message class, not {annotation!r}"
        )
    return annotation


def _raise_task_error(task: asyncio.Task[None]) -> Callable[[], Awaitable[None]]:
    async def check() -> None:
        exc = task.exception()
        raise RuntimeError(f"stopped: {exc!r}" if exc else "stopped")

    return check


def health_router(runtime: Runtime) -> APIRouter:
    router = APIRouter(tags=["operations"])

    @router.get("/health", summary="Component health; 503 names what is down")
    async def health() -> JSONResponse:
        report = await runtime.health()
        down = [name for name, state in report.items() if state != "ok"]
        body: dict[str, Any] = {
            "service": runtime.service,
            "status": "down" if down else "ok",
            "components": report,
        }
        if down:
            body["down"] = down
        return JSONResponse(body, status_code=503 if down else 200)

    @router.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render_latest()
        return Response(body, media_type=content_type)

    return router


class Component(Protocol):
    """A part of a service started on its :class:`Runtime`: bus consumers, loops."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


@asynccontextmanager
async def started(components: Sequence[Component]) -> AsyncIterator[None]:
    """``components`` started in order; on exit, or when one fails to start, every
    component whose start was called (the failing one too, so a half-started one releases
    what it took) stops in reverse. ``stop`` must therefore cope with a partial start. A
    failing ``stop`` is logged and the rest still stop; the start error (if any) is what
    propagates."""
    begun: list[Component] = []
    try:
        for component in components:
            begun.append(component)
            await component.start()
        yield
    finally:
        for component in reversed(begun):
            try:
                await component.stop()
            except Exception:  # noqa: BLE001 - stop the rest
                log.exception("stopping %s failed", type(component).__name__)


@asynccontextmanager
async def running(runtime: Runtime, components: Sequence[Component]) -> AsyncIterator[None]:
    """The runtime, then :func:`started` ``components``; the runtime stops last."""
    await runtime.start()
    try:
        async with started(components):
            yield
    finally:
        await runtime.stop()


def runtime_lifespan(
    runtime: Runtime, components: Sequence[Component]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """A FastAPI lifespan around :func:`running`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(runtime, components):
            yield

    return lifespan


def service_app(
    runtime: Runtime, *components: Component, app_class: type[FastAPI] = FastAPI, **fastapi_kw: Any
) -> FastAPI:
    """The app of a service process: :func:`runtime_lifespan` over ``components``, and
    ``/health`` + ``/metrics`` from the runtime. ``app.state.runtime`` is the runtime."""
    app = app_class(lifespan=runtime_lifespan(runtime, components), **fastapi_kw)
    app.state.runtime = runtime
    app.include_router(health_router(runtime))
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after it stops serving, which kills the process
    before the app's lifespan shuts down (consumers, sandboxes, the trainer). This server
    forgets them instead: ``serve()`` returns, the lifespan exits in order, the process
    ends normally. Serve with ``lifespan="off"`` inside the app's own lifespan context, so
    that startup errors surface before the port opens."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def run_service(app_factory: Callable[[Settings], FastAPI], service: str, default_port: int) -> None:
    """Entry point of ``python -m services.<name>``: settings, the app's lifespan, then
    uvicorn. A startup error is printed as one message with exit status 2, not a stack
    trace. ``TEMPER_HOST``/``TEMPER_PORT`` (``Settings.host``/``.port``) choose where it listens."""

    async def serve(app: FastAPI, settings: Settings) -> None:
        async with app.router.lifespan_context(app):
            config = uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port or default_port,
                log_config=None,
                lifespan="off",  # already entered above, so startup errors surface here
            )
            await GracefulServer(config).serve()

    try:
        settings = load_settings(service=service)
        eventloop.run(serve(app_factory(settings), settings))
    except (StartupError, eventloop.UnknownEventLoop) as exc:
        sys.stderr.write(f"{service}: {exc}\n")
        raise SystemExit(2) from None
    exit_after_stop()


def exit_after_stop(status: int = 0) -> None:
    """End the process once its lifespan has stopped everything in order: run the atexit
    handlers (logging's flush among them), flush the streams and leave without the
    interpreter's finalization. That finalization can hang in a native destructor: seen
    as a gateway with a torch model that outlived SIGTERM in 2 of 6 stops under load, its
    main thread in the final garbage collection with no Python frame."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
