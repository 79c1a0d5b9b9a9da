"""Simulated fleets that several test folders start alike."""

from __future__ import annotations

from kvroute.bench.sim.fleet import SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel


def dp_fleet_config() -> SimFleetConfig:
    """One data-parallel server with two ranks (``sim-0#dp0``, ``sim-0#dp1``), each engine
    with its own event sockets, at a fast simulated clock."""
    return SimFleetConfig(
        replicas=1,
        data_parallel_size=2,
        block_size=16,
        gpu_blocks=512,
        max_num_seqs=8,
        max_model_len=8192,
        latency=LatencyModel(time_scale=0.05),
        stream_interval_s=0.005,
    )
