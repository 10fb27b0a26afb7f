"""The tracker's process: the :class:`TrackerComponent` on a :class:`Runtime`, with
``/health`` (503 names what is down) and ``/metrics``."""

from __future__ import annotations

from fastapi import FastAPI

from services.tracker.component import TrackerComponent
from temper.runtime import Runtime, service_app
from temper.settings import Settings


def create_app(settings: Settings) -> FastAPI:
    runtime = Runtime(settings, service="tracker")
    tracker = TrackerComponent(runtime)
    app = service_app(runtime, tracker, title="Temper tracker")
    app.state.tracker = tracker
    return app
