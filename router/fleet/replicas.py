"""The fleet as the router sees it: each replica's health, load signals and models.

Load has two sources, because each alone is wrong: the router's own in-flight counts are
exact and instant but blind to other routers and to what the replica queued; vLLM's gauges
(``vllm:num_requests_running/waiting``, ``vllm:kv_cache_usage_perc``) see everything but are
a scrape interval old. ``Replica.pending`` combines them: the gauges plus the requests this
router sent since that scrape and still has in flight (which the gauges cannot hold yet), or
the router's own count if that is larger. Without the second term, a router behind several
others, or a burst inside one scrape interval, would see a replica as idle as its last page.
With peer routers (router/peers/load.py), their in-flight requests are added to this router's
own count: every request passes through some router, so that sum is the replica's queue now.

A data-parallel server's ranks are replicas of their own (router/fleet/dp.py) sharing one URL and
one metrics page: vLLM labels each engine's gauges ``engine="<rank>"``, so each rank takes its
own (``engine_gauges``); a page without the label is divided evenly among the ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvroute.router.common.timed_values import TimedValues
from kvroute.router.config import ReplicaConfig

__all__ = [
    "KV_BLOCKS",
    "PD_PULL_FAILURES",
    "PD_TRANSPORT_COUNTERS",
    "PREFILL_COUNTERS",
    "SPEC_DECODE_COUNTER",
    "Replica",
    "ReplicaRegistry",
    "engine_gauges",
    "parse_vllm_metrics",
    "parse_vllm_metrics_by_engine",
]

_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM before 0.10
}


# Counters the cost model's calibration reads as evidence (router/routing/prefill_evidence.py):
# vLLM's prefill-time histogram (scheduled -> first token: no queue in it) and its prompt
# tokens by where they came from, all summed over label sets like the gauges.
_COUNTERS = {
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:request_prefill_time_seconds_count": "prefills",
}
_BY_SOURCE = {
    "vllm:prompt_tokens_by_source_total": {"local_compute": "computed_tokens"},
    "vllm:prompt_tokens_cached_by_source_total": {"host": "host_tokens", "disk": "disk_tokens"},
}
# The keys those counters are parsed into, in the order the calibration reads them.
PREFILL_COUNTERS = ("prefill_s", "prefills", "computed_tokens", "host_tokens", "disk_tokens")
# P/D transports' own counters on the replica's page: a decode that could not pull its
# prefill's KV (it recomputed, or failed the request under kv_load_failure_policy=fail),
# and a prefill whose held blocks expired unread. NixlConnector's (vLLM's nixl/stats.py)
# and kvroute's storage-domain transport's (connector/pd_metrics.py).
_PD_TRANSPORT = {
    "vllm:nixl_num_failed_transfers_total": "nixl_failed_transfers",
    "vllm:nixl_num_kv_expired_reqs_total": "nixl_expired_leases",
    "vllm:kvroute_pd_transfers_total": "storage_transfers",
    "vllm:kvroute_pd_waited_total": "storage_waited",
    "vllm:kvroute_pd_timeouts_total": "storage_timeouts",
    "vllm:kvroute_pd_mismatches_total": "storage_mismatches",
}
_COUNTERS.update(_PD_TRANSPORT)
# vLLM's spec-decode counters exist (at 0) as soon as speculative decoding is configured, for
# every method, ngram included: they say drafts are on, never which method (indexer/index/
# drafts.py: only EAGLE-style ones drop a block of every hit).
SPEC_DECODE_COUNTER = "spec_drafts"
_COUNTERS["vllm:spec_decode_num_drafts_total"] = SPEC_DECODE_COUNTER
PD_TRANSPORT_COUNTERS = tuple(_PD_TRANSPORT.values())
# Of those, the decodes that could not pull (the rest are traffic, or the prefill's side).
PD_PULL_FAILURES = ("nixl_failed_transfers", "storage_timeouts", "storage_mismatches")

_ENGINE_LABEL = re.compile(r'[{,]engine="([^"]*)"')
_SOURCE_LABEL = re.compile(r'[{,]source="([^"]*)"')
# vLLM's cache config, an info gauge (always 1) whose labels are CacheConfig's fields: the
# device cache's size in blocks is its ``num_gpu_blocks`` label (what the KV room is
# counted against, router/routing/kv_room.py).
_CACHE_INFO = "vllm:cache_config_info"
_GPU_BLOCKS_LABEL = re.compile(r'[{,]num_gpu_blocks="(\d+)"')
KV_BLOCKS = "kv_blocks"
# How long peers' device-cache holdings are remembered, for a scrape that old
_PEER_KV_HISTORY_S = 30.0


def _fold(out: dict[str, float], key: str, value: float) -> None:
    """Counts add up over engines; KV usage is the fullest engine's, the cache size the
    smallest engine's (the one a request fits last)."""
    if key == "kv_usage":
        out[key] = max(out.get(key, 0.0), value)
    elif key == KV_BLOCKS:
        out[key] = min(out.get(key, value), value)
    else:
        out[key] = out.get(key, 0.0) + value


def parse_vllm_metrics_by_engine(text: str) -> dict[str, dict[str, float]]:
    """The load gauges (and the calibration's counters, ``_COUNTERS``/``_BY_SOURCE``) from a
    Prometheus text page per ``engine`` label value ("" for series without one), summed over
    the other labels."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name_end = brace if brace >= 0 else line.find(" ")
        name = line[:name_end]
        key = _GAUGES.get(name) or _COUNTERS.get(name)
        info: float | None = None  # an info gauge's value is in a label
        if key is None and name == _CACHE_INFO and brace >= 0:
            blocks = _GPU_BLOCKS_LABEL.search(line, brace)
            if blocks is None or int(blocks.group(1)) <= 0:
                continue
            key, info = KV_BLOCKS, float(blocks.group(1))
        if key is None:
            sources = _BY_SOURCE.get(name)
            if sources is None or brace < 0:
                continue
            match = _SOURCE_LABEL.search(line, brace)
            key = sources.get(match.group(1)) if match is not None else None
            if key is None:
                continue
        engine = ""
        if brace >= 0:
            close = line.rfind("}")
            match = _ENGINE_LABEL.search(line, brace, close + 1)
            if match is not None:
                engine = match.group(1)
            rest = line[close + 1 :]
        else:
            rest = line[name_end:]
        try:
            value = float(rest.split()[0]) if info is None else info
        except (IndexError, ValueError):
            continue
        _fold(out.setdefault(engine, {}), key, value)
    return out


def _combined(by_engine: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for gauges in by_engine.values():
        for key, value in gauges.items():
            _fold(out, key, value)
    return out


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The load gauges from a Prometheus text page, summed over label sets (engines)."""
    return _combined(parse_vllm_metrics_by_engine(text))


def engine_gauges(
    by_engine: dict[str, dict[str, float]], rank: int | None, ranks: int
) -> dict[str, float]:
    """One target's gauges from its server's page: the whole server for a replica without
    ranks; a rank's own ``engine`` series; for a page without engine labels, an even share
    of the server's counts (a rank the labels do not name has none)."""
    if rank is None:
        return _combined(by_engine)
    own = by_engine.get(str(rank))
    if own is not None:
        return dict(own)
    if any(by_engine):
        return {}
    total = _combined(by_engine)
    return {k: v if k in ("kv_usage", KV_BLOCKS) else v / max(ranks, 1) for k, v in total.items()}


class LoadSignal:
    """Wakes whoever waits for the in-flight counts to change (a held ``GET /peer/load``,
    router/peers/load.py). Fired exactly where they change (a request begins or ends, a
    replica comes or goes), so a waiter costs nothing between changes. Used on the router's
    event loop only."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def changed(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout_s: float) -> None:
        """Until the next change, or ``timeout_s``."""
        if self._event is None:
            self._event = asyncio.Event()
        event = self._event
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await event.wait()


@dataclass(eq=False, slots=True)
class Replica:
    config: ReplicaConfig
    healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None
    last_check: float | None = None
    ejections: int = 0
    in_flight: int = 0
    # What peer routers are proxying to it, and the blocks they sent it to compute that its
    # feed has not announced yet, as of their last answer (router/peers/load.py).
    peer_in_flight: int = 0
    peer_unstored_blocks: int = 0
    # The device blocks peer routers' requests hold on it (router/routing/kv_room.py), now
    # and, for the moment of a scrape, as it changed (time, blocks), oldest first
    peer_kv_held: int = 0
    peer_kv_history: TimedValues = field(default_factory=lambda: TimedValues(_PEER_KV_HISTORY_S))
    # when their holdings should free, as they said: (monotonic time, blocks), soonest first
    peer_kv_frees: list[tuple[float, int]] = field(default_factory=list)
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    # Its device cache's size in blocks, from its metrics page (None: the page does not say)
    kv_blocks: int | None = None
    scraped_at: float | None = None
    scrape_sent_at: float | None = None  # when that page was asked for
    # Requests sent after the last scrape and still in flight; ``scrape_epoch`` tells a
    # finishing request whether it was one of them.
    sent_since_scrape: int = 0
    scrape_epoch: int = 0
    # Requests sent before the last scrape that ended since (``pending_fresh``).
    ended_since_scrape: int = 0
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    models_at: float | None = None
    removed: bool = False
    load_signal: LoadSignal | None = None  # its registry's, fired when in_flight changes
    # Its P/D transport's counters as its last metrics page had them (PD_TRANSPORT_COUNTERS;
    # empty: no such counters on its page).
    pd_transport: dict[str, float] = field(default_factory=dict)
    # Its metrics page shows speculative decoding while its config names no method
    # (``speculative=``): its hits may be a block shorter than predicted (router/fleet/health.py)
    drafts_unknown: bool = False
    # ``config.key``, computed once: a decision reads every candidate's name several times
    _key: str = field(init=False, repr=False, default="")
    # the models' names joined, for the rates' pool (``rate_pool``), and the models they were of
    _pool: tuple[dict[str, dict[str, Any]] | None, str] = field(
        init=False, repr=False, default=(None, "")
    )

    def __post_init__(self) -> None:
        self._key = self.config.key

    @property
    def name(self) -> str:
        return self._key

    @property
    def rate_pool(self) -> str:
        """The replicas whose learned rates this one borrows while it has few samples of its
        own: those serving the same models (the same deployment; a fleet mixing hardware for
        one model names its replicas' models apart, or learns per replica). Recomputed when
        ``models`` is replaced (the health checker sets a new dict each refresh)."""
        models, pool = self._pool
        if models is not self.models:
            pool = ",".join(sorted(self.models))
            self._pool = (self.models, pool)
        return pool

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def role(self) -> str:
        """Which leg it serves under prefill/decode disaggregation: both, prefill, decode."""
        return self.config.role

    @property
    def group(self) -> str:
        """The server behind this target: a data-parallel rank's server, else itself."""
        return self.config.server or self.config.key

    @property
    def pending(self) -> float:
        """Requests ahead of a new one: vLLM's last gauges plus what this router sent since,
        or what every router has in flight (ours and the peers'), whichever is more."""
        return max(
            float(self.in_flight + self.peer_in_flight),
            self.running + self.waiting + self.sent_since_scrape,
        )

    @property
    def pending_fresh(self) -> float:
        """``pending`` less the requests this router saw end since the last scrape (the
        gauges counted them, they are gone now): what admission (serving/admission.py)
        counts room by, so a slot that frees is used at once, not a scrape interval later.
        Routing keeps ``pending``, where a replica's own gauges are the judge."""
        gauges = self.running + self.waiting
        fresh = gauges - min(float(self.ended_since_scrape), gauges) + self.sent_since_scrape
        return max(float(self.in_flight + self.peer_in_flight), fresh)

    def begin_request(self) -> int:
        """A request goes out: count it; returns the epoch to give ``end_request``."""
        self.in_flight += 1
        self.sent_since_scrape += 1
        if self.load_signal is not None:
            self.load_signal.changed()
        return self.scrape_epoch

    def end_request(self, epoch: int) -> None:
        self.in_flight -= 1
        if epoch == self.scrape_epoch and self.sent_since_scrape > 0:
            self.sent_since_scrape -= 1
        elif epoch != self.scrape_epoch:
            self.ended_since_scrape += 1
        if self.load_signal is not None:
            self.load_signal.changed()

    def set_peer_kv_held(self, blocks: int) -> None:
        if blocks == self.peer_kv_held and self.peer_kv_history:
            return
        now = time.monotonic()
        self.peer_kv_held = blocks
        self.peer_kv_history.add(now, blocks)

    def peer_kv_held_at(self, moment: float, until: float | None = None) -> int:
        """What peers' requests held on it at ``moment`` (a scrape's time), as last heard;
        with ``until``, the most they held from ``moment`` to ``until``."""
        return self.peer_kv_history.at(moment, until)

    def set_gauges(
        self,
        running: float,
        waiting: float,
        kv_usage: float,
        kv_blocks: float | None = None,
        sent_at: float | None = None,
    ) -> None:
        """A fresh metrics page (asked for at ``sent_at``): it counts every request the
        replica had by now."""
        self.running, self.waiting, self.kv_usage = running, waiting, kv_usage
        if kv_blocks is not None:
            self.kv_blocks = int(kv_blocks)
        self.scraped_at = time.monotonic()
        self.scrape_sent_at = self.scraped_at if sent_at is None else sent_at
        self.scrape_epoch += 1
        self.sent_since_scrape = 0
        self.ended_since_scrape = 0

    def serves(self, model: str) -> bool:
        return model in self.models

    def is_lora(self, model: str) -> bool:
        """vLLM lists LoRA adapters as models whose ``parent`` is the base model."""
        card = self.models.get(model)
        return bool(card and card.get("parent"))

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "last_error": self.last_error,
            "last_check_age_s": None
            if self.last_check is None
            else round(time.monotonic() - self.last_check, 3),
            "ejections": self.ejections,
            "in_flight": self.in_flight,
            "running": self.running,
            "waiting": self.waiting,
            "kv_cache_usage": self.kv_usage,
            "kv_cache_blocks": self.kv_blocks,
            "pending": self.pending,
            "models": sorted(self.models),
            "events": self.config.events,
            "server": self.group,
            "data_parallel_rank": self.config.dp_rank,
            "role": self.config.role,
        }


class ReplicaRegistry:
    """Replicas by name. Mutated only on the router's event loop, so no lock is needed."""

    def __init__(self, *, unhealthy_after: int = 2, healthy_after: int = 1) -> None:
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self._replicas: dict[str, Replica] = {}
        self.load_signal = LoadSignal()

    def __iter__(self):
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, name: str) -> Replica | None:
        return self._replicas.get(name)

    def names(self) -> list[str]:
        return list(self._replicas)

    def add(self, config: ReplicaConfig) -> Replica:
        replica = Replica(config, load_signal=self.load_signal)
        self._replicas[config.key] = replica
        self.load_signal.changed()
        return replica

    def remove(self, name: str) -> Replica | None:
        replica = self._replicas.pop(name, None)
        if replica is not None:
            replica.removed = True
            self.load_signal.changed()
        return replica

    def healthy(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy]

    def group(self, server: str) -> list[Replica]:
        """The targets behind one server (its data-parallel ranks, or the replica alone)."""
        return [r for r in self._replicas.values() if r.group == server]

    def candidates(self, model: str) -> list[Replica]:
        return [r for r in self._replicas.values() if r.healthy and model in r.models]

    def known_models(self, replicas: Iterable[Replica] | None = None) -> dict[str, dict[str, Any]]:
        """The union of the replicas' model cards (first card seen for an id wins)."""
        out: dict[str, dict[str, Any]] = {}
        for r in replicas if replicas is not None else self._replicas.values():
            for model_id, card in r.models.items():
                out.setdefault(model_id, card)
        return out

    # --- health transitions ---------------------------------------------------------------

    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        replica.last_check = time.monotonic()
        if not replica.healthy and replica.consecutive_successes >= self.healthy_after:
            replica.healthy = True
            replica.last_error = None

    def record_failure(self, replica: Replica, reason: str, *, eject_now: bool = False) -> None:
        """A failed check or a failed proxy attempt; ejects after ``unhealthy_after`` in a row
        (at once with ``eject_now``, for a refused connection: nobody is listening)."""
        replica.consecutive_successes = 0
        replica.consecutive_failures += 1
        replica.last_error = reason
        replica.last_check = time.monotonic()
        if replica.healthy and (eject_now or replica.consecutive_failures >= self.unhealthy_after):
            replica.healthy = False
            replica.ejections += 1
        if eject_now and replica.config.dp_rank is not None:
            # Nobody listens at the server's URL: none of its ranks can answer either.
            for sibling in self.group(replica.group):
                if sibling is not replica and sibling.healthy:
                    sibling.last_error = reason
                    sibling.healthy = False
                    sibling.ejections += 1
