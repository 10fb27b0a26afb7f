"""A small client of MLflow's REST API (``/api/2.0/mlflow/...``) over httpx: the calls the
tracker makes, and the reads its tests make. Temper's own environment has no mlflow
package; the server runs from its own (scripts/stack/mlflow/install.sh).

A server that cannot be reached, or answers 5xx or 429, raises :class:`TrackingUnavailable`
(a ``ConnectionError``, so the bus retries the record with backoff for as long as the outage
lasts and never dead-letters it); any other refusal raises :class:`TrackingRefused`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from temper.tracking.model import TrackedJob, Update

API = "/api/2.0/mlflow"
# log-batch limits of the server (MLflow's REST API docs): per request
MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
MAX_PARAM_VALUE = 6000


class TrackingUnavailable(ConnectionError):
    """The tracking server did not answer, or answered that it cannot now (5xx, 429)."""


class TrackingRefused(RuntimeError):
    """The tracking server refused the request (4xx): the request's fault, not an outage."""

    def __init__(self, status: int, code: str, text: str) -> None:
        self.status, self.code = status, code
        super().__init__(f"MLflow answered {status} {code}: {text[:300]}")


class MlflowClient:
    """One tracking server; ``uri`` is its base URL (``http://host:port``)."""

    def __init__(self, uri: str, *, timeout_s: float = 10.0, client: httpx.AsyncClient | None = None) -> None:
        self.uri = uri.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._own = client is None

    async def aclose(self) -> None:
        if self._own:
            await self._client.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"{self.uri}{API}/{path}"
        try:
            if method == "GET":
                response = await self._client.get(url, params=body)
            else:
                response = await self._client.post(url, json=body or {})
        except httpx.TransportError as exc:
            raise TrackingUnavailable(f"MLflow at {self.uri} cannot be reached: {exc!r}") from exc
        if response.status_code >= 500 or response.status_code == 429:
            raise TrackingUnavailable(f"MLflow at {self.uri} answered {response.status_code}")
        if response.status_code >= 400:
            try:
                code = str(response.json().get("error_code", ""))
            except ValueError:
                code = ""
            raise TrackingRefused(response.status_code, code, response.text)
        return response.json() if response.content else {}

    # --- experiments and runs ---------------------------------------------------------------

    async def experiment_id(self, name: str) -> str:
        """The experiment's id, created when missing (a concurrent create is fine)."""
        for _ in range(2):
            try:
                found = await self._call("GET", "experiments/get-by-name", {"experiment_name": name})
                return str(found["experiment"]["experiment_id"])
            except TrackingRefused as exc:
                if exc.code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            try:
                made = await self._call("POST", "experiments/create", {"name": name})
                return str(made["experiment_id"])
            except TrackingRefused as exc:
                if exc.code != "RESOURCE_ALREADY_EXISTS":
                    raise
        raise TrackingRefused(
            409, "RESOURCE_ALREADY_EXISTS", f"experiment {name!r} neither found nor created"
        )

    async def find_run(self, experiment_id: str, tag: str, value: str) -> str | None:
        """The id of the newest run of the experiment whose tag ``tag`` is ``value``."""
        quoted = value.replace("'", "\\'")
        found = await self._call(
            "POST",
            "runs/search",
            {
                "experiment_ids": [experiment_id],
                "filter": f"tags.`{tag}` = '{quoted}'",
                "max_results": 1,
                "order_by": ["attributes.start_time DESC"],
            },
        )
        runs = found.get("runs") or []
        return str(runs[0]["info"]["run_id"]) if runs else None

    async def create_run(self, experiment_id: str, *, name: str, start_ms: int, tags: dict[str, str]) -> str:
        made = await self._call(
            "POST",
            "runs/create",
            {
                "experiment_id": experiment_id,
                "run_name": name,
                "start_time": start_ms,
                "tags": [{"key": k, "value": v} for k, v in tags.items()],
            },
        )
        return str(made["run"]["info"]["run_id"])

    async def log_batch(
        self,
        run_id: str,
        *,
        metrics: Sequence[tuple[str, float, int, int]] = (),
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Log ``metrics`` (key, value, timestamp ms, step), ``params`` and ``tags``, in as many
        requests as the server's limits need. Logging the same metric point again, or a param
        with the value it has, changes nothing (so a redelivered event is harmless)."""
        metric_rows = [{"key": k, "value": v, "timestamp": t, "step": s} for k, v, t, s in metrics]
        param_rows = [{"key": k, "value": v[:MAX_PARAM_VALUE]} for k, v in (params or {}).items()]
        tag_rows = [{"key": k, "value": v} for k, v in (tags or {}).items()]
        while metric_rows or param_rows or tag_rows:
            body = {
                "run_id": run_id,
                "metrics": metric_rows[:MAX_METRICS],
                "params": param_rows[:MAX_PARAMS],
                "tags": tag_rows[:MAX_TAGS],
            }
            await self._call("POST", "runs/log-batch", body)
            metric_rows = metric_rows[MAX_METRICS:]
            param_rows = param_rows[MAX_PARAMS:]
            tag_rows = tag_rows[MAX_TAGS:]

    async def set_tag(self, run_id: str, key: str, value: str) -> None:
        await self._call("POST", "runs/set-tag", {"run_id": run_id, "key": key, "value": value})

    async def update_run(self, run_id: str, *, status: str, end_ms: int | None = None) -> None:
        """``status``: RUNNING, FINISHED, FAILED or KILLED."""
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if end_ms is not None:
            body["end_time"] = end_ms
        await self._call("POST", "runs/update", body)

    # --- reads (tests, operators) -----------------------------------------------------------

    async def get_run(self, run_id: str) -> dict[str, Any]:
        found = await self._call("GET", "runs/get", {"run_id": run_id})
        return dict(found["run"])

    async def metric_history(self, run_id: str, key: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            query: dict[str, Any] = {"run_id": run_id, "metric_key": key, "max_results": 25000}
            if token:
                query["page_token"] = token
            page = await self._call("GET", "metrics/get-history", query)
            out.extend(page.get("metrics") or [])
            token = page.get("next_page_token")
            if not token:
                return out


# --- a job's run ------------------------------------------------------------------------------

JOB_TAG = "temper.job_id"
# job state -> run status; a paused job's run stays RUNNING
RUN_STATUS = {"pending": "RUNNING", "running": "RUNNING", "completed": "FINISHED", "failed": "FAILED",
              "cancelled": "KILLED"}  # fmt: skip


class MlflowRuns:
    """One MLflow run per job, found again by its ``temper.job_id`` tag: a restarted tracker
    or a resumed job keeps writing to the run it had, and the server, not Temper, holds the
    mapping. ``clients`` are kept per server URI."""

    def __init__(self) -> None:
        self._clients: dict[str, MlflowClient] = {}
        self._runs: dict[tuple[str, str, str], str] = {}  # (uri, experiment, job id) -> run id

    def client(self, uri: str) -> MlflowClient:
        if uri not in self._clients:
            self._clients[uri] = MlflowClient(uri)
        return self._clients[uri]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    async def run_id(
        self, uri: str, experiment: str, *, job_id: str, name: str, start_ms: int, tags: dict[str, str],
        params: dict[str, str],
    ) -> str:  # fmt: skip
        """The job's run, created (with ``tags`` and ``params``) when the server has none."""
        key = (uri, experiment, job_id)
        if key in self._runs:
            return self._runs[key]
        client = self.client(uri)
        experiment_id = await client.experiment_id(experiment)
        run_id = await client.find_run(experiment_id, JOB_TAG, job_id)
        if run_id is None:
            run_id = await client.create_run(
                experiment_id, name=name, start_ms=start_ms, tags={**tags, JOB_TAG: job_id}
            )
        # again on every first sight: a tracker that died between create and this line
        # left a run without them; logging equal values again changes nothing
        await client.log_batch(run_id, params=params, tags=tags)
        self._runs[key] = run_id
        return run_id


class MlflowSink:
    """The :class:`temper.tracking.model.Sink` of ``tracking.mlflow``: the job's one run
    (:class:`MlflowRuns`), its points in log-batch requests, its status from the job's state,
    its tags last (a reader that sees ``temper.state`` sees the points and status before it)."""

    def __init__(self, runs: MlflowRuns | None = None) -> None:
        self.runs = runs or MlflowRuns()

    def wants(self, job: TrackedJob) -> bool:
        return job.tracking.mlflow is not None

    async def aclose(self) -> None:
        await self.runs.aclose()

    async def log(self, job: TrackedJob, update: Update) -> None:
        spec = job.tracking.mlflow
        assert spec is not None
        run_id = await self.runs.run_id(
            spec.uri, spec.experiment, job_id=job.id, name=job.name, start_ms=update.at_ms, tags=job.tags,
            params=job.params,
        )  # fmt: skip
        client = self.runs.client(spec.uri)
        if update.points:
            await client.log_batch(run_id, metrics=update.points)
        status = RUN_STATUS.get(update.state) if update.state is not None else None
        if status is not None:
            end = update.at_ms if status != "RUNNING" else None
            await client.update_run(run_id, status=status, end_ms=end)
        if update.tags:
            await client.log_batch(run_id, tags=update.tags)
