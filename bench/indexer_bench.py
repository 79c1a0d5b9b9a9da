"""``kvroute bench indexer``: ingest throughput, lookup latency and memory of the prefix index.

- ingest: real msgpack frames as vLLM 0.32 publishes them (a BlockStored per prefill step with
  one ``extra_keys`` entry per block, one BlockRemoved per evicted block; every fourth prompt's
  first chunks offloaded to a CPU tier and later evicted from it, as kvroute's connector
  announces them) are decoded and applied on one thread; the figure is block events (blocks
  stored + blocks removed, any tier) per second. ``decode_ceiling_blocks_per_s`` is the same
  frames through msgspec's raw msgpack decode alone, measured in the same run: what one thread
  can do before the index does anything.
- lookup: a 2,048-block request against an index of >= 1M (block, replica) entries, where one
  replica holds the whole prefix and the others part of it. ``lookup_p99_us_2048`` times the walk
  over the request's keys (the router computes keys once per request); the figure with keying
  included is reported beside it.
- memory: tracemalloc's count of what building the index allocated, per entry.
- scale: ``--ingest-replicas`` spreads the ingest over that many replicas, each with its own
  stream (the block events split evenly), applied in turn as a router's feeds deliver them;
  with ``--replicas`` as large, lookup and memory are measured at that fleet size too
  (docs/benchmarks.md, "Index at 1,000 replicas"); ``--scale-replicas`` measures the lookups
  at that fleet size, and (``--decide``) a routing decision over it (bench/decide_scale.py).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import statistics
import threading
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import msgspec

from kvroute.bench.decide_scale import decide_at_scale
from kvroute.indexer import native_core
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys, block_keys, pack_tokens, python_keying
from kvroute.indexer.wire import (
    BlockRemoved,
    BlockStored,
    Medium,
    decode_batch,
    decode_frames,
    encode_batch,
)
from kvroute.indexer.wire import encode_frames as frames_of
from kvroute.router.common import gc_policy

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--entries", type=int, default=1_200_000, help="index size for lookups")
    parser.add_argument("--ingest-blocks", type=int, default=400_000, help="blocks to ingest")
    parser.add_argument(
        "--ingest-replicas",
        type=int,
        default=1,
        help="replicas the ingested blocks are spread over (each its own stream)",
    )
    parser.add_argument("--lookups", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cores",
        default="native,python",
        help="index cores to measure in the same run (those available: native needs the "
        "extension); the top-level figures are the first one's",
    )
    parser.add_argument(
        "--scale-replicas",
        type=int,
        default=1000,
        help="the fleet of the second ingest and lookup, per core (0: none)",
    )
    parser.add_argument(
        "--scale-lookups", type=int, default=20, help="lookups timed at --scale-replicas"
    )
    parser.add_argument(
        "--ingest-rounds", type=int, default=3, help="ingest runs per core, the cores in turn"
    )
    parser.add_argument(
        "--decide",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time Router.decide over the --scale-replicas fleet too (bench/decide_scale.py)",
    )


def _fake_hash(rng: random.Random) -> int:
    return rng.getrandbits(64)


_CHUNK = 16  # blocks per offloaded chunk (256 tokens of 16)


def _build_frames(
    n_blocks: int, block_size: int, rng: random.Random, keep: int = 4096
) -> tuple[list[list[bytes]], int]:
    """A replica's stream: prompts stored in steps of up to 32 blocks, then evicted block by
    block once it holds over ``keep`` (a quarter of them at a time); every fourth prompt also
    offloads its first chunks to the CPU tier, evicted from there later.

    Returns the frames and the number of block events they hold.
    """
    frames: list[list[bytes]] = []
    seq = 0
    block_events = 0
    stored: list[int] = []
    offloaded: list[list[int]] = []
    n_prompts = 0
    while block_events < n_blocks:
        prompt_blocks = rng.randint(8, 128)
        parent = None
        hashes_all: list[int] = []
        tokens_all: list[int] = []
        for start in range(0, prompt_blocks, 32):
            count = min(32, prompt_blocks - start)
            hashes = [_fake_hash(rng) for _ in range(count)]
            tokens = [rng.randrange(128_000) for _ in range(count * block_size)]
            event = BlockStored(hashes, parent, tokens, block_size, extra_keys=[None] * count)
            payload = encode_batch([event], ts=time.time())
            frames.append(frames_of("kv@bench", seq, payload))
            seq += 1
            parent = hashes[-1]
            stored.extend(hashes)
            hashes_all += hashes
            tokens_all += tokens
            block_events += count
        n_prompts += 1
        if n_prompts % 4 == 0:
            events: list[BlockStored | BlockRemoved] = []
            for c in range(len(hashes_all) // _CHUNK):
                members = hashes_all[c * _CHUNK : (c + 1) * _CHUNK]
                events.append(
                    BlockStored(
                        members,
                        None if c == 0 else hashes_all[c * _CHUNK - 1],
                        tokens_all[c * _CHUNK * block_size : (c + 1) * _CHUNK * block_size],
                        block_size,
                        medium=Medium.CPU,
                        extra_keys=[None] * _CHUNK,
                        locality="LOCAL",
                    )
                )
                offloaded.append(members)
                block_events += _CHUNK
            if len(offloaded) > 64:
                for members in offloaded[:16]:
                    events.append(BlockRemoved(members, Medium.CPU))
                    block_events += len(members)
                offloaded = offloaded[16:]
            if events:
                frames.append(frames_of("kv@bench", seq, encode_batch(events, ts=time.time())))
                seq += 1
        if len(stored) > keep:
            victims, stored = stored[: keep // 4], stored[keep // 4 :]
            payload = encode_batch([BlockRemoved([h]) for h in victims], ts=time.time())
            frames.append(frames_of("kv@bench", seq, payload))
            seq += 1
            block_events += len(victims)
    return frames, block_events


def _streams(
    args: argparse.Namespace, rng: random.Random
) -> tuple[list[tuple[str, list[bytes]]], int]:
    """Every replica's frames, interleaved one frame of each replica in turn (as the feeds
    of a router deliver them), and the block events they hold."""
    replicas = args.ingest_replicas
    if replicas == 1:  # the single-stream figure, as it always was
        frames, block_events = _build_frames(args.ingest_blocks, args.block_size, rng)
        return [("bench", f) for f in frames], block_events
    per = max(1, args.ingest_blocks // replicas)
    keep = min(4096, max(64, per // 4))  # each stream evicts, however short
    streams, block_events = [], 0
    for r in range(replicas):
        frames, n = _build_frames(per, args.block_size, rng, keep=keep)
        streams.append([(f"replica-{r}", f) for f in frames])
        block_events += n
    tagged = [f for group in itertools.zip_longest(*streams) for f in group if f is not None]
    return tagged, block_events


def _apply_frames(index: InMemoryPrefixIndex, frames: list[tuple[str, bytes]]) -> None:
    for replica, message in frames:
        frame = decode_frames(message)
        batch = decode_batch(frame.payload)
        result = index.apply(replica, batch.events)
        if result.rejected:
            raise RuntimeError(f"bench events rejected: {result.rejected[:3]}")


def _apply_in_threads(
    index: InMemoryPrefixIndex, frames: list[tuple[str, bytes]], threads: int
) -> None:
    """The frames split by replica over ``threads`` threads (a replica's frames stay in order
    on one thread, as a router's feed threads apply them), each decoding and applying its own."""
    groups: dict[str, int] = {}
    parts: list[list[tuple[str, bytes]]] = [[] for _ in range(threads)]
    for replica, message in frames:
        parts[groups.setdefault(replica, len(groups) % threads)].append((replica, message))
    errors: list[BaseException] = []

    def work(part: list[tuple[str, bytes]]) -> None:
        try:
            _apply_frames(index, part)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(part,)) for part in parts]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


@contextmanager
def _one_cpu() -> Iterator[bool]:
    """The process's threads (those started inside, which inherit it) on one CPU, the first it
    may use; yields False, changing nothing, where affinity is not available or one CPU is all
    it has."""
    get = getattr(os, "sched_getaffinity", None)
    cpus = get(0) if get is not None else set()
    if len(cpus) < 2:
        yield False
        return
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield True
    finally:
        os.sched_setaffinity(0, cpus)


def _ingest(
    args: argparse.Namespace, rng: random.Random, cores: list[str], threads: int = 1
) -> dict[str, dict[str, Any]]:
    """The same frames decoded alone (msgspec, the ceiling) and through each core's apply,
    ``--ingest-rounds`` times with the cores taking turns, so a busy machine's load falls on
    both alike. Each core's figure is its median round; ``ingest_vs_decode_ceiling`` is the
    median of its rounds' ratios to the ceiling measured right before. ``threads`` > 1:
    the replicas' frames applied by that many threads at once."""
    frames, block_events = _streams(args, rng)
    raw_decode = msgspec.msgpack.Decoder().decode
    rounds: dict[str, list[tuple[float, float, InMemoryPrefixIndex]]] = {c: [] for c in cores}
    for _ in range(args.ingest_rounds):
        for core in cores:
            gc.collect()
            started = time.perf_counter()
            for _, message in frames:
                raw_decode(decode_frames(message).payload)
            ceiling = time.perf_counter() - started
            index = InMemoryPrefixIndex(core=core)
            gc.collect()
            with _keying_of(core):
                started = time.perf_counter()
                if threads > 1:
                    _apply_in_threads(index, frames, threads)
                else:
                    _apply_frames(index, frames)
                elapsed = time.perf_counter() - started
            rounds[core].append((ceiling, elapsed, index))
    out: dict[str, dict[str, Any]] = {}
    for core, runs in rounds.items():
        ceiling = statistics.median(r[0] for r in runs)
        elapsed = statistics.median(r[1] for r in runs)
        index = runs[-1][2]
        out[core] = {
            "ingest_replicas": len(index.replicas()),
            "ingest_index_entries": index.entries,
            "ingest_estimated_bytes_per_entry": round(
                index.estimated_bytes() / max(1, index.entries), 1
            ),
            "decode_ceiling_blocks_per_s": round(block_events / ceiling),
            "ingest_vs_decode_ceiling": round(statistics.median(c / e for c, e, _ in runs), 3),
            "ingest_blocks_per_s": round(block_events / elapsed),
            "ingest_batches_per_s": round(len(frames) / elapsed),
            "ingest_block_events": block_events,
            "ingest_seconds": round(elapsed, 3),
        }
    return out


def _keying_of(core: str) -> AbstractContextManager[None]:
    """Keys hashed by the core measured: the Python core keys in Python too."""
    return python_keying() if core == "python" else nullcontext()


def _fill_index(
    index: InMemoryPrefixIndex, args: argparse.Namespace, rng: random.Random
) -> list[int]:
    """Spread ``args.entries`` entries over the replicas; returns the 2,048-block probe prompt."""
    bs = args.block_size
    probe = [rng.randrange(128_000) for _ in range(2048 * bs)]
    per_replica = args.entries // args.replicas
    for r in range(args.replicas):
        name = f"replica-{r}"
        # Replica 0 holds the whole probe prefix, others a replica-dependent part of it.
        held = 2048 if r == 0 else (2048 * r) // args.replicas
        hashes = [_fake_hash(rng) for _ in range(held)]
        parent = None
        for start in range(0, held, 256):
            chunk = hashes[start : start + 256]
            tokens = probe[start * bs : (start + len(chunk)) * bs]
            index.apply(name, [BlockStored(chunk, parent, tokens, bs)])
            parent = chunk[-1]
        filler = per_replica - held
        while filler > 0:
            count = min(256, filler)
            hashes = [_fake_hash(rng) for _ in range(count)]
            tokens = [rng.randrange(128_000) for _ in range(count * bs)]
            index.apply(name, [BlockStored(hashes, None, tokens, bs)])
            filler -= count
    return probe


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _lookup(
    args: argparse.Namespace, rng: random.Random, cores: list[str], lookups: int
) -> dict[str, dict[str, Any]]:
    """Per core: fill an index of that core (its tables: native words or dicts) with the same
    entries, measure what it allocated (tracemalloc sees both), then time its lookups."""
    seed = rng.random()
    out: dict[str, dict[str, Any]] = {}
    for core in cores:
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        index = InMemoryPrefixIndex(core=core)
        probe = _fill_index(index, args, random.Random(seed))  # keyed natively: not timed
        gc.collect()
        allocated = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        entries = index.entries
        replicas = index.replicas()
        with _keying_of(core):
            request = RequestKeys(probe)
            keys = request.keys(args.block_size)  # keyed once, as the router does per request
            walk_us: list[float] = []
            full_us: list[float] = []
            matched = None
            # one lookup first, untimed: it plans the lookup (indexer/index/plans.py), which a
            # router does once per layout change, not per request
            index.lookup(request, replicas=replicas)
            for _ in range(lookups):
                t0 = time.perf_counter()
                matched = index.lookup(request, replicas=replicas)
                t1 = time.perf_counter()
                index.lookup(probe)
                t2 = time.perf_counter()
                walk_us.append((t1 - t0) * 1e6)
                full_us.append((t2 - t1) * 1e6)
        assert matched is not None
        if matched["replica-0"].blocks != 2048:
            raise RuntimeError("lookup did not find the probe prefix on replica-0")
        out[core] = {
            "index_entries": entries,
            "index_replicas": len(replicas),
            "lookup_blocks": len(keys),
            "lookup_p50_us_2048": round(statistics.median(walk_us), 1),
            "lookup_p99_us_2048": round(_percentile(walk_us, 0.99), 1),
            "lookup_with_keying_p50_us_2048": round(statistics.median(full_us), 1),
            "lookup_with_keying_p99_us_2048": round(_percentile(full_us, 0.99), 1),
            "bytes_per_entry": round(allocated / entries, 1),
            "estimated_bytes_per_entry": round(index.estimated_bytes() / entries, 1),
        }
        del index, request, matched
    return out


def _chat_lookup(
    args: argparse.Namespace, rng: random.Random, cores: list[str]
) -> dict[str, dict[str, Any]]:
    """A chat-shaped probe (docs/benchmarks.md, "Index at 1,000 replicas"): a 64-block system
    prompt on every replica, ten 200-block histories after it on each, and a 264-block
    probe of one replica's history: the holders change twice along the prompt. 200 lookups
    per core, each on an index of its own tables filled alike."""
    bs = args.block_size
    seed = rng.random()
    out: dict[str, dict[str, Any]] = {}
    for core in cores:
        fill = random.Random(seed)
        system = [fill.randrange(128_000) for _ in range(64 * bs)]
        index = InMemoryPrefixIndex(core=core)
        probe: list[int] = []
        for r in range(args.replicas):  # keyed natively: not timed
            name = f"replica-{r}"
            for h in range(10):
                history = [fill.randrange(128_000) for _ in range(200 * bs)]
                tokens = system + history
                hashes = [_fake_hash(fill) for _ in range(264)]
                index.apply(name, [BlockStored(hashes, None, tokens, bs)])
                if r == args.replicas // 2 and h == 0:
                    probe = tokens
        replicas = index.replicas()
        with _keying_of(core):
            request = RequestKeys(probe)
            request.keys(bs)
            times: list[float] = []
            index.lookup(request, replicas=replicas)  # planned once, untimed (as above)
            for _ in range(200):
                started = time.perf_counter()
                matched = index.lookup(request, replicas=replicas)
                times.append((time.perf_counter() - started) * 1e6)
        if matched[f"replica-{args.replicas // 2}"].blocks != 264:
            raise RuntimeError("the chat probe was not found on its replica")
        out[core] = {
            "chat_lookup_p50_us_264": round(statistics.median(times), 1),
            "chat_lookup_p99_us_264": round(_percentile(times, 0.99), 1),
            "chat_index_entries": index.entries,
        }
        del index
    return out


def _keying(args: argparse.Namespace, rng: random.Random, cores: list[str]) -> dict[str, Any]:
    """Keying 2**20 tokens, the cores in turn, three rounds (median): from a list of ints
    (packing included, as the figure always was) and from packed bytes (a request's tokens
    are packed once, ``RequestKeys``)."""
    tokens = [rng.randrange(128_000) for _ in range(1 << 20)]
    packed = pack_tokens(tokens)
    times: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in cores}
    for _ in range(3):
        for core in cores:
            with _keying_of(core):
                started = time.perf_counter()
                block_keys(tokens, args.block_size)
                middle = time.perf_counter()
                block_keys(packed, args.block_size)
                ended = time.perf_counter()
            times[core][0].append(middle - started)
            times[core][1].append(ended - middle)
    return {
        core: {
            "keying_tokens_per_s": round(len(tokens) / statistics.median(listed)),
            "keying_packed_tokens_per_s": round(len(tokens) / statistics.median(from_bytes)),
        }
        for core, (listed, from_bytes) in times.items()
    }


def _cores(args: argparse.Namespace) -> list[str]:
    cores = [c.strip() for c in args.cores.split(",") if c.strip()]
    if not cores or any(c not in ("native", "python") for c in cores):
        raise ValueError("--cores: a list of 'native' and 'python'")
    if native_core.NATIVE is None:
        cores = [c for c in cores if c == "python"] or ["python"]
    return cores


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.ingest_replicas < 1 or args.replicas < 1:
        raise ValueError("--replicas and --ingest-replicas must be >= 1")
    # As `kvroute serve` does at startup (router/common/gc_policy.py): the process's
    # long-lived objects leave the collector's generations, so a lookup's tail is the index's
    # own garbage collection, not a scan of this process's modules, and young collections run
    # as often as they do in the router.
    before = gc_policy.apply()
    try:
        return _run(args)
    finally:
        gc_policy.restore(before)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    cores = _cores(args)
    per_core: dict[str, dict[str, Any]] = {core: {"block_size": args.block_size} for core in cores}
    for core, figures in _keying(args, random.Random(args.seed), cores).items():
        per_core[core].update(figures)
    for core, figures in _ingest(args, random.Random(args.seed + 1), cores).items():
        per_core[core].update(figures)
    for core, figures in _lookup(args, random.Random(args.seed + 2), cores, args.lookups).items():
        per_core[core].update(figures)
    if args.scale_replicas > 0:
        scale = argparse.Namespace(**vars(args))
        scale.replicas = scale.ingest_replicas = args.scale_replicas
        n = args.scale_replicas
        for core, ingest in _ingest(scale, random.Random(args.seed + 3), cores).items():
            per_core[core][f"ingest_{n}_replicas_blocks_per_s"] = ingest["ingest_blocks_per_s"]
            per_core[core][f"ingest_{n}_replicas_vs_decode_ceiling"] = ingest[
                "ingest_vs_decode_ceiling"
            ]
            per_core[core][f"ingest_{n}_replicas_index_entries"] = ingest["ingest_index_entries"]
        # The same frames applied by two threads, as two feed threads of a router would.
        for core, ingest in _ingest(scale, random.Random(args.seed + 3), cores, 2).items():
            one = per_core[core][f"ingest_{n}_replicas_blocks_per_s"]
            two = ingest["ingest_blocks_per_s"]
            per_core[core][f"ingest_{n}_replicas_2_threads_blocks_per_s"] = two
            per_core[core][f"ingest_{n}_replicas_2_threads_vs_1"] = round(two / one, 3)
            per_core[core][f"ingest_{n}_replicas_2_threads_index_entries"] = ingest[
                "ingest_index_entries"
            ]
        # Again with the process on one CPU: what the two threads lose is the GIL's hand-offs
        # between cores (the cache moves with it), not only their taking turns.
        with _one_cpu() as pinned:
            if pinned:
                for core, ingest in _ingest(scale, random.Random(args.seed + 3), cores, 2).items():
                    one = per_core[core][f"ingest_{n}_replicas_blocks_per_s"]
                    two = ingest["ingest_blocks_per_s"]
                    per_core[core][f"ingest_{n}_replicas_2_threads_one_cpu_blocks_per_s"] = two
                    per_core[core][f"ingest_{n}_replicas_2_threads_one_cpu_vs_1"] = round(
                        two / one, 3
                    )
        found = _lookup(scale, random.Random(args.seed + 4), cores, args.scale_lookups)
        for core, figures in found.items():
            for name in ("lookup_p50_us_2048", "lookup_p99_us_2048", "bytes_per_entry"):
                per_core[core][f"{name}_{n}_replicas"] = figures[name]
            per_core[core][f"index_entries_{n}_replicas"] = figures["index_entries"]
        chat = _chat_lookup(scale, random.Random(args.seed + 5), cores)
        for core, figures in chat.items():
            for name, value in figures.items():
                per_core[core][f"{name}_{n}_replicas"] = value
        decided = decide_at_scale(n, random.Random(args.seed + 6)) if args.decide else {}
    else:
        decided = {}
    result: dict[str, Any] = dict(per_core[cores[0]])
    result["index_core"] = cores[0]
    # on the index core a router runs here (native_core.CORE), whichever cores were measured
    result.update({f"{name}_{args.scale_replicas}_replicas": v for name, v in decided.items()})
    result["cores"] = per_core
    if "native" in per_core and "python" in per_core:
        result["native_vs_python"] = _ratios(per_core["native"], per_core["python"])
    result["targets"] = {
        "ingest_blocks_per_s >= 600000": result["ingest_blocks_per_s"] >= 600_000,
        "lookup_p99_us_2048 <= 500": result["lookup_p99_us_2048"] <= 500,
        "bytes_per_entry <= 200": result["bytes_per_entry"] <= 200,
        "keying_tokens_per_s >= 5000000": result["keying_tokens_per_s"] >= 5_000_000,
    }
    native = per_core.get("native")
    if native is not None:
        result["native_targets"] = _native_targets(native, args.scale_replicas)
    return result


def _ratios(native: dict[str, Any], python: dict[str, Any]) -> dict[str, float]:
    """native / python for each figure where more is better, python / native where less is."""
    out: dict[str, float] = {}
    for name, value in native.items():
        other = python.get(name)
        if not isinstance(value, int | float) or not isinstance(other, int | float):
            continue
        if name.startswith(("decode_ceiling", "ingest_batches", "lookup_blocks")):
            continue  # the same work for both cores, or a count
        if name.endswith("_per_s") or name.endswith("vs_decode_ceiling"):
            out[f"{name} (native/python)"] = round(value / other, 2) if other else 0.0
        elif "lookup_" in name:
            out[f"{name} (python/native)"] = round(other / value, 2) if value else 0.0
    return out


def _native_targets(native: dict[str, Any], n: int) -> dict[str, bool]:
    """Issue 36's targets for the native core (docs/benchmarks.md says which are met)."""
    targets = {
        "ingest_blocks_per_s >= 3000000": native["ingest_blocks_per_s"] >= 3_000_000,
        "lookup_p99_us_2048 <= 100": native["lookup_p99_us_2048"] <= 100,
        "bytes_per_entry <= 64": native["bytes_per_entry"] <= 64,
    }
    if n == 1000:
        targets["ingest_1000_replicas_blocks_per_s >= 2000000"] = (
            native["ingest_1000_replicas_blocks_per_s"] >= 2_000_000
        )
        targets["lookup_p99_us_2048_1000_replicas <= 2000"] = (
            native["lookup_p99_us_2048_1000_replicas"] <= 2000
        )
        targets["ingest_1000_replicas_2_threads_vs_1 >= 1.7"] = (
            native["ingest_1000_replicas_2_threads_vs_1"] >= 1.7
        )
        targets["chat_lookup_p99_us_264_1000_replicas <= 500"] = (
            native["chat_lookup_p99_us_264_1000_replicas"] <= 500
        )
    return targets
