"""A small client for the dispatcher's REST API.

    from temper.client import TemperClient
    with TemperClient("http://127.0.0.1:8000", key) as api:
        job = api.submit("spec.yaml")
        print(api.metrics(job["id"])["progress"])

URL and key default to ``TEMPER_URL`` and ``TEMPER_API_KEY``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, NoReturn

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class ApiError(RuntimeError):
    """A non-2xx answer; ``errors`` lists (field, message) for an invalid spec."""

    def __init__(self, status: int, detail: str, errors: list[tuple[str, str]] | None = None) -> None:
        self.status = status
        self.detail = detail
        self.errors = errors or []
        super().__init__(f"{status}: {detail}")


class TemperClient:
    def __init__(
        self,
        url: str | None = None,
        key: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = (url or os.environ.get("TEMPER_URL") or DEFAULT_URL).rstrip("/")
        key = key or os.environ.get("TEMPER_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def __enter__(self) -> TemperClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach the dispatcher at {self.url}: {exc}") from None
        if not response.is_success:
            self._raise(response)
        return response

    def _raw(self, method: str, path: str, **kwargs: Any) -> bytes:
        return self._request(method, path, **kwargs).content

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        if response.status_code == 204 or not response.content:
            return None
        return response.json()

    def _raise(self, response: httpx.Response) -> NoReturn:
        try:
            body = response.json()
        except ValueError:
            body = {"detail": response.text[:500] or response.reason_phrase}
        detail = body.get("detail") if isinstance(body, dict) else str(body)
        if not isinstance(detail, str):  # FastAPI's own validation errors
            detail = "; ".join(
                f"{'.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail or []
            )
        errors = (
            [(e["field"], e["message"]) for e in body.get("errors", [])] if isinstance(body, dict) else []
        )
        raise ApiError(response.status_code, detail, errors)

    # --- environment packages ---------------------------------------------------------------

    def push_environment(self, archive: bytes) -> dict[str, Any]:
        """Upload a package (a tar.gz with environment.yaml at its top)."""
        return self._call(  # type: ignore[no-any-return]
            "POST", "/v1/environments", content=archive, headers={"Content-Type": "application/gzip"}
        )

    def environments(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/environments")  # type: ignore[no-any-return]

    def environment(self, name: str, version: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/environments/{name}/{version}")  # type: ignore[no-any-return]

    # --- jobs ---------------------------------------------------------------------------

    def submit(self, spec: dict[str, Any] | str | Path) -> dict[str, Any]:
        """Submit a spec: a mapping, a path to a YAML/JSON file, or YAML/JSON text."""
        if isinstance(spec, dict):
            return self._call("POST", "/v1/jobs", json=spec)  # type: ignore[no-any-return]
        text = Path(spec).read_text() if isinstance(spec, Path) or _is_file(spec) else spec
        return self._call(  # type: ignore[no-any-return]
            "POST", "/v1/jobs", content=text.encode(), headers={"Content-Type": "application/yaml"}
        )

    def jobs(
        self,
        *,
        state: str | None = None,
        name: str | None = None,
        tag: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        given = {"state": state, "name": name, "tag": tag, "limit": limit, "cursor": cursor}
        params = {k: v for k, v in given.items() if v}
        return self._call("GET", "/v1/jobs", params=params)  # type: ignore[no-any-return]

    def update_job(self, job: str, **change: Any) -> dict[str, Any]:
        """Replace a job's ``tags`` and/or ``note`` (``note=None`` clears it)."""
        return self._call("PATCH", f"/v1/jobs/{job}", json=change)  # type: ignore[no-any-return]

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")  # type: ignore[no-any-return]

    def rerun(self, job: str, *, handle: str | None = None, name: str | None = None) -> dict[str, Any]:
        """Submit ``job``'s resolved spec again as a new job (with ``handle``/``name`` if given)."""
        change = {k: v for k, v in {"handle": handle, "name": name}.items() if v is not None}
        return self._call("POST", f"/v1/jobs/{job}/rerun", json=change)  # type: ignore[no-any-return]

    def pause(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/pause")  # type: ignore[no-any-return]

    def resume(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/resume")  # type: ignore[no-any-return]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")  # type: ignore[no-any-return]

    def metrics(self, job_id: str, *, pass_threshold: float | None = None) -> dict[str, Any]:
        params = {"pass_threshold": pass_threshold} if pass_threshold is not None else {}
        return self._call("GET", f"/v1/jobs/{job_id}/metrics", params=params)  # type: ignore[no-any-return]

    # --- episodes -----------------------------------------------------------------------

    def episodes(self, job_id: str, **filters: Any) -> dict[str, Any]:
        """``state``, ``task``, ``iteration``, ``min_reward``, ``max_reward``, ``limit``, ``cursor``."""
        params = {k: v for k, v in filters.items() if v is not None}
        return self._call("GET", f"/v1/jobs/{job_id}/episodes", params=params)  # type: ignore[no-any-return]

    def episode(self, episode_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/episodes/{episode_id}")  # type: ignore[no-any-return]

    def transcript(self, episode_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/episodes/{episode_id}/transcript")  # type: ignore[no-any-return]

    def trajectory(self, episode_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/episodes/{episode_id}/trajectory")  # type: ignore[no-any-return]

    def job_log(self, job: str, *, tail: int = 100, after: str | None = None) -> bytes:
        """The last ``tail`` log lines of the job (JSON lines), later than ``after`` (a ``ts``)."""
        params: dict[str, Any] = {"tail": tail, **({"after": after} if after else {})}
        return self._raw("GET", f"/v1/jobs/{job}/log", params=params)

    def episode_log(self, episode_id: str) -> bytes:
        """The episode's stored log (JSON lines)."""
        return self._raw("GET", f"/v1/episodes/{episode_id}/log")

    # --- results ------------------------------------------------------------------------

    def export(
        self,
        job_id: str,
        out: Path,
        *,
        format: str = "jsonl",
        after: str | None = None,
        limit: int | None = None,
    ) -> str | None:
        """Write the job's trajectories to ``out`` as they stream in; returns the next
        page's ``after`` (None: nothing more)."""
        params: dict[str, Any] = {"format": format}
        if after:
            params["after"] = after
        if limit:
            params["limit"] = limit
        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/trajectories", params=params) as response:
                if not response.is_success:
                    response.read()
                    self._raise(response)
                with out.open("wb") as f:
                    for chunk in response.iter_bytes():
                        f.write(chunk)
                return response.headers.get("X-Next-After")
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach the dispatcher at {self.url}: {exc}") from None

    def evaluate(self, job: str, **body: Any) -> dict[str, Any]:
        """Evaluate a version of ``job`` (``version=V``) or a model directory (``model=DIR``) as
        a job of its own; the other fields as ``POST /v1/jobs/{id}/evaluations`` takes them."""
        body = {k: v for k, v in body.items() if v is not None}
        return self._call("POST", f"/v1/jobs/{job}/evaluations", json=body)  # type: ignore[no-any-return]

    def evaluations(self, job: str, *, tasks: bool = False) -> list[dict[str, Any]]:
        params = {"tasks": "true"} if tasks else {}
        return self._call("GET", f"/v1/jobs/{job}/evaluations", params=params)  # type: ignore[no-any-return]

    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._call("GET", f"/v1/jobs/{job_id}/checkpoints")  # type: ignore[no-any-return]

    def download_version(
        self, job_id: str, version: int, dest: Path, *, with_base: bool = False
    ) -> dict[str, Any]:
        """Download policy ``version`` into the directory ``dest`` (new or empty): a Hugging
        Face model directory (full weights) or a PEFT adapter directory (LoRA; with
        ``with_base``, its base model in ``dest/base``), each file checked against the
        version's manifest. Returns ``{"kind", "base_model", "files"}``. A version published
        before the registry (one safetensors file) is written to ``dest`` as that file."""
        from temper import registry

        params = {"with_base": "true"} if with_base else {}
        path = f"/v1/jobs/{job_id}/checkpoints/{version}"
        dest = Path(dest)
        try:
            with self.http.stream("GET", path, params=params) as response:
                if not response.is_success:
                    response.read()
                    self._raise(response)
                if response.headers.get("content-type", "").startswith("application/octet-stream"):
                    with dest.open("wb") as f:
                        for chunk in response.iter_bytes():
                            f.write(chunk)
                    return {"kind": "safetensors", "base_model": None, "files": [dest.name]}
                dest.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".download-", suffix=".tar") as tmp:
                    for chunk in response.iter_bytes():
                        tmp.write(chunk)
                    tmp.flush()
                    manifest = registry.extract_archive(tmp.name, dest)
        except httpx.TransportError as exc:
            raise ApiError(0, f"cannot reach the dispatcher at {self.url}: {exc}") from None
        return {"kind": manifest.kind, "base_model": manifest.base_model, "files": manifest.served_files()}

    # --- tenant -------------------------------------------------------------------------

    def tenant(self) -> dict[str, Any]:
        return self._call("GET", "/v1/tenant")  # type: ignore[no-any-return]

    def create_key(self, name: str = "") -> dict[str, Any]:
        return self._call("POST", "/v1/keys", json={"name": name})  # type: ignore[no-any-return]

    def create_tenant(
        self,
        name: str,
        *,
        tenant_id: str | None = None,
        max_concurrent_episodes: int = 64,
        admin: bool = False,
        weight: float = 1.0,
        quota_sandbox_cpu_s: float | None = None,
        quota_inference_tokens: int | None = None,
        quota_sandbox_memory_gb_s: float | None = None,
        quota_trainer_s: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": name,
            "max_concurrent_episodes": max_concurrent_episodes,
            "admin": admin,
            "weight": weight,
            "quota_sandbox_cpu_s": quota_sandbox_cpu_s,
            "quota_inference_tokens": quota_inference_tokens,
            "quota_sandbox_memory_gb_s": quota_sandbox_memory_gb_s,
            "quota_trainer_s": quota_trainer_s,
        }
        if tenant_id:
            body["id"] = tenant_id
        return self._call("POST", "/v1/tenants", json=body)  # type: ignore[no-any-return]

    def get_tenant(self, tenant_id: str) -> dict[str, Any]:
        """A tenant's weight, quotas and usage (admin key)."""
        return self._call("GET", f"/v1/tenants/{tenant_id}")  # type: ignore[no-any-return]

    def update_tenant(self, tenant_id: str, **fields: Any) -> dict[str, Any]:
        """Set ``name``, ``max_concurrent_episodes``, ``weight`` or a quota (None lifts it)."""
        return self._call("PATCH", f"/v1/tenants/{tenant_id}", json=fields)  # type: ignore[no-any-return]


def _is_file(text: str) -> bool:
    if "\n" in text or len(text) > 4096:
        return False
    try:
        return Path(text).is_file()
    except OSError:
        return False
