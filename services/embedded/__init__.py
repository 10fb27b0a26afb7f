"""The embedded mode: every service of Temper in one process, on SQLite, the in-process
bus and a local directory, for a laptop and a first try (``temper run SPEC``).

This is the one place where services import each other: it composes the dispatcher,
inference gateway (with an in-process CPU engine), sandbox worker, reward scorer and
trainer on a single :class:`temper.runtime.Runtime`.
"""
