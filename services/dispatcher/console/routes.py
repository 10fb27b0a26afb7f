"""``/console``: jobs list, job page (reward curve, pass rates, throughput, staleness,
live progress) and episode page (full transcript).

Login: the user pastes an API key once; it is kept in an HttpOnly, SameSite=Strict
cookie scoped to ``/console`` and checked on every page exactly like a Bearer key.
Forms that change state also check the Origin header.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, FastAPI, Form, HTTPException, Query, Request, status
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from services.dispatcher import evaluation_views
from services.dispatcher.api import repo
from services.dispatcher.api.deps import SessionDep, StoreDep
from services.dispatcher.api.transcripts import stored_log, transcript
from services.dispatcher.console.charts import (
    PALETTE,
    eval_curve_svg,
    reward_curve_svg,
    reward_curves_svg,
    training_charts,
)
from temper.jobspec import reward_weights
from temper.lifecycle import JOB_TERMINAL, IllegalTransition
from temper.tenants import Caller, authenticate

HERE = Path(__file__).parent
COOKIE = "temper_key"
PREFIX = "/console"
REFRESH_S = 3

EPISODES_PER_PAGE = 100


def iteration_shown(iteration: int, iterations: int) -> int:
    """The iteration as people count it: the first is 1, a finished 8-iteration job is at 8."""
    return min(iteration + 1, iterations) if iterations else iteration + 1


def turns_taken(episode: Any) -> int:
    """Turns an episode has started: none while pending, else its 0-based turn index + 1."""
    return 0 if episode.state == "pending" else episode.turn + 1


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


templates = Jinja2Templates(directory=str(HERE / "templates"))
templates.env.globals.update(
    prefix=PREFIX, iteration_shown=iteration_shown, turns_taken=turns_taken, plural=plural
)
router = APIRouter(prefix=PREFIX, include_in_schema=False)


class LoginRequired(Exception):
    def __init__(self, next_path: str) -> None:
        self.next_path = next_path


class PageError(Exception):
    """A console page that cannot be shown: answered as a console page, not JSON."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.message = message


async def console_caller(request: Request, session: SessionDep) -> Caller:
    key = request.cookies.get(COOKIE, "")
    caller = await authenticate(session, key) if key else None
    if caller is None:
        raise LoginRequired(request.url.path)
    return caller


ConsoleCaller = Annotated[Caller, Depends(console_caller)]


def same_origin(request: Request) -> None:
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin form")


def _safe_next(path: str | None) -> str:
    return path if path and path.startswith(PREFIX + "/") and not path.startswith("//") else PREFIX + "/"


def page(request: Request, template: str, code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, template, context, status_code=code)


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> HTMLResponse:
    return page(request, "login.html", next=_safe_next(next), error=None)


@router.post("/login")
async def login(
    request: Request,
    session: SessionDep,
    key: Annotated[str, Form()],
    next: Annotated[str, Form()] = PREFIX + "/",
) -> Response:
    same_origin(request)
    caller = await authenticate(session, key.strip())
    if caller is None:
        return page(
            request, "login.html", code=401, next=_safe_next(next), error="That API key is not valid."
        )
    response = RedirectResponse(_safe_next(next), status_code=status.HTTP_303_SEE_OTHER)
    response.set_cookie(
        COOKIE,
        key.strip(),
        httponly=True,
        samesite="strict",
        path=PREFIX,
        secure=request.url.scheme == "https",
        max_age=7 * 24 * 3600,
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    same_origin(request)
    response = RedirectResponse(PREFIX + "/login", status_code=status.HTTP_303_SEE_OTHER)
    response.delete_cookie(COOKIE, path=PREFIX)
    return response


@router.get("/")
async def jobs_page(
    request: Request,
    session: SessionDep,
    caller: ConsoleCaller,
    state: str | None = None,
    name: str | None = None,
    cursor: str | None = None,
) -> HTMLResponse:
    try:
        result = await repo.list_jobs(
            session,
            tenant_id=caller.tenant.id,
            state=state or None,
            name=name or None,
            limit=50,
            cursor=cursor,
        )
    except repo.BadCursor:
        result = await repo.list_jobs(session, tenant_id=caller.tenant.id, limit=50)
    jobs = [repo.job_summary(j) for j in result.rows]
    return page(
        request,
        "jobs.html",
        caller=caller,
        jobs=jobs,
        next_cursor=result.next_cursor,
        total=result.total,
        state=state or "",
        name=name or "",
    )


async def _job(session: SessionDep, caller: Caller, job_id: str) -> Any:
    job = await repo.get_job(session, tenant_id=caller.tenant.id, job_id=job_id)
    if job is None:
        raise PageError(status.HTTP_404_NOT_FOUND, f"There is no job {job_id} in this tenant.")
    return job


async def _live_context(session: SessionDep, job: Any) -> dict[str, Any]:
    metrics = await repo.job_metrics(session, job=job)
    return {
        "job": repo.job_summary(job),
        "m": metrics,
        "chart": reward_curve_svg(metrics.reward_curve),
        "eval_chart": eval_curve_svg(metrics.evaluations) if metrics.evaluations else None,
        "eval_tasks": await _latest_eval_tasks(session, metrics.evaluations),
        "eval_ks": sorted({k for p in metrics.evaluations for k in p.pass_at}, key=int),
        "training_charts": training_charts(metrics.training.versions),
        "live": job.state not in JOB_TERMINAL,
        "refresh_s": REFRESH_S,
    }


async def _latest_eval_tasks(session: SessionDep, points: list[Any]) -> dict[str, Any] | None:
    """The newest finished evaluation of a version (by version), with its per-task results."""
    done = [p for p in points if p.state == "completed" and p.version is not None]
    if not done:
        return None
    latest = max(done, key=lambda p: (p.version, p.created_at))
    tasks = (await evaluation_views.task_rows(session, [latest.evaluation_job_id])).get(
        latest.evaluation_job_id, []
    )
    return {"point": latest, "tasks": tasks, "ks": sorted({k for t in tasks for k in t["pass_at"]}, key=int)}


@router.get("/jobs/{job_id}")
async def job_page(
    request: Request,
    session: SessionDep,
    caller: ConsoleCaller,
    job_id: str,
    state: Annotated[str | None, Query()] = None,
    task: Annotated[str | None, Query()] = None,
    cursor: Annotated[str | None, Query()] = None,
    per_page: Annotated[int | None, Query(ge=1, le=500)] = None,
) -> HTMLResponse:
    job = await _job(session, caller, job_id)
    limit = per_page or EPISODES_PER_PAGE

    async def episodes_page(cursor: str | None) -> repo.Page:
        return await repo.list_episodes(
            session, job=job, state=state or None, task=task or None, limit=limit, cursor=cursor
        )

    try:
        episodes = await episodes_page(cursor or None)
    except repo.BadCursor:
        cursor, episodes = None, await episodes_page(None)
    return page(
        request,
        "job.html",
        caller=caller,
        spec=job.spec,
        provenance=job.provenance,
        episodes=episodes.rows,
        episodes_total=episodes.total,
        next_cursor=episodes.next_cursor,
        paged=bool(cursor),
        per_page=per_page,
        state=state or "",
        task=task or "",
        **await _live_context(session, job),
    )


@router.get("/jobs/{job_id}/live")
async def job_live(request: Request, session: SessionDep, caller: ConsoleCaller, job_id: str) -> HTMLResponse:
    """The job page's live section alone; console.js swaps it in every few seconds."""
    job = await _job(session, caller, job_id)
    return page(request, "_live.html", **await _live_context(session, job))


@router.post("/jobs/{job_id}/{command}")
async def job_command(
    request: Request, session: SessionDep, caller: ConsoleCaller, job_id: str, command: str
) -> Response:
    same_origin(request)
    if command not in repo.JOB_COMMANDS:
        raise PageError(status.HTTP_404_NOT_FOUND, f"A job has no command {command!r}.")
    job = await _job(session, caller, job_id)
    try:
        await repo.command_job(session, job=job, command=command, reason=f"{command} from the console")
        await session.commit()
    except IllegalTransition:
        raise PageError(status.HTTP_409_CONFLICT, f"Cannot {command} a job that is {job.state}.") from None
    return RedirectResponse(f"{PREFIX}/jobs/{quote(job_id)}", status_code=status.HTTP_303_SEE_OTHER)


@router.get("/episodes/{episode_id}")
async def episode_page(
    request: Request, session: SessionDep, store: StoreDep, caller: ConsoleCaller, episode_id: str
) -> HTMLResponse:
    episode = await repo.get_episode(session, tenant_id=caller.tenant.id, episode_id=episode_id)
    if episode is None:
        raise PageError(status.HTTP_404_NOT_FOUND, f"There is no episode {episode_id} in this tenant.")
    t = await transcript(session, store, episode)
    job = await repo.get_job(session, tenant_id=caller.tenant.id, job_id=episode.job_id)
    weights = reward_weights((job.spec or {}).get("rewards") or {}) if job is not None else {}
    return page(
        request, "episode.html", caller=caller, t=t, ep=t.episode, components=reward_rows(t.rewards, weights)
    )


def reward_rows(rewards: dict[str, Any], weights: dict[str, float]) -> list[dict[str, Any]]:
    """One row per reward component: its value, its weight in the job's reward (None when
    it is reported but not weighted) and its weighted contribution; weighted ones first."""
    rows = []
    for name, c in rewards.items():
        if isinstance(c, dict):
            value, ok, reason, details = c.get("value"), c.get("ok", True), c.get("reason"), c.get("details")
        else:
            value, ok, reason, details = c, True, None, None
        number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
        weight = weights.get(name)
        rows.append(
            {
                "name": name,
                "value": number,
                "raw": None if number is not None else value,
                "ok": ok,
                "reason": reason,
                "details": details if isinstance(details, dict) else ({"": details} if details else {}),
                "weight": weight,
                "contribution": None if weight is None or number is None else weight * number,
            }
        )
    rows.sort(key=lambda r: (r["weight"] is None, r["name"]))
    return rows


@router.get("/episodes/{episode_id}/log")
async def episode_log(
    session: SessionDep, store: StoreDep, caller: ConsoleCaller, episode_id: str
) -> Response:
    """The episode's stored log (JSON lines), shown as text in the browser."""
    episode = await repo.get_episode(session, tenant_id=caller.tenant.id, episode_id=episode_id)
    data = await stored_log(session, store, episode) if episode is not None else None
    if data is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no log for episode {episode_id}")
    return Response(data, media_type="text/plain; charset=utf-8")


MAX_COMPARED = len(PALETTE)


@router.get("/compare")
async def compare_page(
    request: Request,
    session: SessionDep,
    caller: ConsoleCaller,
    jobs: Annotated[list[str], Query()] = [],  # noqa: B006 - FastAPI copies it
) -> HTMLResponse:
    """Several jobs' reward curves on one chart, and a row of figures per job."""
    if not jobs:
        raise PageError(status.HTTP_400_BAD_REQUEST, "Pick the jobs to compare on the jobs page.")
    if len(set(jobs)) > MAX_COMPARED:
        raise PageError(status.HTTP_400_BAD_REQUEST, f"Compare at most {MAX_COMPARED} jobs at once.")
    rows = []
    for i, job_id in enumerate(dict.fromkeys(jobs)):
        job = await _job(session, caller, job_id)
        curve = (await repo.job_metrics(session, job=job)).reward_curve
        rows.append(
            {
                "job": job,
                "curve": curve,
                "color": PALETTE[i % len(PALETTE)],
                "first": curve[0].mean if curve else None,
                "last": curve[-1].mean if curve else None,
                "best": max((p.mean for p in curve), default=None),
            }
        )
    names = [r["job"].name for r in rows]
    # the legend names jobs as people do; a name two of them share gets the id beside it
    labels = [n if names.count(n) == 1 else f"{n} ({r['job'].id})" for n, r in zip(names, rows, strict=True)]
    for r, label in zip(rows, labels, strict=True):
        r["label"] = label
    chart = reward_curves_svg(
        [(r["job"].id, label, r["curve"]) for label, r in zip(labels, rows, strict=True)]
    )
    return page(request, "compare.html", caller=caller, rows=rows, chart=chart)


@router.get("/{path:path}")
async def missing_page(request: Request, path: str) -> HTMLResponse:
    """Any other console address: a console page saying so (last route: matches everything)."""
    raise PageError(status.HTTP_404_NOT_FOUND, f"There is no console page at {PREFIX}/{path}.")


def mount(app: FastAPI) -> None:
    # the static files first: the router's catch-all page would answer their paths
    app.mount(PREFIX + "/static", StaticFiles(directory=str(HERE / "static")), name="console-static")
    app.include_router(router)

    @app.exception_handler(PageError)
    async def _error_page(request: Request, exc: PageError) -> Response:
        caller = None
        key = request.cookies.get(COOKIE, "")
        if key:
            async with request.app.state.runtime.db.session() as session:
                caller = await authenticate(session, key)
        return page(request, "error.html", code=exc.code, caller=caller, message=exc.message, status=exc.code)

    @app.exception_handler(LoginRequired)
    async def _to_login(request: Request, exc: LoginRequired) -> Response:
        return RedirectResponse(
            f"{PREFIX}/login?next={quote(exc.next_path)}", status_code=status.HTTP_303_SEE_OTHER
        )
