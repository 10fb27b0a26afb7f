"""Episodes: a job's episodes with filters, one episode, its transcript, its raw
trajectory and its log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status

from services.dispatcher.api import repo, schemas
from services.dispatcher.api.auth import bearer_scheme
from services.dispatcher.api.deps import CurrentTenant, SessionDep, StoreDep
from services.dispatcher.api.jobs import AUTH, BAD_CURSOR, MAX_OFFSET, NOT_FOUND, JobDep
from services.dispatcher.api.transcripts import stored_log, transcript
from temper.db import Episode
from temper.lifecycle import EpisodeState

router = APIRouter(tags=["episodes"], dependencies=[Depends(bearer_scheme)])

EPISODE_NOT_FOUND: schemas.Responses = {
    404: {"model": schemas.Problem, "description": "no such episode for this tenant"}
}


@router.get(
    "/v1/jobs/{job_id}/episodes",
    summary="List a job's episodes",
    response_model=schemas.EpisodePage,
    responses={**NOT_FOUND, **BAD_CURSOR, **AUTH},
)
async def list_episodes(
    session: SessionDep,
    job: JobDep,
    state: Annotated[EpisodeState | None, Query(description="only episodes in this state")] = None,
    task: Annotated[
        str | None, Query(description="only episodes of this task: its id, or its key without the task set")
    ] = None,
    iteration: Annotated[int | None, Query(ge=0, le=MAX_OFFSET)] = None,
    min_reward: Annotated[
        float | None, Query(allow_inf_nan=False, description="reward at least this")
    ] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False, description="reward at most this")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(min_length=1, max_length=500)] = None,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> schemas.EpisodePage:
    try:
        page = await repo.list_episodes(
            session,
            job=job,
            state=state.value if state else None,
            task=task,
            iteration=iteration,
            min_reward=min_reward,
            max_reward=max_reward,
            limit=limit,
            cursor=cursor,
            offset=offset,
        )
    except repo.BadCursor as exc:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, str(exc)) from None
    return schemas.EpisodePage(
        items=[repo.episode_out(e) for e in page.rows], next_cursor=page.next_cursor, total=page.total
    )


async def episode_or_404(session: SessionDep, tenant: CurrentTenant, episode_id: str) -> Episode:
    episode = await repo.get_episode(session, tenant_id=tenant.id, episode_id=episode_id)
    if episode is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"episode {episode_id} not found")
    return episode


EpisodeDep = Annotated[Episode, Depends(episode_or_404)]


@router.get(
    "/v1/episodes/{episode_id}",
    summary="Get an episode",
    response_model=schemas.Episode,
    responses={**EPISODE_NOT_FOUND, **AUTH},
)
async def get_episode(episode: EpisodeDep) -> schemas.Episode:
    return repo.episode_out(episode)


@router.get(
    "/v1/episodes/{episode_id}/transcript",
    summary="An episode's transcript",
    description="Each turn's decoded prompt, the model's action, the observation (with exit code and kill "
    "reason), timings and policy version, and the reward vector. Read from the stored trajectory once the "
    "episode is scored, from the recorded steps before.",
    response_model=schemas.Transcript,
    responses={**EPISODE_NOT_FOUND, **AUTH},
)
async def get_transcript(session: SessionDep, store: StoreDep, episode: EpisodeDep) -> schemas.Transcript:
    return await transcript(session, store, episode)


@router.get(
    "/v1/episodes/{episode_id}/trajectory",
    summary="An episode's raw trajectory (JSON)",
    description="The stored trajectory exactly as the trainer reads it: token ids, behaviour logprobs, policy "
    "versions, observations and rewards.",
    response_class=Response,
    responses={200: {"content": {"application/json": {}}}, **EPISODE_NOT_FOUND, **AUTH},
)
async def get_trajectory(store: StoreDep, episode: EpisodeDep) -> Response:
    from temper.storage import NotFound

    if not episode.trajectory_key:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"episode {episode.id} has no trajectory yet")
    try:
        data = await store.get(episode.trajectory_key)
    except NotFound:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND, f"trajectory of episode {episode.id} is missing"
        ) from None
    return Response(data, media_type="application/json")


@router.get(
    "/v1/episodes/{episode_id}/log",
    summary="An episode's log (JSON lines)",
    description="One JSON object per step, written when the episode is scored: turn, kind, attempt, timings; "
    "for sandbox steps the exit code, kill reason, stdout/stderr and their truncation flags; for inference steps "
    "the finish reason and policy version; for the reward step the reward components.",
    response_class=Response,
    responses={200: {"content": {"application/x-ndjson": {}}}, **EPISODE_NOT_FOUND, **AUTH},
)
async def get_episode_log(session: SessionDep, store: StoreDep, episode: EpisodeDep) -> Response:
    data = await stored_log(session, store, episode)
    if data is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"episode {episode.id} has no log (not scored yet)")
    return Response(data, media_type="application/x-ndjson")
