from __future__ import annotations

from temper.bus.base import Bus
from temper.bus.inprocess import InProcessBus
from temper.bus.kafka import KafkaBus
from temper.settings import BusKind, Settings


def make_bus(settings: Settings) -> Bus:
    """The bus the settings name (not started)."""
    b = settings.bus
    if b.kind is BusKind.kafka:
        return KafkaBus(
            bootstrap=b.bootstrap,
            partitions=b.partitions,
            max_retries=b.max_retries,
            retry_backoff_s=b.retry_backoff_s,
            connect_timeout_s=b.connect_timeout_s,
            client_id=f"{b.client_id}-{settings.service}",
            namespace=b.namespace,
        )
    return InProcessBus(partitions=b.partitions, max_retries=b.max_retries, retry_backoff_s=b.retry_backoff_s)
