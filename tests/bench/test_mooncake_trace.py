"""Mooncake-format traces: the shipped trace parses and is what our generator writes; prompts
have the trace's prefix structure token for token; bad files are refused naming their line;
a short replay through real routers on the simulated fleet tells the policies apart."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvroute.bench import routing_bench
from kvroute.bench.sim.tokenizer import SimTokenizer, ensure_model_dir
from kvroute.bench.workloads import mooncake_trace as mt
from kvroute.bench.workloads import trace_gen
from kvroute.deploy import cli

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}


@pytest.fixture(scope="module")
def tokenizer() -> SimTokenizer:
    return SimTokenizer(ensure_model_dir())


@pytest.fixture(scope="module")
def words(tokenizer: SimTokenizer) -> list[str]:
    return mt.single_token_words(tokenizer.tok)


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _req(line: int, ids: list[int], length: int, ts: float = 0.0) -> mt.TraceRequest:
    return mt.TraceRequest(line, ts, length, 8, tuple(ids))


def test_the_shipped_trace_is_our_generators_output() -> None:
    requests = mt.read_trace(trace_gen.SHIPPED_TRACE)
    assert 200 <= len(requests) <= 400
    assert trace_gen.SHIPPED_TRACE.read_text().splitlines() == [
        json.dumps(x, separators=(", ", ": ")) for x in trace_gen.generate()
    ]
    # Its structure: tenants' prompts share their first blocks, conversations grow.
    firsts = {r.hash_ids[0] for r in requests}
    assert len(firsts) <= trace_gen.TraceShape().tenants
    # A later turn holds every full block of the turn before it, then new ones.
    grown = [
        (a, b)
        for a in requests
        for b in requests
        if b.timestamp_ms > a.timestamp_ms
        and len(b.hash_ids) > len(a.hash_ids)
        and b.hash_ids[: a.input_length // 512] == a.hash_ids[: a.input_length // 512]
        and a.hash_ids[0] == b.hash_ids[0]
        and a.input_length // 512 > 3
    ]
    assert len(grown) > 50


def test_the_generator_is_seeded() -> None:
    a = trace_gen.generate(trace_gen.TraceShape(conversations=10, seed=3))
    assert a == trace_gen.generate(trace_gen.TraceShape(conversations=10, seed=3))
    assert a != trace_gen.generate(trace_gen.TraceShape(conversations=10, seed=4))
    with pytest.raises(ValueError, match="turns"):
        trace_gen.generate(trace_gen.TraceShape(turns=(3, 1)))


def test_limit_takes_the_first_requests(tmp_path: Path) -> None:
    path = _write(tmp_path, *({**GOOD, "timestamp": t} for t in (0, 5, 5, 9)))
    assert [r.timestamp_ms for r in mt.read_trace(path, limit=3)] == [0, 5, 5]
    assert [r.line for r in mt.read_trace(path)] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: a line must be a JSON object"),
        (json.dumps({**GOOD, "hash_ids": None} | {"timestamp": 1}), "line 2: hash_ids must be"),
        (json.dumps({"timestamp": 1, "input_length": 3}), "line 2: missing output_length"),
        (json.dumps({**GOOD, "input_length": -5}), "line 2: input_length is negative"),
        (json.dumps({**GOOD, "input_length": 2_000_000}), "line 2: input_length 2000000 is beyond"),
        (json.dumps({**GOOD, "output_length": 10**6}), "line 2: output_length 1000000 is beyond"),
        (json.dumps({**GOOD, "output_length": 1.5}), "line 2: output_length must be an integer"),
        (json.dumps({**GOOD, "input_length": True}), "line 2: input_length must be an integer"),
        (json.dumps({**GOOD, "input_length": 0, "hash_ids": []}), "line 2: input_length is 0"),
        (json.dumps({**GOOD, "input_length": 1025}), "line 2: 2 hash_ids for input_length 1025"),
        (json.dumps({**GOOD, "hash_ids": [1, -2]}), "line 2: hash_ids must be a list of integers"),
        (json.dumps({**GOOD, "timestamp": "soon"}), "line 2: timestamp must be"),
    ],
)
def test_a_bad_line_is_refused_by_its_number(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, GOOD, line, GOOD)
    with pytest.raises(mt.TraceError, match=message):
        mt.read_trace(path)


def test_timestamps_going_backwards_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, {**GOOD, "timestamp": 10}, "", {**GOOD, "timestamp": 4})
    with pytest.raises(mt.TraceError, match=r"line 3: timestamp 4 ms is before line 1's 10 ms"):
        mt.read_trace(path)


def test_empty_missing_and_limit(tmp_path: Path) -> None:
    with pytest.raises(mt.TraceError, match="no requests"):
        mt.read_trace(_write(tmp_path, ""))
    with pytest.raises(mt.TraceError, match="cannot read trace"):
        mt.read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(mt.TraceError, match="--limit must be >= 1"):
        mt.read_trace(_write(tmp_path, GOOD), limit=0)


def test_prompts_have_the_traces_prefix_structure(
    tokenizer: SimTokenizer, words: list[str]
) -> None:
    text = mt.BlockText(words)
    a = _req(1, [7, 8, 9], 1300)
    b = _req(2, [7, 8, 10], 1100)  # same first two blocks, then other content
    c = _req(3, [7, 8, 9], 1300)
    ids = {
        r.line: tokenizer.encode_chat([{"role": "user", "content": text.prompt(r)}])
        for r in (a, b, c)
    }
    assert ids[1] == ids[3]  # equal hash ids, equal tokens
    plain = [len(tokenizer.encode(text.prompt(r), add_special_tokens=False)) for r in (a, b)]
    assert plain == [1300, 1100]  # the trace's input_length, exactly
    other = tokenizer.encode_chat([{"role": "user", "content": text.prompt(_req(4, [99], 50))}])

    def common(x: list[int], y: list[int]) -> int:
        return next(i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q)

    head = common(ids[1], other)  # the chat template's tokens before the content
    assert head < 10
    assert common(ids[1], ids[2]) == head + 1024  # two blocks shared, then the third differs
    # Unequal ids differ even when the seeded words would not: the id opens its block.
    assert text.block(5)[:6] != text.block(6)[:6]


def test_blocks_scale_and_partial_blocks_keep_their_id(
    tokenizer: SimTokenizer, words: list[str]
) -> None:
    small = mt.BlockText(words, block_tokens=64)
    req = _req(1, [1, 2, 3], 1024 + 256)  # two full blocks and half a block
    prompt = small.prompt(req)
    assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 64 + 64 + 32
    tiny_tail = _req(2, [1, 2, 4], 1024 + 1)  # one token of block 4 still spells its id
    assert small.prompt(tiny_tail).split()[128:134] == small.block(4)[:6]
    with pytest.raises(ValueError, match="block_tokens must be"):
        mt.BlockText(words, block_tokens=8)
    with pytest.raises(ValueError, match="single-token words"):
        mt.BlockText(words[:10])


def test_workload_times_follow_the_trace(words: list[str]) -> None:
    reqs = [_req(1, [1], 100, 1000.0), _req(2, [1], 100, 3000.0), _req(3, [2], 100, 5000.0)]
    w = mt.build_workload(reqs, words, speedup=2.0)
    assert [s.start_s for s in w.sessions] == [0.0, 1.0, 2.0]
    assert [s.turns[0].max_tokens for s in w.sessions] == [8, 8, 8]
    assert w.sessions[0].turns[0].content == w.sessions[1].turns[0].content
    with pytest.raises(mt.TraceError, match="--speedup"):
        mt.build_workload(reqs, words, speedup=0)


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    routing_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bad_trace_flags_fail_before_anything_starts(tmp_path: Path) -> None:
    trace = str(_write(tmp_path, GOOD))
    for extra, message in [
        (["--workloads", "chat"], "replaces --workloads"),
        (["--rate-scale", "2"], "--speedup"),
        (["--speedup", "-1"], "--speedup must be"),
        (["--trace-block-tokens", "4"], "--trace-block-tokens must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            routing_bench.run(_bench_args("--trace", trace, "--out-dir", str(tmp_path), *extra))


def test_the_command_line_prints_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(tmp_path, GOOD, {**GOOD, "input_length": 5000})
    code = cli.main(["bench", "routing", "--trace", str(trace), "--out-dir", str(tmp_path)])
    assert code == 2
    assert "line 2: 2 hash_ids for input_length 5000" in capsys.readouterr().err


def test_trace_gen_writes_a_readable_trace(tmp_path: Path) -> None:
    out = tmp_path / "gen.jsonl"
    code = cli.main(["bench", "trace-gen", "--output", str(out), "--conversations", "5", "--json"])
    assert code == 0
    assert len(mt.read_trace(out)) >= 5


def test_replay_on_the_simulated_fleet_tells_policies_apart(tmp_path: Path) -> None:
    """The shipped trace's first 80 requests, blocks shrunk to 64 tokens, twice as fast, on
    the quick fleet: kvroute keeps each conversation and tenant where its blocks are."""
    result = routing_bench.run(
        _bench_args(
            "--preset",
            "quick",
            "--trace",
            str(trace_gen.SHIPPED_TRACE),
            "--limit",
            "80",
            "--speedup",
            "2",
            "--trace-block-tokens",
            "64",
            "--policies",
            "round_robin,kvroute",
            "--no-plots",
            "--out-dir",
            str(tmp_path),
        )
    )
    rows = {r["policy"]: r for r in result["results"]}
    assert set(rows) == {"round_robin", "kvroute"}
    for row in rows.values():
        assert row["workload"] == "trace"
        assert row["completed"] == row["requests"] == 80
        assert row["token_mismatches"] == 0
        assert row["sizes"]["requests"] == 80
    # Both saw the same prompts; kvroute reused more of them.
    assert rows["kvroute"]["prompt_tokens"] == rows["round_robin"]["prompt_tokens"]
    assert rows["kvroute"]["hit_rate"] > rows["round_robin"]["hit_rate"] + 0.1
    assert rows["kvroute"]["hit_rate"] <= rows["kvroute"]["upper_bound_hit_rate"] + 1e-9
