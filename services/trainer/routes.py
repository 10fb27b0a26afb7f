"""The trainer's HTTP route beside ``/health`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

router = APIRouter()


@router.get("/v1/status", summary="Policy version, step, buffered trajectories and skipped groups per job")
async def status(request: Request) -> dict[str, Any]:
    return request.app.state.trainer.training.status()
