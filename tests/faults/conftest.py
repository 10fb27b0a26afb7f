"""Fixtures of the fault-injection tests: a :class:`FaultStack` per test, stopped (and its
private servers removed) whatever happens; see harness.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.faults.harness import FaultStack, PrivateMinio, PrivatePostgres, small_spec


@pytest.fixture
def fault_stack(tmp_path, kafka_bootstrap, request) -> Iterator[Callable[..., FaultStack]]:
    """``fault_stack(**kwargs)`` -> a prepared (not started) :class:`FaultStack` of a small job."""
    made: list[FaultStack] = []

    def make(spec: dict[str, Any] | None = None, **kwargs: Any) -> FaultStack:
        stack = FaultStack(tmp_path, spec or small_spec(request.node.name[:60]), **kwargs).prepare()
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.stop()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres().start()
    yield pg
    pg.close()


@pytest.fixture
def private_minio() -> Iterator[PrivateMinio]:
    s3 = PrivateMinio().start()
    yield s3
    s3.close()
