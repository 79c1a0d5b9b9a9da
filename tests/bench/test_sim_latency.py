"""The latency model and the scheduler, in-process on a fast clock (no HTTP).

Assertions are about the model's structure (cached tokens are cheaper, concurrent prefills
share the engine, the running limit queues requests): they check what the simulator computes,
not how fast this machine runs. So each test runs on an event loop whose clock is virtual: it
jumps to the next timer instead of sleeping, and a stall of this machine (a busy CI runner
once turned a 4x into a 6.4x) passes no simulated time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from kvroute.bench.sim.cache import TieredPrefixCache
from kvroute.bench.sim.hashing import EngineHasher
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.scheduler import Scheduler, SimRequest
from kvroute.indexer.wire import Event, Medium

BS = 16
HASHER = EngineHasher()
# 1e-3 simulated s per prefill token; time runs 4x faster than the wall clock. (At 20x, a
# 6 ms stall of a busy machine was 0.12 simulated s: enough to fail a bound in CI.)
LAT = LatencyModel(
    prefill_s_per_token=1e-3,
    load_cpu_s_per_token=1e-4,
    load_storage_s_per_token=4e-4,
    time_scale=0.25,
)


T = TypeVar("T")


class _VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` only moves when the loop would otherwise sleep.

    A wait for the next timer advances the clock by that timeout at once; the selector is
    polled without blocking. Nothing in these tests waits on I/O, so the loop never has to
    wait for anything but its timers.
    """

    def __init__(self) -> None:
        self._virtual_now = 0.0
        loop = self

        class _Selector(selectors.DefaultSelector):
            def select(self, timeout: float | None = None) -> list[Any]:
                if timeout is not None and timeout > 0:
                    loop._virtual_now += timeout
                return super().select(0)

        super().__init__(_Selector())

    def time(self) -> float:
        return self._virtual_now


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the virtual clock: tasks left pending are cancelled at the end."""
    loop = _VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()


def test_the_virtual_clock_passes_only_the_time_waited() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(123.0)
        return loop.time() - start

    assert _run(main()) == pytest.approx(123.0, abs=1e-6)


def _scheduler(
    *, gpu: int = 256, cpu: int = 0, max_num_seqs: int = 8
) -> tuple[Scheduler, list[list[Event]]]:
    published: list[list[Event]] = []
    cache = TieredPrefixCache(BS, gpu, cpu)
    return Scheduler(
        cache, LAT, max_num_seqs=max_num_seqs, publish=published.append, hasher=HASHER
    ), published


def _request(tokens: list[int], max_tokens: int = 1) -> SimRequest:
    return SimRequest(
        prompt=tokens, digests=HASHER.chain(tokens, BS), extra_keys=None, max_tokens=max_tokens
    )


async def _serve(s: Scheduler, req: SimRequest) -> float:
    """Run a request through prefill; returns its simulated TTFT."""
    end = await s.prefill(req)
    s.finish(req, [7] * req.max_tokens)
    return end - req.arrival


def test_prefill_cost_follows_uncached_tokens() -> None:
    async def main() -> tuple[float, float, int]:
        s, _ = _scheduler()
        s.start()
        tokens = list(range(1000, 1000 + 20 * BS + 1))
        cold = await _serve(s, _request(tokens))
        warm_req = _request(tokens)
        warm = await _serve(s, warm_req)
        await s.stop()
        return cold, warm, warm_req.cached_tokens

    cold, warm, cached = _run(main())
    assert cached == 20 * BS
    assert cold == pytest.approx(321 * 1e-3)  # every token computed
    assert warm == pytest.approx(1e-3)  # only the last one


def test_cpu_hits_pay_load_time() -> None:
    async def main() -> tuple[float, dict[Medium, int]]:
        s, _ = _scheduler(gpu=24, cpu=64)
        s.start()
        a = list(range(20 * BS + 1))
        await _serve(s, _request(a))
        await _serve(s, _request(list(range(5000, 5000 + 20 * BS + 1))))  # pushes a to CPU
        req = _request(a)
        ttft = await _serve(s, req)
        await s.stop()
        return ttft, dict(req.cached_by_tier or {})

    ttft, by_tier = _run(main())
    assert sum(by_tier.values()) == 20 * BS
    assert by_tier[Medium.CPU] > 10 * BS  # most of it was pushed out of the 24 device blocks
    # Loaded tokens cost 1e-4 each, device hits nothing, the one computed token 1e-3: a tenth
    # of the 0.321 s it takes to recompute the prompt.
    assert ttft == pytest.approx(by_tier[Medium.CPU] * 1e-4 + 1e-3)
    assert ttft < 0.321 / 8


def test_concurrent_prefills_share_the_engine() -> None:
    async def main() -> tuple[float, list[float]]:
        s, _ = _scheduler()
        s.start()
        alone = await _serve(s, _request(list(range(10_000, 10_000 + 200))))
        together = await asyncio.gather(
            *(
                _serve(s, _request(list(range(20_000 * (i + 1), 20_000 * (i + 1) + 200))))
                for i in range(4)
            )
        )
        await s.stop()
        return alone, list(together)

    alone, together = _run(main())
    # Four equal prefills started together share the engine: all finish after four times one.
    assert alone == pytest.approx(0.2)
    assert together == pytest.approx([4 * alone] * 4)


def test_running_limit_queues_requests() -> None:
    async def main() -> tuple[int, int]:
        s, _ = _scheduler(max_num_seqs=2)
        s.start()
        reqs = [_request(list(range(30_000 * (i + 1), 30_000 * (i + 1) + 100))) for i in range(5)]
        tasks = [asyncio.create_task(s.prefill(r)) for r in reqs]
        await asyncio.sleep(0.001)
        running, waiting = s.num_running, s.num_waiting
        await asyncio.gather(*tasks[:2])
        for r in reqs:
            s.abort(r)
        await s.stop()
        return running, waiting

    running, waiting = _run(main())
    assert (running, waiting) == (2, 3)


def test_sibling_hit_waits_for_blocks_being_computed() -> None:
    """vLLM caches blocks when it schedules them; a request that hits blocks still being
    computed cannot finish its prefill before them."""

    async def main() -> tuple[float, float, int]:
        s, _ = _scheduler()
        s.start()
        tokens = list(range(40_000, 40_000 + 30 * BS + 1))
        first, second = _request(tokens), _request(tokens)
        t1 = asyncio.create_task(s.prefill(first))
        await asyncio.sleep(0.002)
        end2 = await s.prefill(second)
        end1 = await t1
        s.finish(first, [1])
        s.finish(second, [1])
        await s.stop()
        return end1, end2, second.cached_tokens

    end1, end2, cached = _run(main())
    assert cached == 30 * BS
    assert end2 >= end1 - 1e-6


def test_events_published_per_step() -> None:
    async def main() -> list[list[Event]]:
        s, published = _scheduler()
        s.start()
        await _serve(s, _request(list(range(3 * BS + 1)), max_tokens=BS))
        await s.stop()
        return published

    batches = _run(main())
    # Admission caches the prompt's blocks; finish caches the block the output completed.
    assert len(batches) == 2
    assert [len(b[0].block_hashes) for b in batches] == [3, 1]


def test_abort_of_a_running_long_request_frees_it() -> None:
    """A client that goes away mid-stream (a deadline, a timeout) aborts a request that is
    already running: its blocks must be freed. A long prompt is a long chain of parent
    blocks; once, the abort formatted the request's repr through that chain and died of
    RecursionError, leaving the replica busy forever."""

    async def main() -> tuple[int, int, int]:
        s, _ = _scheduler(gpu=1024)
        s.start()
        req = _request(list(range(50_000, 50_000 + 600 * BS + 1)))
        await s.prefill(req)
        running = s.num_running
        s.abort(req)
        s.abort(req)  # twice (the decode loop and the disconnect may both abort): harmless
        after = s.num_running
        used = s.cache.usage()
        await s.stop()
        return running, after, used

    running, after, used = _run(main())
    assert (running, after) == (1, 0)
    assert used == 0
