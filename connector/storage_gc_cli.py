"""``kvroute storage gc``: run a storage domain's evictor (kvroute.connector.storage_gc).

Run it as a sidecar (one per domain, looping every ``--interval-s``): routers subscribed to
its stream (``kvroute serve --storage-domain NAME=tcp://HOST:5600,replay=tcp://HOST:5601``)
see every removal, and its sequence numbers run on. ``--once`` (a CronJob) runs one pass and
exits: its removals reach only the routers connected at that moment (late ones may replay
for ``--once-linger-s``), and each run is a new process whose stream starts again at 0, so
routers clear the domain on every run and rebuild it from the run's announcement of the
chunks present (``StorageEvictor.announce``); a router not connected then misses both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", required=True, help="the storage domain's directory")
    parser.add_argument(
        "--max-gib", type=float, required=True, help="byte budget of the directory, GiB"
    )
    parser.add_argument(
        "--low-watermark",
        type=float,
        default=0.9,
        help="over budget, remove down to this fraction of it (hysteresis)",
    )
    parser.add_argument("--interval-s", type=float, default=30.0, help="seconds between passes")
    parser.add_argument("--once", action="store_true", help="one pass, then exit (CronJob)")
    parser.add_argument(
        "--once-linger-s",
        type=float,
        default=2.0,
        help="with --once: keep the replay socket up this long after the pass",
    )
    parser.add_argument(
        "--temp-grace-s",
        type=float,
        default=600.0,
        help="a writer's temp file older than this is a crashed writer's: removed",
    )
    parser.add_argument(
        "--max-candidates",
        type=int,
        default=65_536,
        help="least recently used files one pass considers (bounds memory)",
    )
    parser.add_argument(
        "--events", default="tcp://*:5600", help="KV-event PUB endpoint (vLLM's format)"
    )
    parser.add_argument("--replay", default="tcp://*:5601", help="replay ROUTER endpoint")
    parser.add_argument("--topic", default="", help="topic of the published messages")
    parser.add_argument("--log-level", default="info")


def main(args: argparse.Namespace) -> int:
    from kvroute.connector.storage_gc import StorageEvictor
    from kvroute.indexer.publisher import EventPublisher

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_gib <= 0 or not 0 < args.low_watermark <= 1 or args.interval_s <= 0:
        print(
            "kvroute storage gc: --max-gib and --interval-s must be > 0, --low-watermark in (0, 1]",
            file=sys.stderr,
        )
        return 2
    if not os.path.isdir(args.dir):
        print(f"kvroute storage gc: --dir {args.dir} is not a directory", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        publisher = EventPublisher(
            args.events, replay_endpoint=args.replay or None, topic=args.topic, bind=True
        )
    except Exception as exc:  # zmq.ZMQError: a port in use, a bad endpoint
        print(f"kvroute storage gc: cannot bind {args.events}: {exc}", file=sys.stderr)
        return 2
    try:
        evictor = StorageEvictor(
            args.dir,
            int(args.max_gib * 2**30),
            low_watermark=args.low_watermark,
            temp_grace_s=args.temp_grace_s,
            max_candidates=args.max_candidates,
            publisher=publisher,
        )
        logging.getLogger(__name__).info(
            "storage gc of %s: budget %.3f GiB, events on %s, replay on %s",
            args.dir,
            args.max_gib,
            publisher.endpoint,
            publisher.replay_endpoint,
        )
        # A new stream: routers clear the domain, then learn it again from this
        announced = evictor.announce()
        logging.getLogger(__name__).info("storage gc: announced %d chunks present", announced)
        if args.once:
            print(json.dumps({"announced": announced, **evictor.run_pass().as_dict()}), flush=True)
            stop.wait(args.once_linger_s)
        else:
            evictor.run(stop, args.interval_s)
    finally:
        publisher.close()
    return 0
