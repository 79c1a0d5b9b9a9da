"""Warm start: seed a starting router's index from a running peer's snapshot.

Protocol: before its feeds start, the router asks its peers (``--peer``, or whatever
``RouterService.peer_urls`` returns: Kubernetes discovery plugs in there) one at a time for
``GET /index/snapshot`` (router/peers/snapshot.py), with this router's own API key and a
deadline for the whole body. The first complete, valid snapshot wins. Each configured replica
whose identity in it (name, events and replay endpoints, topic) is the one configured here is
imported whole, and its feed starts at the snapshot's position: its first act is to ask the
replay for the snapshot's last batch, which proves the replica is still the process the peer
saw (same batch, same payload digest) and brings the gap after it (ReplicaFeed._verify_seed).
Everything else, any failure included, falls back to the replicas' full replay: a peer that is
down, slow, still bootstrapping (it answers 503), garbage, another version, a replica that
restarted since. Replicas configured after start (replicas file, discovery) are seeded from
the same snapshot while it is young (``SEED_TTL_S``); later ones start by replay.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.indexer.snapshot import SnapshotError
from kvroute.indexer.subscriber import EventSource, ReplicaSnapshot, WarmOutcome
from kvroute.router.peers.snapshot import ReplicaRecord, SnapshotReader

__all__ = ["SEED_TTL_S", "PeerUrls", "WarmStart", "WarmStartError", "fetch_snapshot"]

log = logging.getLogger(__name__)

# How long a fetched snapshot may still seed a replica configured after start: the replay
# buffer (vLLM keeps 10,000 batches) must still hold the snapshot's last batch.
SEED_TTL_S = 60.0

PeerUrls = Callable[[], "list[str] | Awaitable[list[str]]"]


class WarmStartError(RuntimeError):
    """Why a peer's snapshot could not be used."""


async def fetch_snapshot(
    client: httpx.AsyncClient, peer: str, *, api_key: str | None, timeout_s: float, max_bytes: int
) -> dict[str, ReplicaSnapshot]:
    """The peer's snapshot, by replica name. WarmStartError says why not.

    Streamed: each chunk is decoded as it arrives (``SnapshotReader``, off the event loop),
    so only the decoded records and the frame in progress are held, never the whole body;
    ``max_bytes`` (``--peer-snapshot-max-mib``) bounds it."""
    url = peer.rstrip("/") + "/index/snapshot"
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    reader = SnapshotReader(max_bytes)

    async def body() -> list[ReplicaRecord]:
        async with client.stream("GET", url, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:300].decode("utf-8", "replace")
                raise WarmStartError(f"{url} answered {resp.status_code}: {text}")
            async for chunk in resp.aiter_bytes():
                await asyncio.to_thread(reader.feed, chunk)
        return reader.finish()

    try:
        records = await asyncio.wait_for(body(), timeout_s)
    except TimeoutError as exc:
        raise WarmStartError(f"{url}: no whole snapshot within {timeout_s}s") from exc
    except httpx.HTTPError as exc:
        raise WarmStartError(f"{url}: {type(exc).__name__}: {exc}") from exc
    except SnapshotError as exc:
        raise WarmStartError(f"{url}: {exc}") from exc
    return {r.name: r.snapshot() for r in records}


@dataclass(slots=True)
class WarmStart:
    """How this router started (``/index/stats``' ``start``), and the snapshot's seeds."""

    mode: str = "replay"
    peer: str | None = None
    error: str | None = None
    fetch_s: float | None = None
    replicas_from_snapshot: int = 0
    replicas_mismatched: int = 0
    entries_imported: int = 0
    seeds: dict[str, ReplicaSnapshot] = field(default_factory=dict)
    seeds_until: float = 0.0
    started: float = field(default_factory=time.monotonic)

    async def fetch(
        self,
        peers: list[str],
        *,
        api_key: str | None,
        timeout_s: float,
        max_bytes: int,
    ) -> None:
        """Try ``peers`` in order; keep the first snapshot that arrives whole."""
        self.started = time.monotonic()
        if not peers:
            return
        errors = []
        async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as client:
            for peer in peers:
                try:
                    seeds = await fetch_snapshot(
                        client, peer, api_key=api_key, timeout_s=timeout_s, max_bytes=max_bytes
                    )
                except WarmStartError as exc:
                    log.warning("warm start: %s; trying the next peer", exc)
                    errors.append(str(exc))
                    continue
                self.mode, self.peer, self.seeds = "peer_snapshot", peer, seeds
                self.seeds_until = time.monotonic() + SEED_TTL_S
                log.info("warm start: snapshot of %d replicas from %s", len(seeds), peer)
                break
        self.fetch_s = round(time.monotonic() - self.started, 3)
        if self.mode == "replay":
            self.error = "; ".join(errors)[:2000]
            log.warning("warm start: no peer gave a snapshot: starting from the replicas' replay")

    def take(self, sources: list[EventSource]) -> ReplicaSnapshot | None:
        """The seed for a replica about to start with ``sources``, if the snapshot has one
        for exactly that stream and is young enough (each seed is used once)."""
        if not self.seeds or len(sources) != 1:
            return None
        source = sources[0]
        seed = self.seeds.pop(source.replica, None)
        if seed is None or time.monotonic() > self.seeds_until:
            return None
        if seed.source != source:
            self.replicas_mismatched += 1
            log.warning(
                "warm start: replica %s is configured differently in the peer's snapshot "
                "(%s): replaying instead",
                source.replica,
                seed.source,
            )
            return None
        return seed

    def imported(self, seed: ReplicaSnapshot) -> None:
        self.replicas_from_snapshot += 1
        self.entries_imported += seed.state.entries

    def drop_stale_seeds(self) -> None:
        if self.seeds and time.monotonic() > self.seeds_until:
            self.seeds = {}

    def to_dict(self, outcomes: dict[str, WarmOutcome]) -> dict[str, Any]:
        pending = sum(o.outcome == "pending" for o in outcomes.values())
        settled = [o.settled_at for o in outcomes.values() if o.settled_at is not None]
        took = self.fetch_s
        if settled and not pending:
            took = round(max(settled) - self.started, 3)
        return {
            "mode": self.mode,
            "peer": self.peer,
            "replicas_from_snapshot": self.replicas_from_snapshot,
            "entries_imported": self.entries_imported,
            "gap_batches_replayed": sum(o.gap_batches for o in outcomes.values()),
            "took_s": took,
            "error": self.error,
            "replicas_verified": sum(o.outcome == "verified" for o in outcomes.values()),
            "replicas_pending": pending,
            "replicas_dropped": {
                name: o.outcome
                for name, o in outcomes.items()
                if o.outcome not in ("verified", "pending")
            },
            "replicas_mismatched": self.replicas_mismatched,
        }


async def peer_list(peer_urls: PeerUrls) -> list[str]:
    """Call the hook, sync or async; a failing hook means no peers."""
    try:
        urls = peer_urls()
        if inspect.isawaitable(urls):
            urls = await urls
        return [u for u in urls if isinstance(u, str) and u]
    except Exception as exc:  # discovery is best effort: replay is always there
        log.warning("warm start: peer discovery failed (%r): starting from replay", exc)
        return []
