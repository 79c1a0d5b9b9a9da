"""Where a Ray Serve replica publishes its KV events, as the replica says and the router reads.

A replica of ``KVRouteLLMServer`` (server.py) advertises a ``kvroute_kv_events`` entry in its
replica metadata (``record_replica_metadata``, read once when it is ready) and in its routing
stats (``record_routing_stats``, polled): the PUB and replay endpoints its engine binds, the
topic naming the replica, and the engine's block size. A replica of Ray's own KV-aware setup
advertises ``kv_event_metadata`` in its routing stats instead (``endpoint``,
``replay_endpoint``, ``block_size``, ``dp_rank``); the router reads either, kvroute's first.

Ports: the replicas of one node share ``engine_kwargs``, so each replica offsets the base
ports by its node-local rank (as Ray's KV-aware setup does), and takes free ports instead when
those are held (another deployment on the node): two replicas of a node never collide.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "METADATA_KEY",
    "RAY_METADATA_KEY",
    "ReplicaEvents",
    "events_config",
    "pick_ports",
    "replica_events",
    "topic_for",
]

METADATA_KEY = "kvroute_kv_events"
RAY_METADATA_KEY = "kv_event_metadata"  # Ray's KV-aware setup (routing stats)
DEFAULT_PORT_BASE = 5557
REPLAY_PORT_OFFSET = 1000  # Ray's: a range of its own above the PUB ports


@dataclass(frozen=True, slots=True)
class ReplicaEvents:
    """One replica's event stream, as advertised."""

    endpoint: str
    replay: str | None = None
    topic: str = ""
    block_size: int | None = None
    source: str = METADATA_KEY  # which advertisement it came from

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay,
            "topic": self.topic,
            "block_size": self.block_size,
        }


def topic_for(replica_id: str, model: str) -> str:
    """The topic a replica publishes on: it names the replica (vLLM's advice is
    ``kv@<id>@<model>``), so a subscriber pointed at the wrong socket counts foreign topics."""
    return f"kv@{replica_id}@{model}"


def _free(port: int, host: str = "") -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _any_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def pick_ports(local_rank: int, base: int = DEFAULT_PORT_BASE) -> tuple[int, int]:
    """(PUB, replay) ports for the replica of node-local rank ``local_rank``: the base ports
    offset by the rank, or free ones when either is held (``base`` 0: always free ones)."""
    if base > 0:
        pub, replay = base + local_rank, base + REPLAY_PORT_OFFSET + local_rank
        if _free(pub) and _free(replay):
            return pub, replay
    pub = _any_free_port()
    replay = _any_free_port()
    while replay == pub:
        replay = _any_free_port()
    return pub, replay


def events_config(pub: int, replay: int, topic: str) -> dict[str, Any]:
    """vLLM's ``kv_events_config`` for the engine: bind every interface, replay on."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": topic,
    }


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def replica_events(
    metadata: Mapping[str, Any] | None, routing_stats: Mapping[str, Any] | None
) -> ReplicaEvents | None:
    """A replica's stream from its replica metadata or routing stats: kvroute's entry (either
    place), else Ray's ``kv_event_metadata`` (routing stats; its topic is vLLM's default,
    empty). None when the replica advertises neither, or nothing usable."""
    ours, rays = metadata or {}, routing_stats or {}
    for key, places in ((METADATA_KEY, (ours, rays)), (RAY_METADATA_KEY, (rays, ours))):
        for where in places:
            entry = where.get(key)
            if isinstance(entry, Mapping) and _text(entry.get("endpoint")):
                return ReplicaEvents(
                    endpoint=entry["endpoint"],
                    replay=_text(entry.get("replay_endpoint")),
                    topic=entry.get("topic") or "",
                    block_size=_int(entry.get("block_size")),
                    source=key,
                )
    return None
