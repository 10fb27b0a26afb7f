"""The message bus: one interface with Kafka's semantics, two implementations.

- :class:`KafkaBus` talks to a real Kafka cluster (aiokafka).
- :class:`InProcessBus` keeps topics in memory with the same semantics (keys map to
  partitions with Kafka's partitioner, consumer groups share partitions, offsets are
  committed only after a handler succeeded, what was not committed is redelivered)
  for the embedded mode and fast tests.

Both run handlers through :class:`temper.bus.base.Delivery`: bounded retries, then
the message goes to ``<topic>.dlq`` with the error in its headers.
"""

from temper.bus.base import Bus, BusUnavailable, Consumer, Handler, Poison, Record
from temper.bus.factory import make_bus
from temper.bus.inprocess import InProcessBus
from temper.bus.kafka import KafkaBus

__all__ = [
    "Bus",
    "BusUnavailable",
    "Consumer",
    "Handler",
    "InProcessBus",
    "KafkaBus",
    "Poison",
    "Record",
    "make_bus",
]
