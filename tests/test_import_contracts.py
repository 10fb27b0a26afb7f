"""The import boundaries, checked on the source (``make lint`` runs this file).

Every module of ``libs/temper`` and ``services`` is parsed; its imports are every
``import``/``from ... import`` (at any depth: a lazy import inside a function counts, and
stays allowed as long as it respects the contracts) and every
``importlib.import_module("...")`` or ``__import__("...")`` call with a literal name.

- the library never imports ``services`` in any form;
- no service imports another; the compositions (``services.embedded``, the multi-process
  ``services.launcher`` and the ``temper`` command ``services.cli``) are the exceptions;
- the sandbox library (``temper.sandbox``) never imports ``temper.rewards`` or ``temper.envs``;
- inside the library, every room (``temper.<name>``) sits in one layer and imports only its
  own layer and those below (:data:`LAYERS`, bottom first): core (the clock, the event loop, events,
  settings, the limits vocabulary, metrics and logging) < infrastructure (database, bus,
  object store, outbox, registry, plugins, the runtime) < domains < surfaces (the client
  and the CLI). A room in no layer fails the test, so a new one is placed on purpose;
- no module of a service imports another of the same service in a cycle (``TYPE_CHECKING``
  and lazy imports included: those were the cycles, ``component.py`` <-> ``handlers.py``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSITIONS = {"services.embedded", "services.launcher", "services.cli"}
SANDBOX_FORBIDDEN = ("temper.rewards", "temper.envs")
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("core", frozenset({
        "clock", "eventloop", "events", "settings", "limits", "metrics", "logs", "problems", "faults", "cores",
        "group_commit",
    })),
    ("infrastructure", frozenset({"db", "bus", "storage", "outbox", "registry", "plugins", "runtime", "celery_queue"})),
    (
        "domains",
        frozenset({
            "jobspec", "trajectory", "lifecycle", "tenants", "retention", "episode_log", "episode_steps", "policy",
            "sandbox", "rewards", "training", "tasks", "envs", "envpkg", "tracking", "provenance", "evaluation",
            "agent_traces",
        }),
    ),
    ("surfaces", frozenset({"client", "cli"})),
)  # fmt: skip


def layer_of(name: str) -> int | None:
    """The layer index of a ``temper.<room>...`` module (0 = core), or None outside a room."""
    parts = name.split(".")
    if parts[0] != "temper" or len(parts) < 2:
        return None
    for index, (_, rooms) in enumerate(LAYERS):
        if parts[1] in rooms:
            return index
    return -1  # a room in no layer


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports (for ``from a import b``: ``a`` and ``a.b``)
    line: int

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def _is_dynamic_import(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    if isinstance(func, ast.Attribute):
        return func.attr == "import_module" or (func.attr == "__import__")
    return False


def imports_of(source: str, module: str, *, is_package: bool = False) -> list[Import]:
    """Every import in ``source``, the source of ``module``."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.append(Import(module, base, node.lineno))
            found += [Import(module, f"{base}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(module, arg.value, node.lineno))
    return found


def _modules() -> list[tuple[str, Path, bool]]:
    out = []
    for root, prefix in ((ROOT / "libs" / "temper", "temper"), (ROOT / "services", "services")):
        for path in sorted(root.rglob("*.py")):
            parts = [prefix, *path.relative_to(root).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            out.append((".".join(parts), path, is_package))
    return out


def private_imports(source: str, module: str) -> list[str]:
    """``from x import _name`` of a module of the library or the services: a private name
    used by another module (``__future__`` and dunder names aside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("temper", "services")
        ):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{module}:{node.lineno} imports the private {node.module}.{alias.name}")
    return found


def all_imports() -> list[Import]:
    found: list[Import] = []
    for module, path, is_package in _modules():
        found += imports_of(path.read_text(), module, is_package=is_package)
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _service_of(name: str) -> str | None:
    """``services.<name>`` for a module inside a service, else None."""
    parts = name.split(".")
    if parts[0] != "services" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        if _within(imp.module, "temper") and _within(imp.target, "services"):
            bad.append(f"the library imports a service: {imp}")
        if _within(imp.module, "temper.sandbox") and any(_within(imp.target, f) for f in SANDBOX_FORBIDDEN):
            bad.append(f"the sandbox library imports rewards or envs: {imp}")
        here, there = layer_of(imp.module), layer_of(imp.target)
        if here == -1:
            bad.append(f"a room in no layer (add it to LAYERS): {imp}")
        elif here is not None and there is not None and there > here:
            bad.append(f"the {LAYERS[here][0]} layer imports the {LAYERS[there][0]} layer: {imp}")
        source, target = _service_of(imp.module), _service_of(imp.target)
        if source and target and source != target and source not in COMPOSITIONS:
            bad.append(f"a service imports another: {imp}")
    return bad


def test_the_code_keeps_its_import_contracts() -> None:
    imports = all_imports()
    assert len({i.module for i in imports}) > 100, "the walk found too few modules"
    assert violations(imports) == []


def test_no_private_name_is_imported_across_modules() -> None:
    found = [line for module, path, _ in _modules() for line in private_imports(path.read_text(), module)]
    assert found == []
    planted = private_imports("from temper.cli import _client\n", "temper.envpkg.cli")
    assert planted == ["temper.envpkg.cli:1 imports the private temper.cli._client"]
    assert private_imports("from temper.cli import client\nfrom x import _y\n", "m") == []


@pytest.mark.parametrize(
    ("module", "source", "broken"),
    [
        ("temper.cli", "import services.embedded.runner", "the library imports a service"),
        ("temper.cli", "from services import embedded", "the library imports a service"),
        ("temper.cli", "import importlib\nimportlib.import_module('services.embedded')", "library"),
        ("temper.cli", "def f():\n    __import__('services.embedded.runner')", "library"),
        ("temper.cli", "from importlib import import_module\nimport_module('services.x')", "library"),
        ("temper.sandbox.backends", "from temper.rewards import Scorer", "sandbox library"),
        ("temper.sandbox.backends", "from ..envs import code", "sandbox library"),
        ("services.trainer.app", "from services.dispatcher.api import repo", "a service imports another"),
        ("services.trainer.app", "from services import dispatcher", "a service imports another"),
        ("services.trainer.app", "from ..dispatcher import app", "a service imports another"),
        (
            "temper.settings",
            "from temper.db import Database",
            "the core layer imports the infrastructure layer",
        ),
        (
            "temper.limits",
            "from temper.sandbox.models import Action",
            "the core layer imports the domains layer",
        ),
        (
            "temper.events",
            "def f():\n    from temper import cli",
            "the core layer imports the surfaces layer",
        ),
        (
            "temper.storage.s3",
            "from temper.tasks import models",
            "the infrastructure layer imports the domains",
        ),
        (
            "temper.tasks.service",
            "from temper.client import TemperClient",
            "the domains layer imports the surfaces",
        ),
        ("temper.sandbox.manager", "from ..cli import main", "the domains layer imports the surfaces layer"),
        ("temper.newroom", "import temper.db", "a room in no layer"),
    ],
)
def test_a_broken_contract_is_found(module: str, source: str, broken: str) -> None:
    found = violations(imports_of(source, module))
    assert any(broken in line for line in found), found


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("temper.training.learner", "def f():\n    import torch"),  # lazy heavy imports stay allowed
        ("services.embedded.components", "from services.trainer.component import Trainer"),
        ("services.cli", "from services.embedded import runner"),
        ("services.trainer.app", "from services.trainer.component import Trainer"),
        ("services.trainer.app", "from . import component"),
        ("temper.rewards.scorer", "from temper.sandbox import SandboxManager"),
        ("temper.settings", "from temper.limits import SandboxLimits"),
        ("temper.cli.jobs", "from temper.lifecycle import JOB_TERMINAL"),
        ("temper.tasks.inprocess", "from temper.runtime import Runtime"),
        ("temper.db.models", "import temper.runtime"),  # the same layer
    ],
)
def test_an_allowed_import_passes(module: str, source: str) -> None:
    assert violations(imports_of(source, module)) == []


# --- no import cycle inside a service ----------------------------------------------------------
def _resolve(target: str, known: set[str]) -> str | None:
    """The module ``target`` names: itself, or for ``from a.b import Name`` the module ``a.b``."""
    while target:
        if target in known:
            return target
        target = target.rpartition(".")[0]
    return None


def service_cycles(imports: list[Import], known: set[str]) -> list[str]:
    """Each import cycle between modules of one service (every import counts: under
    ``TYPE_CHECKING``, inside a function, of a package's ``__init__``), as its modules in
    order with the line of each import, e.g. ``a:3 -> b:7 -> a``."""
    edges: dict[str, dict[str, int]] = {}
    for imp in imports:
        target = _resolve(imp.target, known)
        service = _service_of(imp.module)
        if target is None or target == imp.module or service is None or _service_of(target) != service:
            continue
        edges.setdefault(imp.module, {}).setdefault(target, imp.line)
    # Tarjan's strongly connected components: a component of two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    out = []
    for component in sorted(components):
        members = set(component)
        # one cycle through the component's first module, for the message
        path, node = [component[0]], component[0]
        seen = {node}
        while True:
            nxt = next(
                n for n in sorted(edges[node]) if n in members and (n == component[0] or n not in seen)
            )
            path.append(f"{node}:{edges[node][nxt]}")
            if nxt == component[0]:
                break
            seen.add(nxt)
            node = nxt
        out.append(
            " -> ".join([*path[1:], component[0]]) + f" (modules in the cycle: {', '.join(component)})"
        )
    return out


def test_no_service_imports_its_own_files_in_a_cycle() -> None:
    modules = _modules()
    known = {m for m, _, _ in modules}
    imports = [
        imp
        for m, path, pkg in modules
        if m.startswith("services.")
        for imp in imports_of(path.read_text(), m, is_package=pkg)
    ]
    assert service_cycles(imports, known) == []


def test_an_import_cycle_inside_a_service_is_found() -> None:
    known = {"services.x.component", "services.x.handlers", "services.x.domain", "services.y.app"}
    planted = imports_of(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.x.component import C\n",
        "services.x.handlers",
    ) + imports_of("from services.x import handlers\n", "services.x.component")
    assert service_cycles(planted, known) == [
        "services.x.component:1 -> services.x.handlers:3 -> services.x.component "
        "(modules in the cycle: services.x.component, services.x.handlers)"
    ]
    lazy = imports_of("def f():\n    from .component import C\n", "services.x.domain") + imports_of(
        "from services.x.domain import D\n", "services.x.component"
    )
    assert len(service_cycles(lazy, known)) == 1, "a lazy import inside a function counts"
    one_way = imports_of("from services.x.domain import D\n", "services.x.component") + imports_of(
        "import services.x.domain\n", "services.y.app"
    )
    assert service_cycles(one_way, known) == []
