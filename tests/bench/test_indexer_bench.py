"""``kvroute bench indexer`` at small sizes: the ingest spread over many replicas (the
1,000-replica figures in docs/benchmarks.md come from this option) and its refusals."""

from __future__ import annotations

import argparse
import os

import pytest

from kvroute.bench import indexer_bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    indexer_bench.add_arguments(parser)
    return parser.parse_args(
        [
            "--entries",
            "20000",
            "--ingest-blocks",
            "30000",
            "--lookups",
            "5",
            "--scale-replicas",
            "0",
            *argv,
        ]
    )


def test_ingest_over_many_replicas_fills_an_index_of_that_many() -> None:
    """Every replica's stream is applied without a rejected event (the bench raises on one),
    each replica ends holding blocks, and the per-replica streams evict as the single one
    does, so the index holds fewer entries than blocks were stored."""
    one = indexer_bench.run(_args())
    many = indexer_bench.run(_args("--replicas", "40", "--ingest-replicas", "40"))
    assert one["ingest_replicas"] == 1 and many["ingest_replicas"] == 40
    assert many["index_replicas"] == 40
    for result in (one, many):
        assert result["ingest_block_events"] >= 30000 * 0.9
        assert result["ingest_blocks_per_s"] > 0 and result["ingest_index_entries"] > 0
        assert 0 < result["ingest_estimated_bytes_per_entry"] < 2000
        assert 0 < result["bytes_per_entry"] < 2000
    assert many["ingest_index_entries"] < many["ingest_block_events"] / 2


def test_replica_counts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ingest-replicas"):
        indexer_bench.run(_args("--ingest-replicas", "0"))


def test_both_cores_are_measured_in_the_same_run() -> None:
    """The native and the Python core side by side (the same frames, the same filled index),
    with their ratios, and the figures at a second, larger fleet."""
    result = indexer_bench.run(_args("--scale-replicas", "30", "--scale-lookups", "2"))
    assert result["index_core"] == "native"
    native, python = result["cores"]["native"], result["cores"]["python"]
    for figures in (native, python):
        assert figures["ingest_blocks_per_s"] > 0
        assert figures["lookup_p99_us_2048"] > 0
        assert figures["ingest_30_replicas_blocks_per_s"] > 0
        assert figures["lookup_p99_us_2048_30_replicas"] > 0
        assert figures["chat_lookup_p99_us_264_30_replicas"] > 0
        # Two threads (the replicas split between them, each replica's frames in order on
        # one) apply the same frames into the same index as one thread.
        assert figures["ingest_30_replicas_2_threads_blocks_per_s"] > 0
        assert figures["ingest_30_replicas_2_threads_vs_1"] > 0
        assert (
            figures["ingest_30_replicas_2_threads_index_entries"]
            == figures["ingest_30_replicas_index_entries"]
            > 0
        )
        if len(os.sched_getaffinity(0)) > 1:  # the same on one CPU, where there are two
            assert figures["ingest_30_replicas_2_threads_one_cpu_vs_1"] > 0
    assert native["chat_index_entries_30_replicas"] == python["chat_index_entries_30_replicas"]
    # the same events and the same index, whichever core applies and walks them
    assert native["ingest_index_entries"] == python["ingest_index_entries"]
    assert native["index_entries_30_replicas"] == python["index_entries_30_replicas"]
    ratios = result["native_vs_python"]
    assert ratios["lookup_p50_us_2048 (python/native)"] > 0
    assert ratios["ingest_blocks_per_s (native/python)"] > 0
    assert set(result["native_targets"]) >= {"lookup_p99_us_2048 <= 100", "bytes_per_entry <= 64"}
    # A routing decision over the same fleet size: it chose the prompt's holder (else the
    # bench raises), and the lookup is a part of it.
    assert result["decide_index_core_30_replicas"] == "native"
    assert result["decide_p90_ms_30_replicas"] >= result["decide_p50_ms_30_replicas"] > 0
    assert 0 < result["decide_lookup_share_30_replicas"] < 1


def test_the_python_core_alone() -> None:
    result = indexer_bench.run(_args("--cores", "python"))
    assert result["index_core"] == "python" and list(result["cores"]) == ["python"]
    assert "native_vs_python" not in result and "native_targets" not in result
