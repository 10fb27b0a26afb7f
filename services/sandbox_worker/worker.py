"""The sandbox worker's logic, free of HTTP and of the bus: sessions, the one-shot
"code + tests" run, SandboxFusion's ``/run_code`` and the idempotent step handler
(``await worker.handle(request) -> result``). ``component.py`` puts it on the bus,
``routes.py`` over HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from services.sandbox_worker.schemas import (
    CommandRunResult,
    CreateSession,
    RestoreSession,
    RunCodeRequest,
    RunCodeResponse,
    RunTests,
    RunTestsResult,
    SessionCreated,
    SnapshotTaken,
)
from temper import faults
from temper.events import SandboxRequest, SandboxResult
from temper.logs import log_context
from temper.sandbox import (
    Action,
    ExecResult,
    KillReason,
    RequestRefused,
    SandboxError,
    SandboxLimits,
    SandboxManager,
    SnapshotError,
)
from temper.sandbox.images import ImageError
from temper.sandbox.languages import LanguageName
from temper.sandbox.programs import LanguageUnavailable, ProgramResult, run_program
from temper.sandbox.sandbox import refuse_files
from temper.settings.sandbox import SandboxSettings

log = logging.getLogger(__name__)

IDEMPOTENCY_CACHE = 4096


class SandboxWorker:
    def __init__(
        self,
        settings: SandboxSettings,
        *,
        store: Any | None = None,
        distributed: bool = False,
        worker_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.manager = SandboxManager(settings, distributed=distributed, store=store)
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._running = 0
        self._recent: OrderedDict[tuple[str, int, int], asyncio.Future[SandboxResult]] = OrderedDict()
        # The results of the actions each step ran in a session this worker holds, by
        # (episode, turn, the actions): a retry of the step, the same attempt (the snapshot's
        # upload failed) or a later one (the dispatcher sent it again when no result came),
        # takes the snapshot and answers with them; it never runs the actions again on the
        # workspace they changed (a later attempt did, while the object store was full).
        self._acted: OrderedDict[tuple[str, int, str], tuple[dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )
        # Called with ``full`` each time a slot is taken or freed (the consumer's backpressure).
        self.load_listeners: list[Callable[[bool], None]] = []

    async def start(self) -> None:
        await self.manager.start()

    async def close(self) -> None:
        await self.manager.close()

    @property
    def full(self) -> bool:
        """True while every action slot is taken: a consumer should pause its partitions."""
        return self._running >= self.settings.concurrency

    async def _run(self, coro: Any) -> Any:
        async with self._slots:
            self._running += 1
            self._load_changed()
            try:
                return await coro
            finally:
                self._running -= 1
                self._load_changed()

    def _load_changed(self) -> None:
        full = self.full
        for listener in self.load_listeners:
            listener(full)

    def health(self) -> dict[str, str]:
        return self.manager.health()

    # --- sessions ---------------------------------------------------------------------
    async def create_session(self, body: CreateSession) -> SessionCreated:
        sid = await self.manager.create_session(body.limits, session_id=body.session_id)
        return SessionCreated(session_id=sid)

    async def act(self, session_id: str, action: Action) -> ExecResult:
        return await self._run(self.manager.act(session_id, action))

    async def snapshot(self, session_id: str) -> SnapshotTaken:
        return SnapshotTaken(key=await self.manager.snapshot(session_id))

    async def restore(self, body: RestoreSession) -> SessionCreated:
        sid = await self.manager.restore(body.key, body.limits, session_id=body.session_id)
        return SessionCreated(session_id=sid)

    async def delete(self, session_id: str) -> None:
        await self.manager.destroy_session(session_id)

    # --- one-shot runs ----------------------------------------------------------------
    def _files(self, files: dict[str, str | None], limits: SandboxLimits) -> dict[str, bytes]:
        """``files`` (path -> base64) as bytes; one that is not base64, or whose path
        leaves the workspace, is a RequestRefused naming ``files``."""
        raw: dict[str, bytes] = {}
        for path, content in files.items():
            try:
                raw[path] = base64.b64decode(content or "", validate=True)
            except binascii.Error as e:
                raise RequestRefused("files", f"file {path!r} is not base64: {e}") from None
        refused = refuse_files(raw, limits)
        if refused is not None:
            raise RequestRefused("files", refused.error or "a file cannot be written")
        return raw

    async def _program(
        self,
        language: LanguageName,
        code: str,
        *,
        files: dict[str, str | None],
        stdin: str | None,
        limits: SandboxLimits | None,
        compile_timeout_s: float,
        fetch: list[str] | tuple[str, ...] = (),
        address_space: bool = False,
    ) -> ProgramResult:
        """``code`` compiled (where its language is) and run once where no other run was
        (``temper.sandbox.programs``), holding one action slot throughout; a failure of the
        sandbox itself is a SandboxError."""
        raw = self._files(files, limits or self.settings.default_limits)
        program = run_program(
            self.manager, self.manager.languages[language], code, files=raw, stdin=stdin, limits=limits,
            compile_timeout_s=compile_timeout_s, fetch=fetch, address_space=address_space,
        )  # fmt: skip
        result: ProgramResult = await self._run(program)
        for step in (result.compile, result.run):
            if step is not None and step.error:
                raise SandboxError(step.error)
        return result

    async def run_tests(self, body: RunTests) -> RunTestsResult:
        program = body.code if not body.tests else f"{body.code}\n\n{body.tests}\n"
        result = await self._program(
            body.language, program, files=dict(body.files), stdin=body.stdin, limits=body.limits,
            compile_timeout_s=body.compile_timeout,
        )  # fmt: skip
        ended = result.run or result.compile
        assert ended is not None
        return RunTestsResult(
            passed=result.run is not None and result.run.ok, result=ended, compile=result.compile
        )

    async def run_code(self, body: RunCodeRequest) -> RunCodeResponse:
        base = self.settings.default_limits
        update: dict[str, Any] = {"wall_s": body.run_timeout, "cpu_s": body.run_timeout}
        if body.memory_limit_MB > 0:
            update["memory_mb"] = max(16, body.memory_limit_MB)
        try:
            limits = SandboxLimits.model_validate({**base.model_dump(), **update})
        except ValidationError as e:
            return RunCodeResponse(status="SandboxError", message=f"bad limits: {e.errors()[0]['msg']}")
        try:
            result = await self._program(
                body.language, body.code, files=body.files, stdin=body.stdin, limits=limits,
                compile_timeout_s=body.compile_timeout, fetch=body.fetch_files,
                address_space=body.memory_limit_MB > 0,  # a Python program meets MemoryError, as there
            )  # fmt: skip
        except LanguageUnavailable:
            raise  # a 422 naming ``language``, as SandboxFusion answers a language it lacks
        except (SandboxError, ValueError, OSError, binascii.Error) as e:
            return RunCodeResponse(status="SandboxError", message=str(e), executor_pod_name=self.worker_id)
        fetched = {
            path: base64.b64encode(data).decode() for path, data in result.files.items() if data is not None
        }
        return fusion_response(result, fetched, self.worker_id, limits)

    # --- the bus handler --------------------------------------------------------------
    async def handle(self, request: SandboxRequest) -> SandboxResult:
        """Run one step for an episode. Idempotent by (episode, turn, attempt): a
        redelivered request gets the recorded result, a concurrent duplicate waits for the
        first, and a retry after the step failed past its actions (the snapshot's upload)
        does not run them again. A session this worker does not hold is restored from
        ``snapshot_key``."""
        key = step_key(request)
        fut = self._recent.get(key)
        if fut is not None:
            self._recent.move_to_end(key)
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._recent[key] = fut
        while len(self._recent) > IDEMPOTENCY_CACHE:
            self._recent.popitem(last=False)
        try:
            with log_context(job_id=request.job_id, episode_id=request.episode_id, turn=request.turn):
                result = await self._handle(request)
        except BaseException as e:
            self._recent.pop(key, None)  # not recorded: a retry runs it again
            fut.set_exception(e)
            fut.exception()  # mark retrieved
            raise
        fut.set_result(result)
        return result

    def _result(self, request: SandboxRequest, **fields: Any) -> SandboxResult:
        return SandboxResult(
            job_id=request.job_id,
            episode_id=request.episode_id,
            turn=request.turn,
            attempt=request.attempt,
            session_id=request.session_id,
            worker=self.worker_id,
            **fields,
        )

    async def _handle(self, request: SandboxRequest) -> SandboxResult:
        try:
            action = None
            if request.action.get("kind") != "destroy":
                action = Action.model_validate(request.action)
            more = [Action.model_validate(a) for a in request.more_actions]
            for raw in request.setup:
                Action.model_validate(raw)
            limits = SandboxLimits.model_validate(request.limits) if request.limits else None
        except ValidationError as e:
            return self._result(request, error=f"invalid request: {e.errors()[0]['msg']}")
        # The whole step (restore or create, the actions, the snapshot) holds one slot.
        return await self._run(self._step(request, action, limits, more))

    async def _step(
        self,
        request: SandboxRequest,
        action: Action | None,
        limits: SandboxLimits | None,
        more: list[Action] | None = None,
    ) -> SandboxResult:
        sid = request.session_id
        if action is None:  # {"kind": "destroy"}: the teardown runs off the hot path
            if sid in self.manager.sessions:
                await self.manager.destroy_session(sid, wait=False)
            return self._result(request)
        key = acted_key(request)
        acted = self._acted.get(key) if sid in self.manager.sessions else None
        if acted is None:  # the actions have not run in this session yet
            if sid not in self.manager.sessions:
                error = await self._open_session(request, limits)
                if error is not None:
                    return self._result(request, error=error)
            if request.keep_s is not None:  # kept until the episode's deadline, whatever it waits on
                self.manager.keep(sid, request.keep_s)
            result = (await self.manager.act(sid, action)).model_dump(mode="json")
            await faults.hold("sandbox.act", episode_id=request.episode_id, turn=request.turn)
            more_results = [(await self.manager.act(sid, a)).model_dump(mode="json") for a in more or []]
            acted = (result, more_results)
            self._acted[key] = acted
            while len(self._acted) > IDEMPOTENCY_CACHE:
                self._acted.popitem(last=False)
        if request.keep_s is not None:  # from the step's end
            self.manager.keep(sid, request.keep_s)
        snapshot_key = None
        if request.snapshot_after and self.store is not None:
            turn = request.turn or 0
            snapshot_key = f"{self.settings.snapshot_prefix}/{sid}/turn-{turn:06d}-a{request.attempt}.tar.gz"
            await self.manager.snapshot(sid, snapshot_key)
        return self._result(request, result=acted[0], more_results=acted[1], snapshot_key=snapshot_key)

    async def _open_session(self, request: SandboxRequest, limits: SandboxLimits | None) -> str | None:
        """Make the session this worker lacks: restored from ``snapshot_key`` when the
        request names one (the task's starting files are already in it), else new, with
        the starting files written. Returns an error for the result, or None."""
        sid = request.session_id
        if request.snapshot_key:
            if self.store is None:
                return "the request names a snapshot but this worker has no object store"
            log.info("session %s not held here: restoring %s", sid, request.snapshot_key)
            try:
                await self.manager.restore(request.snapshot_key, limits, session_id=sid)
            except KeyError:  # temper.storage.NotFound
                return f"snapshot {request.snapshot_key} not found"
            except SnapshotError as e:
                return f"snapshot {request.snapshot_key} cannot be restored: {e}"
            except (ImageError, RequestRefused) as e:
                return str(e)
            return None
        try:
            await self.manager.create_session(limits, session_id=sid)
        except (ImageError, RequestRefused) as e:  # the job's submission checks both
            return str(e)
        for path, content in request.files.items():
            r = await self.manager.act(sid, Action(kind="write_file", path=path, content=content))
            if r.error:
                await self.manager.destroy_session(sid)
                return f"cannot write starting file {path}: {r.error}"
        for raw in request.setup:  # the environment's setup program, before the agent's first action
            r = await self.manager.act(sid, Action.model_validate(raw))
            if r.error or r.kill_reason is not None or r.exit_code != 0:
                await self.manager.destroy_session(sid)
                why = r.error or (
                    f"killed ({r.kill_reason})" if r.kill_reason else f"exit status {r.exit_code}"
                )
                return f"setup failed: {why}: {(r.stderr or r.stdout).strip()[-500:]}"
        return None


def step_key(request: SandboxRequest) -> tuple[str, int, int]:
    """What makes a step one: (episode, turn, attempt)."""
    return (request.episode_id or request.session_id, request.turn or 0, request.attempt)


def acted_key(request: SandboxRequest) -> tuple[str, int, str]:
    """What makes the actions of a step one, whatever the attempt: (episode, turn, the
    actions themselves, so a different action at that turn is never taken for them)."""
    actions = json.dumps([request.action, *request.more_actions], sort_keys=True, default=str)
    return (
        request.episode_id or request.session_id,
        request.turn or 0,
        hashlib.sha256(actions.encode()).hexdigest(),
    )


def command_result(result: ExecResult) -> CommandRunResult:
    """One step as SandboxFusion reports it: ``TimeLimitExceeded`` when its time (wall or
    CPU) ran out, else ``Finished`` with the exit status, or -signal for a process a
    signal ended (the memory limit's kill too: the run finished, its program failed; a
    run-level ``Error`` is a sandbox fault only). Temper's kill reason and truncation
    flags come as extra fields."""
    if result.kill_reason in (KillReason.timeout, KillReason.cpu):
        status, code = "TimeLimitExceeded", None
    else:
        status, code = "Finished", result.exit_code
        if code is None and result.signal is not None:
            code = -result.signal
    return CommandRunResult(
        status=status,
        execution_time=result.exec_s if result.exec_s is not None else result.wall_s,
        return_code=code,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_truncated=result.stdout_truncated,
        stderr_truncated=result.stderr_truncated,
        kill_reason=result.kill_reason,
    )


def fusion_response(
    result: ProgramResult, fetched: dict[str, str], worker_id: str, limits: SandboxLimits
) -> RunCodeResponse:
    """Map a program's compile and run onto SandboxFusion's response: ``Success`` when
    every step finished with status 0, else ``Failed`` (a compile that failed leaves no
    ``run_result``). Unlike SandboxFusion, output cut at the limit is never a success:
    the message says which stream was cut, and ``stdout_truncated``/``stderr_truncated``/
    ``kill_reason`` say it in fields."""
    steps = [
        (name, step) for name, step in (("compile", result.compile), ("run", result.run)) if step is not None
    ]
    messages = []
    ok = result.run is not None
    for name, step in steps:
        cut = [
            stream
            for stream, flag in (("stdout", step.stdout_truncated), ("stderr", step.stderr_truncated))
            if flag
        ]
        prefix = "compile " if name == "compile" else ""
        if cut:
            messages.append(
                f"{prefix}output truncated: {' and '.join(cut)} cut at {limits.output_bytes} bytes"
            )
        if step.kill_reason is not None:
            messages.append(f"{prefix}killed: {step.kill_reason.value}")
        ok = ok and step.ok
    return RunCodeResponse(
        status="Success" if ok else "Failed",
        message="; ".join(messages),
        compile_result=command_result(result.compile) if result.compile is not None else None,
        run_result=command_result(result.run) if result.run is not None else None,
        executor_pod_name=worker_id,
        files=fetched,
    )
