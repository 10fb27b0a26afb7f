"""Every settings field is read by the code (``make lint`` and ``make test`` run this file).

A field nothing reads is worse than none: operators set it and trust it. mypy resolves
every attribute read in ``libs/temper`` and ``services`` to the class that declares the
field (``tests/settings_reads/plugin.py`` records them), so a field counts as read only
through its own model type: ``backend.host`` somewhere does not keep ``ApiSettings.host``
alive. The fields are found by walking :class:`temper.settings.Settings` through the
models its fields hold (``X``, ``X | None``, ``list[X]``). Reads inside the settings
modules themselves (validators) do not count.
"""

from __future__ import annotations

import importlib
import os
import typing
from pathlib import Path

import pytest
from mypy import api as mypy_api
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().parent / "settings_reads" / "plugin.py"

pytestmark = pytest.mark.timeout(600)

# Models whose fields the code reads by name (getattr over a list of names), so mypy sees no
# read: the module that does it, and the list it reads, which must name every field.
READ_BY_NAME = {"temper.settings.sandbox.LimitMaxima": ("temper.sandbox.admission", "CAPPED")}


def _models_in(annotation: typing.Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def settings_fields(root: type[BaseModel]) -> dict[str, str]:
    """``{"<module>.<Class>.<field>": "path.through.settings"}`` for every field under ``root``."""
    found: dict[str, str] = {}
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            owner = next(c for c in model.__mro__ if name in getattr(c, "__annotations__", {}))
            found.setdefault(f"{owner.__module__}.{owner.__qualname__}.{name}", prefix + name)
            for sub in _models_in(field.annotation):
                walk(sub, f"{prefix}{name}.")

    walk(root, "")
    return found


def read_fields(paths: list[str], out: Path) -> set[str]:
    """The fields mypy saw read in ``paths`` (files or directories, relative to the working
    directory): accesses there that are not assignments (mypy looks at an assigned
    attribute twice, once as a target: that place is not a read)."""
    config = out.with_suffix(".ini")
    config.write_text(
        "[mypy]\n"
        "python_version = 3.11\n"
        "ignore_missing_imports = True\n"
        "explicit_package_bases = True\n"
        "follow_imports = silent\n"
        f"mypy_path = {ROOT / 'libs'}:{ROOT}\n"
        f"plugins = pydantic.mypy, {PLUGIN}\n"
    )
    os.environ["TEMPER_SETTINGS_READS_OUT"] = str(out)
    try:
        stdout, stderr, status = mypy_api.run(
            ["--config-file", str(config), "--no-incremental", "--cache-dir", os.devnull, *paths]
        )
    finally:
        del os.environ["TEMPER_SETTINGS_READS_OUT"]
    assert status in (0, 1), stdout + stderr  # 1: type errors, which make lint reports; 2: crashed
    events = [line.split("\t") for line in out.read_text().splitlines()] if out.exists() else []
    assigned = {(where, at) for _, where, at, lvalue in events if lvalue == "1"}
    inside = tuple(p.rstrip("/") + "/" if not p.endswith(".py") else p for p in paths)
    return {
        name
        for name, where, at, lvalue in events
        if lvalue == "0" and (where, at) not in assigned and where.startswith(inside)
    }


def unread(fields: dict[str, str], reads: set[str]) -> list[str]:
    return sorted(path for name, path in fields.items() if name not in reads)


def test_every_settings_field_is_read_by_the_code(tmp_path):
    from temper.settings import Settings

    fields = settings_fields(Settings)
    assert len(fields) > 100, "the walk found too few settings fields"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        reads = read_fields(["libs/temper", "services"], tmp_path / "reads.txt")
    finally:
        os.chdir(cwd)
    for model, (module, names) in READ_BY_NAME.items():
        listed = getattr(importlib.import_module(module), names)
        reads |= {f"{model}.{name}" for name in listed}
    assert unread(fields, reads) == []


def test_the_fields_read_by_name_are_the_models_fields():
    for model, (module, names) in READ_BY_NAME.items():
        module_name, _, cls = model.rpartition(".")
        fields = getattr(importlib.import_module(module_name), cls).model_fields
        assert set(getattr(importlib.import_module(module), names)) == set(fields), model


def test_a_field_read_only_by_its_bare_name_elsewhere_is_found(tmp_path):
    """The planted violation: ``Conf.host`` is read by nobody, though an unrelated class's
    ``host`` is; ``Conf.port`` and the nested ``Conf.inner.limit`` are read."""
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "conf.py").write_text(
        "from pydantic import BaseModel\n\n\n"
        "class Inner(BaseModel):\n    limit: int = 1\n    unused: int = 2\n\n\n"
        "class Conf(BaseModel):\n    host: str = 'h'\n    port: int = 1\n    inner: Inner = Inner()\n"
    )
    (pkg / "use.py").write_text(
        "from planted.conf import Conf\n\n\n"
        "class Backend:\n    host: str = 'x'\n\n\n"
        "def serve(conf: Conf, backend: Backend) -> str:\n"
        "    conf.host = 'written, not read'\n"
        "    return f'{backend.host}:{conf.port}:{conf.inner.limit}'\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        from planted.conf import Conf  # type: ignore[import-not-found]

        fields = settings_fields(Conf)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "planted" or m.startswith("planted.")]:
            del sys.modules[name]
    assert set(fields.values()) == {"host", "port", "inner", "inner.limit", "inner.unused"}
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        reads = read_fields(["planted"], tmp_path / "reads.txt")
    finally:
        os.chdir(cwd)
    assert unread(fields, reads) == ["host", "inner.unused"]
