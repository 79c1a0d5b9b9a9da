"""Prefill/decode disaggregation in the simulator, as vLLM's NixlConnector does it.

vLLM 0.32 (shared/BRIEF.md section 9; docs/router.md, P/D): a request whose
``kv_transfer_params`` say ``do_remote_decode`` is a prefill leg: the replica computes the
prompt, answers (non-streamed) with ``kv_transfer_params`` naming itself (``remote_engine_id``,
``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``,
``remote_prefill_cached_tokens``) and keeps the prompt's blocks until the decode replica
reads them or a lease ends (``lease_s``, vLLM's 30 s). A request whose params say
``do_remote_prefill`` is a decode leg: it pulls every full prompt block it does not hold
from that prefill replica at ``transfer_s_per_token`` (the simulated side channel), caches
them like computed blocks (so it announces them in its KV events) and reports the
prefill's cached tokens as its own ``cached_tokens``, as vLLM does. A pull that cannot
happen (the lease is gone, the prefill replica died or restarted) is recomputed locally, as
vLLM's ``kv_load_failure_policy="recompute"``, after ``dead_side_channel_s`` when the
prefill process is gone (vLLM waits ~5 s for a dead side channel); every such pull is
counted (``TransferBoard.failures``, and the decode replica's
``vllm:nixl_num_failed_transfers``), every lease that ends unread too (the prefill
replica's ``vllm:nixl_num_kv_expired_reqs``), as NixlConnector counts them.

The "network" is this process: a board shared by the module (``BOARD``) is where a decode
replica finds the prefill replica's blocks. Replicas may run on different event loops (the
router tests give each its own thread): the board is locked, and a lease's blocks are freed
on the prefill replica's own loop. A replica started with ``nixl=False`` has no connector:
it ignores ``kv_transfer_params`` and answers ``null``, as vLLM without one.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.bench.sim.replica import SimReplica
    from kvroute.bench.sim.scheduler import Scheduler, SimRequest

__all__ = ["BOARD", "Lease", "Pull", "TransferBoard", "parse_transfer_params"]

_SIDE_CHANNEL_BASE = 5600  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default


@dataclass(slots=True)
class Pull:
    """What a decode leg may load from a prefill replica: the full prompt blocks' tokens, and
    the prefill's own cache hits (reported as the decode's cached tokens)."""

    tokens: int
    prefill_cached_tokens: int


@dataclass(slots=True)
class Lease:
    """A prefill's blocks, held for the decode replica that will pull them."""

    replica: SimReplica
    scheduler: Scheduler
    request: SimRequest
    loop: asyncio.AbstractEventLoop
    timer: asyncio.TimerHandle | None = None
    pulled: bool = False

    @property
    def alive(self) -> bool:
        """The process that computed the blocks still runs (not killed nor restarted)."""
        return self.replica.alive and self.replica.scheduler is self.scheduler


@dataclass
class TransferBoard:
    """Every held prefill of the process's simulated fleets, by (engine id, request id)."""

    leases: dict[tuple[str, str], Lease] = field(default_factory=dict)
    pulls: int = 0
    failures: int = 0
    expired: int = 0
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, replica: SimReplica, request: SimRequest) -> dict[str, Any]:
        """A prefill leg finished: hold its blocks; the answer's ``kv_transfer_params``."""
        request_id = f"sim-{next(self._ids)}"
        key = (replica.engine_id, request_id)
        loop = asyncio.get_running_loop()
        lease = Lease(replica, replica.scheduler, request, loop)
        lease.timer = loop.call_later(
            replica.config.pd_lease_s * replica.config.latency.time_scale, self._expire, key
        )
        with self._lock:
            self.leases[key] = lease
        bs = replica.config.block_size
        blocks = [] if request.alloc is None else request.alloc.blocks
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": replica.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": list(range(len(request.prompt) // bs or len(blocks))),
            "remote_host": "localhost",  # vLLM's default side-channel host
            "remote_port": _SIDE_CHANNEL_BASE + (replica.port % 1000),
            "tp_size": 1,
            "remote_prefill_cached_tokens": request.cached_tokens,
        }

    def _expire(self, key: tuple[str, str]) -> None:
        with self._lock:
            lease = self.leases.pop(key, None)
        if lease is not None and not lease.pulled:
            self.expired += 1
            lease.scheduler.stats.nixl_expired_reqs += 1  # on the prefill replica's loop
            _release(lease)

    def take(
        self, params: dict[str, Any], prompt_len: int, block_size: int
    ) -> tuple[Pull | None, bool]:
        """A decode leg's pull: (the blocks it may load, the lease ends; or None when they
        cannot be read, then the decode recomputes), and whether the prefill engine is dead
        (its side channel does not answer)."""
        key = (str(params.get("remote_engine_id")), str(params.get("remote_request_id")))
        with self._lock:
            lease = self.leases.pop(key, None)
            ok = lease is not None and lease.alive and len(lease.request.prompt) == prompt_len
            if ok:
                self.pulls += 1
            else:
                self.failures += 1
        if lease is not None:
            lease.pulled = True
            _release(lease)
        if not ok:
            return None, lease is not None and not lease.alive
        assert lease is not None
        full = (prompt_len // block_size) * block_size
        return Pull(tokens=full, prefill_cached_tokens=lease.request.cached_tokens), False


def _release(lease: Lease) -> None:
    """Free the lease's blocks on the prefill replica's own loop (thread-safe)."""

    def release() -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        if lease.alive:
            lease.scheduler.release_held(lease.request)

    if not lease.loop.is_closed():
        lease.loop.call_soon_threadsafe(release)


def parse_transfer_params(body: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """(is a prefill leg, the decode leg's params or None) of a request body."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict):
        return False, None
    if params.get("do_remote_decode") is True:
        return True, None
    if params.get("do_remote_prefill") is True:
        return False, params
    return False, None


BOARD = TransferBoard()
