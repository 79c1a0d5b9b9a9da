"""LoopLagMonitor: the benchmark's measure of how punctual its own loops were."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvroute.bench.sim.fleet import SimFleet
from kvroute.bench.sim.looplag import LoopLagMonitor


def test_snapshot_percentiles_and_reset() -> None:
    mon = LoopLagMonitor()
    assert mon.snapshot() == {"samples": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    for ms in range(1, 101):
        mon.record(ms / 1000)
    mon.record(-0.5)  # a timer never fires early; clock noise is clamped to zero
    snap = mon.snapshot()
    assert snap["samples"] == 101
    assert snap["p50_ms"] == 50.0
    assert snap["p99_ms"] == 99.0
    assert snap["max_ms"] == 100.0
    mon.reset()
    assert mon.snapshot()["samples"] == 0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(interval_s=0)


def test_a_blocked_loop_shows_as_lag() -> None:
    """A 60 ms stall of the loop (what a starved core does to it) is a lag of at least
    50 ms: the monitor's 10 ms timer cannot fire before the loop is free again."""

    async def scenario() -> dict[str, float]:
        mon = LoopLagMonitor(interval_s=0.01)
        mon.start()
        await asyncio.sleep(0.05)
        time.sleep(0.06)  # blocks the loop on purpose
        await asyncio.sleep(0.05)
        await mon.stop()
        return mon.snapshot()

    snap = asyncio.run(scenario())
    assert snap["samples"] >= 2
    assert snap["max_ms"] >= 50.0


def test_fleet_reports_its_loop_lag_and_reset_clears_it(sim_fleet: SimFleet) -> None:
    time.sleep(0.2)
    before = sim_fleet.loop_lag()
    assert set(before) == {"samples", "p50_ms", "p99_ms", "max_ms"}
    assert before["samples"] >= 5
    sim_fleet.reset_caches()
    assert sim_fleet.loop_lag()["samples"] < before["samples"]
