"""The simulator's step model (``LatencyModel.max_num_batched_tokens`` > 0,
bench/sim/scheduler.py): vLLM's scheduler runs the running requests' prefill first, so a
prompt that arrives behind a long one waits for it; every step costs a forward pass's fixed
cost; decodes wait for the step's prefill chunk; a NIXL pull waits beside the engine
(``WAITING_FOR_REMOTE_KVS``), not in it. In-process, on the virtual clock of
test_sim_latency.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from kvroute.bench.sim.cache import TieredPrefixCache
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.scheduler import Scheduler
from tests.bench.test_sim_latency import BS, HASHER, LAT, _request, _run, _serve

STEPS = dataclasses.replace(LAT, max_num_batched_tokens=8192)
STEP = STEPS.decode_s_per_step  # a step's fixed cost, with no request running


def _scheduler(lat: LatencyModel = STEPS) -> Scheduler:
    cache = TieredPrefixCache(BS, 4096, 0)
    return Scheduler(cache, lat, max_num_seqs=64, publish=lambda _: None, hasher=HASHER)


def test_a_short_prompt_behind_a_long_one_waits_for_it() -> None:
    async def main(lat: LatencyModel) -> tuple[float, float]:
        s = _scheduler(lat)
        s.start()
        long = asyncio.create_task(_serve(s, _request(list(range(1000)))))
        await asyncio.sleep(0.1 * LAT.time_scale)
        short = await _serve(s, _request(list(range(50_000, 50_050))))
        first = await long
        await s.stop()
        return first, short

    first, short = _run(main(STEPS))
    assert first == pytest.approx(1.0 + STEP)  # its tokens and one step's fixed cost
    # Admitted 0.1 s in, with the long one running: it runs when the long one is done.
    assert short == pytest.approx(1.0 + STEP - 0.1 + 0.05 + STEPS.decode_step(1))
    # Processor sharing (the default model) let it through at half speed instead.
    _, short_ps = _run(main(LAT))
    assert short_ps == pytest.approx(2 * 0.05)
    assert short > 8 * short_ps


def test_a_pull_waits_beside_the_engine_not_in_it() -> None:
    """A decode leg pulling 320 tokens does not hold up a prompt admitted after it; it
    computes its last token after the pull, behind what became runnable first."""

    async def main() -> tuple[float, float, float]:
        s = _scheduler()
        s.start()
        decode = _request(list(range(20 * BS + 1)))
        decode.pull_tokens = 20 * BS
        pulled = asyncio.create_task(_serve(s, decode))
        other = asyncio.create_task(_serve(s, _request(list(range(70_000, 70_100)))))
        a, b = await asyncio.gather(pulled, other)
        await s.stop()
        return a, b, decode.ready_at - decode.arrival

    a, b, pull = _run(main())
    assert pull == pytest.approx(20 * BS * STEPS.transfer_s_per_token)
    assert b == pytest.approx(0.1 + STEPS.decode_step(1))  # the pull took nothing from it
    assert a == pytest.approx(b + 1e-3 + STEP)  # its last token, after the other's prefill


def test_decodes_wait_for_the_steps_prefill_chunk() -> None:
    async def main(lat: LatencyModel) -> tuple[float, float]:
        s = _scheduler(lat)
        s.start()
        long = asyncio.create_task(_serve(s, _request(list(range(1000)))))
        await asyncio.sleep(0.2 * LAT.time_scale)
        during = s.prefill_step_s()
        await long
        after = s.prefill_step_s()
        await s.stop()
        return during, after

    during, after = _run(main(STEPS))
    assert during == pytest.approx(1.0 + STEP - 0.2)  # what is left of the chunk
    assert after == 0.0
    assert _run(main(LAT)) == (0.0, 0.0)  # processor sharing: decoding never waits
