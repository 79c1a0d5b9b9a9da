"""The many-replica section of ``kvroute bench connector``, at a tiny size: real replica
processes on one real directory, each loading chunks another one wrote."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.bench.connector_bench import add_arguments
from kvroute.bench.connector_shared import shared_contention


@pytest.mark.timeout(180)
def test_shared_contention_measures_each_replica_count(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--chunk-tokens",
            "64",
            "--block-size",
            "32",
            "--layers",
            "2",
            "--kv-heads",
            "2",
            "--head-size",
            "16",
            "--shared-replicas",
            "1,2",
            "--shared-chunks",
            "3",
        ]
    )
    base = {"disk_baseline_write_gbps": 1.0, "disk_baseline_read_gbps": 2.0}
    out = shared_contention(args, tmp_path, base)
    for n in (1, 2):
        assert out[f"shared_{n}_write_gbps"] > 0 and out[f"shared_{n}_read_gbps"] > 0
        assert out[f"shared_{n}_write_vs_baseline"] == out[f"shared_{n}_write_gbps"]
        assert out[f"shared_{n}_read_vs_baseline"] == out[f"shared_{n}_read_gbps"] / 2.0
    assert not (tmp_path / "shared-2").exists()  # cleaned up
