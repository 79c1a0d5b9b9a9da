"""A simulated vLLM replica (kvroute.bench.sim) served in-process for the router tests.

The router tests talk to the simulator's replica, the one fake of vLLM's API in the project:
the same HTTP API, KV events and tokenization as the benchmark fleet. This module only runs
it on a thread of its own (an event loop per replica) and shapes it for tests: model
``tiny``, max_model_len 4096, three output tokens by default, and a latency model that costs
nothing, so a request takes only what its injected faults (``ReplicaFaults``) add.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from kvroute.bench.sim.api import request_token_ids
from kvroute.bench.sim.dp import make_server
from kvroute.bench.sim.faults import ReplicaFaults, RequestLog
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.replica import SimReplica, SimReplicaConfig
from kvroute.bench.sim.tokenizer import SimTokenizer

__all__ = ["ReplicaFaults", "SimServer"]

_NO_LATENCY = LatencyModel(
    prefill_s_per_token=0.0,
    load_cpu_s_per_token=0.0,
    load_storage_s_per_token=0.0,
    decode_s_per_step=0.0,
    decode_s_per_seq=0.0,
)


@functools.cache
def _tokenizer(model_dir: str) -> SimTokenizer:
    """One tokenizer per model directory, shared by the replicas of a test session."""
    return SimTokenizer(Path(model_dir))


class SimServer:
    """One simulated replica on ``127.0.0.1``, on its own event-loop thread.

    ``stop`` makes the port refuse connections (the replica's caches are kept); ``start``
    again serves on the same port, as a restarted vLLM would. ``close`` ends the thread.
    """

    def __init__(
        self,
        name: str,
        model_dir: str | Path,
        *,
        model: str = "tiny",
        loras: Sequence[str] = (),
        chat_template: str | None = None,
        scale_out: bool = False,
        faults: ReplicaFaults | None = None,
        latency: LatencyModel | None = None,
        nixl: bool = True,
    ) -> None:
        self.name = name
        config = SimReplicaConfig(
            name=name,
            model=model,
            block_size=16,
            max_model_len=4096,
            latency=latency or _NO_LATENCY,
            default_max_tokens=3,
            stream_interval_s=0.0,
            loras=tuple(loras),
            chat_template=chat_template,
            scale_out=scale_out,
            nixl=nixl,
        )
        replica = make_server(config, _tokenizer(str(model_dir)))
        assert isinstance(replica, SimReplica)
        self.replica = replica
        if faults is not None:
            self.replica.faults = faults
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name=f"sim-{name}"
        )
        self._thread.start()
        self._started = False

    # --- what tests read and change ----------------------------------------------------------

    @property
    def url(self) -> str:
        return self.replica.url

    @property
    def port(self) -> int:
        return self.replica.port

    @property
    def events(self) -> str:
        return self.replica.events_endpoint

    @property
    def replay(self) -> str:
        return self.replica.replay_endpoint

    @property
    def faults(self) -> ReplicaFaults:
        return self.replica.faults

    @property
    def seen(self) -> RequestLog:
        return self.replica.seen

    @property
    def cancelled(self) -> int:
        """Requests stopped before their end (the client went away)."""
        return self.replica.requests_aborted

    def tokenize_prompt(self, body: dict[str, Any]) -> list[int]:
        """The ids this replica's ``/tokenize`` answers for ``body``."""
        return request_token_ids(self.replica, body)

    def generated_text(self, body: dict[str, Any], max_tokens: int = 3) -> list[str]:
        """The text of each token this replica generates for ``body``'s prompt."""
        tok = self.replica.tokenizer
        return [tok.decode([t]) for t in tok.generate(self.tokenize_prompt(body), max_tokens)]

    # --- lifecycle ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def start(self) -> SimServer:
        if self._started:
            self._run(self.replica.restart())
        else:
            self._run(self.replica.start("127.0.0.1", 0))
            self._started = True
        return self

    def stop(self) -> None:
        if self.replica.alive:
            self._run(self.replica.stop())

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
