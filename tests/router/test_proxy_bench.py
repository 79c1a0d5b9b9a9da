"""bench/proxy_bench.py end to end with tiny counts: three processes, JSON keys, no errors.
(The speed targets are judged from the benchmark's JSON, never here.)"""

from __future__ import annotations

import argparse

from kvroute.bench.proxy_bench import add_arguments, run


def test_proxy_bench_runs_and_reports(tiny_model_dir) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--requests-c1",
            "50",
            "--requests-c64",
            "300",
            "--warmup",
            "50",
            "--prompts",
            "16",
            "--tokenizer",
            str(tiny_model_dir),
            "--time-limit-s",
            "20",
            "--overload-s",
            "1",
            "--smg",
        ]
    )
    result = run(args)
    for key in ("added_p50_ms_c64", "added_p99_ms_c64", "rps", "added_p50_ms_c1", "rps_direct"):
        assert isinstance(result[key], float), key
    for side in ("direct", "routed"):
        assert result[side]["c64"]["errors"] == 0
        assert result[side]["c64"]["requests"] > 0
    # Added latency is measured in pairs (the same request direct and through the router, back
    # to back): every pair answered on both sides, and the router adds time to each pair's
    # median rather than the difference of two separate runs' percentiles.
    for phase in ("c1", "c64_paced"):
        paired = result["paired"][phase]
        assert paired["pairs"] > 0
        assert paired["direct"]["errors"] == 0 and paired["routed"]["errors"] == 0
        assert paired["direct"]["requests"] == paired["routed"]["requests"] == paired["pairs"]
        assert paired["added_p50_ms"] > 0, paired
        assert paired["added_p50_ms"] <= paired["added_p99_ms"]
    assert result["rps"] > 0
    # Offered twice the upstream's capacity, the limited router refuses some with 429 (and
    # Retry-After), serves the rest, and never fails one; the unlimited one queues them all.
    over = result["overload"]
    limited, unlimited = over["limited"], over["unlimited"]
    assert over["capacity_rps"] > 0 and limited["offered"] > 0
    assert limited["failed"] == 0 and unlimited["failed"] == 0
    assert set(limited["statuses"]) == {"200", "429"}, limited["statuses"]
    assert set(unlimited["statuses"]) == {"200"}, unlimited["statuses"]
    assert 0 < over["served_share"] < 1 and over["served_p99_ms"] is not None
    # SGLang's gateway (smg, installed by the bench extra) measured beside kvroute on the
    # same upstream: every request answered, and the ratio reported.
    smg = result["smg"]
    assert smg["version"] == "1.13.0" and smg["policy"] == "cache_aware"
    assert smg["throughput"]["c64"]["errors"] == 0 and smg["rps"] > 0
    for phase in ("c1", "c64_paced"):
        assert smg["paired"][phase]["routed"]["errors"] == 0
        assert smg["paired"][phase]["pairs"] > 0
    assert result["rps_ratio_kvroute_over_smg"] == round(result["rps"] / smg["rps"], 3)
