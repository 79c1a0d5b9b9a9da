"""A simulated fleet shared by the simulator's HTTP, event and fault tests.

One fleet subprocess per test session (start-up loads transformers: seconds); tests that
change a replica (faults, kills) use their own replica and put it back. Small caches, so a
handful of requests already exercises eviction, demotion and promotion; a fast clock
(time_scale 0.05), so the latency model's seconds pass in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel


@pytest.fixture(scope="session")
def sim_fleet() -> Iterator[SimFleet]:
    config = SimFleetConfig(
        replicas=3,
        block_size=16,
        gpu_blocks=48,
        cpu_blocks=24,
        storage_blocks=48,
        max_num_seqs=8,
        max_model_len=8192,
        latency=LatencyModel(time_scale=0.05),
        stream_interval_s=0.005,
    )
    with SimFleet(config) as fleet:
        yield fleet
