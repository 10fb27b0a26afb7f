"""Which failures are an outage of a dependency, not a fault of the message at hand.

A handler that fails because Postgres, the object store or Kafka cannot be reached
would fail the same way on every message: dead-lettering it after a few quick retries
turns a one-second restart into lost work. :func:`unavailable_dependency` names the
dependency for such errors (and only for them); the bus then waits and retries until
the dependency is back, and dead-letters only messages that fail on their own content.
This is the one place that classifies errors; the trainer's publish retry uses it too.
"""

from __future__ import annotations

import errno
import socket

DATABASE = "database"
OBJECT_STORE = "object_store"
KAFKA = "kafka"
NETWORK = "network"

_CONNECTION_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ETIMEDOUT,
    errno.EPIPE,
}


def _classify(exc: BaseException) -> str | None:
    module = type(exc).__module__ or ""
    name = type(exc).__name__
    if module.startswith("sqlalchemy"):
        from sqlalchemy import exc as sa

        if isinstance(exc, sa.OperationalError | sa.InterfaceError):
            return DATABASE
        if isinstance(exc, sa.DBAPIError) and exc.connection_invalidated:
            return DATABASE
        if isinstance(exc, sa.TimeoutError):  # no connection free in the pool: the server is not answering
            return DATABASE
        return None
    if module.startswith("asyncpg"):
        import asyncpg

        if isinstance(
            exc,
            asyncpg.PostgresConnectionError
            | asyncpg.InterfaceError
            | asyncpg.exceptions.OperatorInterventionError,  # 57P01-57P03: shutdown, restart
        ):
            return DATABASE
        return None
    if module.startswith("temper.db") and name == "DatabaseUnavailable":
        return DATABASE
    if module.startswith("temper.bus") and name == "BusUnavailable":
        return KAFKA
    if module.startswith(("urllib3", "minio")):
        import urllib3.exceptions as u3

        if isinstance(
            exc,
            u3.MaxRetryError | u3.NewConnectionError | u3.ProtocolError | u3.TimeoutError | u3.PoolError,
        ):
            return OBJECT_STORE
        if name == "ServerError":  # minio: a 5xx from the server (e.g. starting up)
            return OBJECT_STORE
        return None
    if module.startswith("aiokafka"):
        from aiokafka import errors as ke

        if isinstance(
            exc,
            ke.KafkaConnectionError
            | ke.NodeNotReadyError
            | ke.KafkaTimeoutError
            | ke.RequestTimedOutError
            | ke.NotLeaderForPartitionError
            | ke.LeaderNotAvailableError
            | ke.NotEnoughReplicasError
            | ke.CoordinatorNotAvailableError
            | ke.NotCoordinatorError,
        ):
            return KAFKA
        return None
    if isinstance(exc, ConnectionError | socket.gaierror):
        return NETWORK
    if isinstance(exc, OSError) and exc.errno in _CONNECTION_ERRNOS:
        return NETWORK
    return None


def unavailable_dependency(exc: BaseException) -> str | None:
    """The dependency (``database``, ``object_store``, ``kafka`` or ``network``) whose
    outage ``exc`` reports, looking through its causes; None for any other error."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        found = _classify(current)
        if found is not None:
            return found
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        for nested in (current.__cause__, current.__context__):
            if nested is not None:
                todo.append(nested)
    return None
