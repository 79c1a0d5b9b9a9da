"""P/D through a shared storage domain: the prefill names its chunks, the decode waits.

Both pools run kvroute's connector on one storage domain (``disk_dir`` +
``storage_domain``) with ``pd_via_storage``. The two legs are vLLM's own P/D protocol
(the router's two-leg driver), with this transport's parameters in place of NIXL's:

* Prefill (``request_finished`` of a request whose ``kv_transfer_params`` ask for
  ``do_remote_decode``): the answer's ``kv_transfer_params`` name exactly the chunks the
  decode must find: the domain, the layout digest, the chunk size, the keys in prompt
  order and the tokens they cover. Only chunks whose file this replica is writing or
  has written, or which are in the domain already, are named (a prefix: a chunk that
  was not stored, RAM or disk full, ends the list).
* Decode (``get_num_new_matched_tokens`` of a request carrying those parameters): while
  a named chunk's files are not all in the domain and the deadline (``pd_wait_s`` from
  the first look) has not passed, the answer is ``None``: vLLM's "not determined yet",
  the request stays waiting, other requests run, and the scheduler asks again next
  step. Then the ordinary lookup runs: every chunk present (all of them, unless the
  deadline passed) is loaded asynchronously (``WAITING_FOR_REMOTE_KVS``); what is
  missing is recomputed.

This module decides nothing else; the connector calls it and the planner loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.connector.bookkeeping import EntryState, TierEntry
from kvroute.connector.keys import chunk_key

logger = logging.getLogger(__name__)

# The key of this transport's parameters inside ``kv_transfer_params``.
PARAMS_KEY = "kvroute_storage"
VERSION = 1


@dataclass(frozen=True)
class StoreTransfer:
    """What a prefill wrote for a decode to find."""

    domain: str
    layout: str  # layout digest: the directory both replicas must share
    chunk_tokens: int
    keys: tuple[bytes, ...]  # chunk keys in prompt order, from chunk 0

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.chunk_tokens

    def as_params(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "domain": self.domain,
            "layout": self.layout,
            "chunk_tokens": self.chunk_tokens,
            "keys": [k.hex() for k in self.keys],
            "tokens": self.tokens,
        }


def parse_params(params: dict[str, Any] | None) -> StoreTransfer | None:
    """This transport's part of a request's ``kv_transfer_params``, or None (absent,
    another transport's, or malformed: a malformed one is logged and ignored, so the
    decode recomputes)."""
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    raw = params.get(PARAMS_KEY)
    if raw is None:
        return None
    try:
        if raw["v"] != VERSION:
            raise ValueError(f"version {raw['v']!r}")
        keys = tuple(bytes.fromhex(k) for k in raw["keys"])
        out = StoreTransfer(
            domain=str(raw["domain"]),
            layout=str(raw["layout"]),
            chunk_tokens=int(raw["chunk_tokens"]),
            keys=keys,
        )
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("kvroute: ignoring malformed %s transfer parameters: %s", PARAMS_KEY, exc)
        return None
    return out


def on_its_way(own: TierEntry | None, present: Callable[[], bool]) -> bool:
    """Whether a prefill may name a chunk: this replica's own write of it is in flight
    (its entry is not READY yet), or its files are in the domain now (``present``: a
    READY entry of ours says nothing, the domain's evictor may have removed the files)."""
    if own is not None and own.state is not EntryState.READY:
        return True
    return present()


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def prefill_answer(
    *,
    domain: str,
    layout: str,
    chunk_tokens: int,
    blocks_per_chunk: int,
    block_hashes: Sequence[bytes],
    num_prompt_tokens: int,
    on_disk: Callable[[bytes], bool],
) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill's answer: the chunks the decode's lookup
    will ask for (whole chunks before the prompt's last token, as the lookup leaves one
    token to compute), cut at the first one ``on_disk`` denies (not being written nor in
    the domain)."""
    n = min((num_prompt_tokens - 1) // chunk_tokens, len(block_hashes) // blocks_per_chunk)
    keys: list[bytes] = []
    for c in range(max(0, n)):
        key = chunk_key(block_hashes, blocks_per_chunk, c)
        if not on_disk(key):
            break
        keys.append(key)
    xfer = StoreTransfer(domain=domain, layout=layout, chunk_tokens=chunk_tokens, keys=tuple(keys))
    return {"do_remote_prefill": True, "do_remote_decode": False, PARAMS_KEY: xfer.as_params()}


@dataclass
class PdStats:
    transfers: int = 0  # decode requests carrying this transport's parameters
    ready: int = 0  # every named chunk was found before the deadline
    waited: int = 0  # ... after at least one "not yet"
    timeouts: int = 0  # the deadline passed with chunks missing (they are recomputed)
    mismatches: int = 0  # parameters of another domain, layout or prompt: recomputed
    prefill_answers: int = 0
    named_chunks: int = 0
    wait_s_total: float = 0.0
    _reported: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def counts(self) -> dict[str, float]:
        """Every counter, by the keys vLLM's metrics page names them with
        (connector/pd_metrics.py ``PD_COUNTERS``)."""
        return {
            "transfers": self.transfers,
            "ready": self.ready,
            "waited": self.waited,
            "timeouts": self.timeouts,
            "mismatches": self.mismatches,
            "prefill_answers": self.prefill_answers,
            "named_chunks": self.named_chunks,
            "wait_s": self.wait_s_total,
        }

    def take_increments(self) -> dict[str, float] | None:
        """What grew since the last call (None: nothing): what the connector hands vLLM's
        stats path after each step, which adds it to the Prometheus counters."""
        now = self.counts()
        out = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        if not any(out.values()):
            return None
        self._reported = now
        return out


@dataclass
class _Wait:
    started: float
    polls: int = 0


@dataclass
class PdWaits:
    """Decode side: which requests still wait for their prefill's chunks.

    ``probe(key)`` says whether every rank's file of the chunk is in the domain now.
    """

    domain: str
    layout: str
    chunk_tokens: int
    blocks_per_chunk: int
    wait_s: float
    probe: Callable[[bytes], bool]
    clock: Callable[[], float] = time.monotonic
    stats: PdStats = field(default_factory=PdStats)
    _waiting: dict[str, _Wait] = field(default_factory=dict)
    _settled: set[str] = field(default_factory=set)

    def should_wait(
        self, req_id: str, params: dict[str, Any] | None, block_hashes: Sequence[bytes]
    ) -> bool:
        """True while the request must not be scheduled yet (answer ``None`` to vLLM)."""
        if req_id in self._settled:
            return False
        xfer = parse_params(params)
        if xfer is None:
            return False
        if req_id not in self._waiting:
            self.stats.transfers += 1
            why = self._mismatch(xfer, block_hashes)
            if why is not None:
                logger.warning(
                    "kvroute: request %s: storage transfer parameters not usable here (%s): "
                    "recomputing",
                    req_id,
                    why,
                )
                self.stats.mismatches += 1
                self._settled.add(req_id)
                return False
            self._waiting[req_id] = _Wait(self.clock())
        w = self._waiting[req_id]
        w.polls += 1
        missing = [k for k in xfer.keys if not self.probe(k)]
        elapsed = self.clock() - w.started
        if missing and elapsed < self.wait_s:
            return True
        self._waiting.pop(req_id)
        self._settled.add(req_id)
        self.stats.wait_s_total += elapsed
        if missing:
            self.stats.timeouts += 1
            logger.warning(
                "kvroute: request %s: %d of %d chunks named by the prefill not in storage "
                "domain %s after %.1f s: the decode recomputes from the first missing one",
                req_id,
                len(missing),
                len(xfer.keys),
                self.domain,
                elapsed,
            )
        else:
            self.stats.ready += 1
            if w.polls > 1:
                self.stats.waited += 1
        return False

    def _mismatch(self, xfer: StoreTransfer, block_hashes: Sequence[bytes]) -> str | None:
        if xfer.domain != self.domain:
            return f"domain {xfer.domain!r}, this replica's is {self.domain!r}"
        if xfer.layout != self.layout:
            return f"layout {xfer.layout}, this replica's is {self.layout}"
        if xfer.chunk_tokens != self.chunk_tokens:
            return f"chunk of {xfer.chunk_tokens} tokens, this replica's is {self.chunk_tokens}"
        if len(xfer.keys) * self.blocks_per_chunk > len(block_hashes):
            return f"{len(xfer.keys)} chunks named, the prompt has fewer"
        for c, key in enumerate(xfer.keys):
            if chunk_key(block_hashes, self.blocks_per_chunk, c) != key:
                return f"chunk {c} is not this prompt's (hash seed or prompt differ)"
        return None

    def finished(self, req_id: str) -> None:
        self._waiting.pop(req_id, None)
        self._settled.discard(req_id)
