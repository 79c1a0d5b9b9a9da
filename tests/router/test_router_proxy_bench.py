"""bench/proxy_bench.py end to end with tiny counts: three processes, JSON keys, no errors.
(The speed targets are judged from the benchmark's JSON, never here.)"""

from __future__ import annotations

import argparse

from bench.proxy_bench import add_arguments, run


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
        ]
    )
    result = run(args)
    for key in ("added_p50_ms_c64", "added_p99_ms_c64", "rps", "added_p50_ms_c1", "rps_direct"):
        assert isinstance(result[key], float), key
    for side in ("direct", "routed"):
        for phase in ("c1", "c64_paced", "c64"):
            assert result[side][phase]["errors"] == 0
            assert result[side][phase]["requests"] > 0
    assert result["rps"] > 0
