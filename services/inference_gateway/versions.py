"""Which version of which job each backend serves: the gateway's one owner of that fact.

Every backend reports what it holds through its declared :meth:`Backend.served` (its base
model, the job whose full weights replaced the base, the jobs' LoRA adapters); the table
records each report, and nothing else in the gateway keeps a version. Routing, the tag
of every result, the load of a new version, restart recovery and the filtering of
``policy.updates`` all read it:

- a job is served by a backend that holds its full weights, else by every backend of its
  pool whose base is the model the job starts from (``policy.init``, else
  ``policy.model``) and that no job's full weights hold: there its version is its
  adapter's, or 0 (the base) without one;
- the version a job *confirmed* is the lowest over the backends that serve it, and None
  when none does: a job's request is sent only to a backend that serves it, and is tagged
  with what that backend says it ran, so it never carries another job's version.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.inference_gateway.backends import Backend, Served, adapter_name
from temper.policy.placement import origin_names
from temper.settings.inference import BackendSpec


@dataclass(frozen=True)
class JobModel:
    """What a job is served with: the model it starts from and the pool of backends."""

    base: str
    pool: str = "default"


@dataclass(frozen=True)
class Serving:
    """How one backend serves one job now: the version, and the adapter to name (vLLM)."""

    version: int
    adapter: str | None = None


@dataclass
class Holding:
    """One backend's last report. ``names``: the model names its base weights answer to
    (at its origin also the names the gateway's settings give it). ``known`` is false
    until it first reported, and after a report it could not give (it is then not routed
    to)."""

    spec: BackendSpec
    names: frozenset[str] = frozenset()
    at_origin: bool = True
    owner: str | None = None
    version: int = 0
    adapters: dict[str, int] = field(default_factory=dict)
    known: bool = False


def pool_of(spec: BackendSpec) -> str:
    return spec.pool


class ServedVersions:
    def __init__(self, backends: Iterable[Backend], *, model_name: str) -> None:
        self.model_name = model_name
        self.holdings: dict[str, Holding] = {b.name: Holding(spec=b.spec) for b in backends}

    # --- recording what backends say -------------------------------------------------------
    def record(self, backend: str, served: Served | None) -> None:
        """Record a backend's report (``None``: it could not say; it is not routed to)."""
        h = self.holdings[backend]
        if served is None:
            h.known = False
            return
        names = {served.base} if served.base else set()
        if served.at_origin:
            names |= origin_names(h.spec, self.model_name)
        h.names = frozenset(names)
        h.at_origin = served.at_origin
        h.owner = served.owner
        h.version = served.version if served.owner is not None else 0
        h.adapters = dict(served.adapters)
        h.known = True

    # --- reading ----------------------------------------------------------------------------
    def in_pool(self, pool: str) -> list[str]:
        return [name for name, h in self.holdings.items() if pool_of(h.spec) == pool]

    def serving(self, backend: str, job: str | None, model: JobModel | None) -> Serving | None:
        """How ``backend`` serves ``job`` now, or None when it does not."""
        h = self.holdings[backend]
        key = job or ""
        if not h.known:
            return None
        if h.owner is not None:
            return Serving(h.version) if h.owner == key else None
        if model is not None and model.base not in h.names:
            return None
        v = h.adapters.get(key)
        return Serving(v, adapter_name(key, v)) if v is not None else Serving(0)

    def routes(self, job: str | None, model: JobModel | None) -> dict[str, Serving]:
        """The backends that serve ``job`` now and how. A job that holds a backend with its
        full weights is served there only (its base elsewhere is a version it has left)."""
        owned = self.owned_by(job or "")
        names = owned or (self.in_pool(model.pool) if model is not None else list(self.holdings))
        out = {}
        for name in names:
            serving = self.serving(name, job, model)
            if serving is not None:
                out[name] = serving
        return out

    def confirmed(self, job: str | None, model: JobModel | None) -> int | None:
        """The version every backend that serves ``job`` confirmed (the lowest), or None."""
        routes = self.routes(job, model)
        return min(s.version for s in routes.values()) if routes else None

    def owned_by(self, job: str) -> list[str]:
        return [name for name, h in self.holdings.items() if h.known and h.owner == job]

    def holders_of(self, job: str) -> list[str]:
        """Backends with something of ``job`` on them: its full weights or its adapter."""
        return [n for n, h in self.holdings.items() if h.owner == job or job in h.adapters]

    def jobs(self) -> set[str]:
        """Every job something is loaded for."""
        out: set[str] = set()
        for h in self.holdings.values():
            if h.owner is not None:
                out.add(h.owner)
            out.update(h.adapters)
        return out

    def free(self, pool: str) -> list[str]:
        """Backends of ``pool`` that no job holds and that carry no adapter."""
        return [
            n
            for n in self.in_pool(pool)
            if (h := self.holdings[n]).known and h.owner is None and not h.adapters
        ]

    def describe(self, pool: str) -> str:
        """What the backends of ``pool`` hold, for a reason a request or a load waits with."""
        parts = []
        for name in self.in_pool(pool):
            h = self.holdings[name]
            if not h.known:
                parts.append(f"{name}: not reporting")
            elif h.owner is not None:
                parts.append(f"{name}: job {h.owner!r}'s full weights (v{h.version})")
            else:
                base = ", ".join(sorted(h.names)) or "?"
                adapters = f" with adapters of {', '.join(sorted(h.adapters))}" if h.adapters else ""
                parts.append(f"{name}: {base}{adapters}")
        return "; ".join(parts) or f"no backend in pool {pool!r}"

    def snapshot(self) -> dict[str, dict[str, object]]:
        return {
            name: {
                "names": sorted(h.names),
                "at_origin": h.at_origin,
                "owner": h.owner,
                "version": h.version,
                "adapters": dict(h.adapters),
                "known": h.known,
            }
            for name, h in self.holdings.items()
        }
