"""The trainer's ranks: what ends the process (a failed collective) and what does not."""

from __future__ import annotations

from services.trainer.ranks import Ranks, collective_failed


def test_a_failed_collective_is_told_from_a_failed_publish():
    gone = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer")
    assert collective_failed(gone)
    assert not collective_failed(TimeoutError("timed out"))
    assert not collective_failed(RuntimeError("S3 put timed out"))


async def test_one_process_sends_nothing():
    ranks = Ranks()
    assert not ranks.sharded
    await ranks.keepalive()  # no process group: a ping would raise
    ranks.stop()
