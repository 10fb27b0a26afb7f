"""The one clock: every timestamp Temper writes is an aware datetime in UTC."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
