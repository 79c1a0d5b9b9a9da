"""Warm start vs replay for one replica, over real ZMQ on 127.0.0.1: how long until a new
subscriber's feed is live when it replays the replica's whole buffer, and when it imports a
peer's snapshot and replays only the gap.

``python -m kvroute.bench.warm_start_bench [--batches 10000] [--blocks 16] [--gap 50]``
prints one JSON line. The history is ``--batches`` device stores of ``--blocks`` blocks each,
every one chained to the previous one, plus a removal batch after every fourth store (so
1.25x as many batches); the gap is ``--gap`` more stores the same way.
"""

from __future__ import annotations

import argparse
import json
import time

import msgspec

from kvroute.bench.publisher import EventPublisher
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.snapshot import ReplicaState
from kvroute.indexer.subscriber import EventSource, EventSubscriber, Freshness, ReplicaSnapshot
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

BS = 16


def _history(pub: EventPublisher, batches: int, blocks: int) -> None:
    parent: int | None = None
    h = 1
    for b in range(batches):
        hashes = list(range(h, h + blocks))
        tokens = [(b * blocks * BS + i) % 50_000 for i in range(blocks * BS)]
        pub.publish([BlockStored(hashes, parent, tokens, BS, medium=Medium.GPU)])
        if b % 4 == 3:  # evictions too, as a busy replica's history has
            pub.publish([BlockRemoved(hashes[:2], Medium.GPU)])
        parent, h = hashes[-1], h + blocks


def _live(sub: EventSubscriber, timeout_s: float = 120.0) -> float:
    started = time.monotonic()
    while sub.freshness("r")[0] is not Freshness.LIVE:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(sub.freshness("r"))
        time.sleep(0.002)
    return time.monotonic() - started


def run(batches: int, blocks: int, gap: int) -> dict[str, object]:
    with EventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True, buffer_steps=100_000
    ) as pub:
        source = EventSource("r", pub.endpoint, pub.replay_endpoint)
        _history(pub, batches, blocks)
        cold_index = InMemoryPrefixIndex()
        with EventSubscriber(cold_index, replay_timeout_s=60.0) as cold:
            cold.add_source(source)
            cold_s = _live(cold)
            snap = cold.export_replica("r")
            assert snap is not None
            cold_batches = cold.feed_stats()["r"].batches
            _history(pub, gap, blocks)  # what happens between the snapshot and the start
            started = time.monotonic()
            raw = msgspec.msgpack.encode(snap.state)
            state = msgspec.msgpack.decode(raw, type=ReplicaState)
            warm_index = InMemoryPrefixIndex()
            with EventSubscriber(warm_index, replay_timeout_s=60.0) as warm:
                seed = ReplicaSnapshot(source, snap.last_seq, snap.digest, state)
                warm.seed_replica("r", source, seed)
                _live(warm)
                warm_s = time.monotonic() - started
                outcome = warm.warm_outcomes()["r"]
                warm_batches = warm.feed_stats()["r"].batches
        return {
            "history_batches": cold_batches,
            "entries": snap.state.entries,
            "snapshot_bytes": len(raw),
            "cold_replay_s": round(cold_s, 3),
            "cold_batches_applied": cold_batches,
            "warm_s": round(warm_s, 3),
            "warm_batches_applied": warm_batches,
            "warm_outcome": outcome.outcome,
            "gap_batches": outcome.gap_batches,
            "same_entries": warm_index.entries == cold_index.entries,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--gap", type=int, default=50)
    args = parser.parse_args()
    print(json.dumps(run(args.batches, args.blocks, args.gap)))


if __name__ == "__main__":
    main()
