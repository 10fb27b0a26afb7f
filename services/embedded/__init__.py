"""The embedded mode: every service of Temper in one process, on SQLite, the in-process
bus and a local directory, for a laptop and a first try (``temper run SPEC``).

One of the compositions allowed to import services (with ``services.launcher`` and
``services.cli``; tests/test_import_contracts.py): it composes the dispatcher, inference
gateway (with an in-process CPU model), sandbox worker, reward scorer and trainer on a
single :class:`temper.runtime.Runtime`.
"""
