"""kvroute as a drop-in gateway: every vLLM endpoint through the router, against the simulator.

A real router (in-process app under uvicorn, real HTTP on 127.0.0.1) in front of a simulated
fleet of two replicas (bench/sim: vLLM's HTTP API, prefix cache and KV event stream), driven
with the official ``openai`` client where it has the API. Checked: the Responses API (create,
retrieve, cancel, delete reach the replica that stored the response, whether the router
learned the id from the create answer, from the first SSE event, or must ask around),
Anthropic messages, embeddings and pooling routed by their prompt's cached prefix, a batch of
prompts routed as a whole to the replica holding most of it with predicted == delivered, an
unknown path answered by a replica (its own 404 body, ``x-kvroute-replica``), and streaming
passed through unchanged.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread

MODEL = "kvroute-sim"
BLOCK = 16
# Long shared text: many blocks, so "which replica holds it" is unambiguous.
SYSTEM = "You answer questions about prefix caches and the replicas that keep them warm. " * 8


@dataclass
class Gateway:
    sim: SimFleet
    router: ServerThread

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def app(self) -> Any:
        return self.router.app

    def replica_url(self, name: str) -> str:
        return next(r.url for r in self.sim.replicas if r.name == name)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="sk-test", max_retries=0)

    def entries(self, name: str) -> int:
        stats = httpx.get(f"{self.url}/index/stats", timeout=10).json()
        return int(stats["replicas"][name]["entries"] or 0)

    def accuracy(self, name: str) -> dict[str, Any]:
        stats = httpx.get(f"{self.url}/index/stats", timeout=10).json()
        return stats["replicas"][name]["accuracy"]

    def warm(self, name: str, path: str, body: dict[str, Any]) -> None:
        """Serve ``body`` on replica ``name`` directly (not through the router), then wait
        until the router's index has its blocks (from the replica's KV events) and its view
        of the fleet is idle again. On a busy machine a health scrape can catch the warm-up
        request running; until the next scrape the router rightly counts it as queued work
        on ``name`` (a queue the prefix's saving need not outweigh), which is not what the
        tests measure."""
        before = self.entries(name)
        resp = httpx.post(self.replica_url(name) + path, json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        deadline = time.monotonic() + 10
        while self.entries(name) <= before:
            assert time.monotonic() < deadline, "the router never indexed the warmed prefix"
            time.sleep(0.05)
        registry = self.app.state.service.registry
        while any(r.pending for r in registry.healthy()):
            assert time.monotonic() < deadline, "the router still counts requests pending"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    config = SimFleetConfig(
        replicas=2,
        block_size=BLOCK,
        gpu_blocks=2048,
        max_model_len=4096,
        default_max_tokens=4,
        latency=LatencyModel(time_scale=0.01),
        stream_interval_s=0.001,
    )
    with SimFleet(config) as sim:
        settings = RouterSettings(
            replicas=[
                ReplicaConfig(
                    url=r.url, events=r.events, replay=r.replay, topic=r.topic, name=r.name
                )
                for r in sim.replicas
            ],
            health_interval_s=0.2,
            health_timeout_s=2.0,
            tokenizer_check_on_start=False,
            default_block_size=BLOCK,
        )
        app = create_app(settings, tokenizer=LocalTokenizer(sim.model_dir))
        with ServerThread(app) as router:
            deadline = time.monotonic() + 20
            while len(app.state.service.registry.healthy()) < 2:
                assert time.monotonic() < deadline, "the simulated replicas never got healthy"
                time.sleep(0.05)
            yield Gateway(sim, router)


def _least_loaded_first(gw: Gateway) -> str:
    healthy = gw.app.state.service.registry.healthy()
    return min(healthy, key=lambda r: r.pending).name


# --- Responses API ------------------------------------------------------------------------


def test_responses_follow_ups_reach_the_replica_that_stored_the_response(gw: Gateway) -> None:
    """Created (through the router) on sim-1, the replica holding the conversation's prefix,
    while an unpinned request would go to sim-0 (least loaded first, ties in fleet order):
    retrieve, cancel and delete all reach sim-1, and predicted == delivered cached tokens."""
    instructions = SYSTEM + " Responses test one."
    gw.warm(
        "sim-1",
        "/v1/responses",
        {"model": MODEL, "instructions": instructions, "input": "warm", "max_output_tokens": 2},
    )
    assert _least_loaded_first(gw) == "sim-0"
    client = gw.client()
    created = client.responses.with_raw_response.create(
        model=MODEL, instructions=instructions, input="What is a block?", max_output_tokens=4
    )
    assert created.headers["x-kvroute-replica"] == "sim-1"
    response = created.parse()
    assert response.id.startswith("resp_") and response.output_text
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens > 0
    assert gw.app.state.response_homes.get(response.id) == "sim-1"
    acc = gw.accuracy("sim-1")
    assert acc["reported_requests"] == 1
    assert acc["predicted_on_reported"] == acc["delivered_cached_tokens"] > 0

    got = client.responses.with_raw_response.retrieve(response.id)
    assert got.headers["x-kvroute-replica"] == "sim-1"
    assert got.parse().id == response.id
    assert got.parse().output_text == response.output_text

    with pytest.raises(openai.BadRequestError) as cancelled:
        client.responses.cancel(response.id)  # vLLM: a finished response cannot be cancelled
    assert cancelled.value.response.headers["x-kvroute-replica"] == "sim-1"
    assert "Cannot cancel a synchronous response" in cancelled.value.message

    deleted = client.responses.with_raw_response.delete(response.id)
    assert deleted.headers["x-kvroute-replica"] == "sim-1"
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(response.id)
    assert gone.value.response.headers["x-kvroute-replica"] == "sim-1"
    assert gone.value.body["param"] == "response_id"  # the replica's own error, passed on


def test_an_unknown_response_id_is_asked_of_each_replica(gw: Gateway) -> None:
    """Stored on sim-1 behind the router's back: the router asks sim-0 first (404), then
    sim-1, and remembers the answer; an id nobody holds gets the last replica's 404."""
    direct = httpx.post(
        gw.replica_url("sim-1") + "/v1/responses",
        json={"model": MODEL, "input": "stored elsewhere", "max_output_tokens": 2},
        timeout=30,
    ).json()
    assert gw.app.state.response_homes.get(direct["id"]) is None
    got = httpx.get(f"{gw.url}/v1/responses/{direct['id']}", timeout=30)
    assert got.status_code == 200, got.text
    assert got.headers["x-kvroute-replica"] == "sim-1"
    assert got.json() == direct
    assert gw.app.state.response_homes.get(direct["id"]) == "sim-1"

    missing = httpx.get(f"{gw.url}/v1/responses/resp_nobody", timeout=30)
    assert missing.status_code == 404
    assert missing.headers["x-kvroute-replica"] in ("sim-0", "sim-1")
    assert missing.json()["error"]["message"] == "Response with id 'resp_nobody' not found."


def test_a_continuation_goes_where_the_previous_response_is(gw: Gateway) -> None:
    client = gw.client()
    first = httpx.post(
        gw.replica_url("sim-1") + "/v1/responses",
        json={"model": MODEL, "input": "first turn, stored on sim-1", "max_output_tokens": 2},
        timeout=30,
    ).json()
    follow = client.responses.with_raw_response.create(
        model=MODEL, input="second turn", previous_response_id=first["id"], max_output_tokens=2
    )
    assert follow.headers["x-kvroute-replica"] == "sim-1"
    assert follow.parse().previous_response_id == first["id"]


def test_streamed_responses_pass_through_unchanged_and_teach_the_id(gw: Gateway) -> None:
    body = {
        "model": MODEL,
        "instructions": SYSTEM + " Streaming test.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Stream it."}]}],
        "max_output_tokens": 4,
        "stream": True,
    }
    via = httpx.post(f"{gw.url}/v1/responses", json=body, timeout=30)
    assert via.status_code == 200 and via.headers["content-type"].startswith("text/event-stream")
    served = via.headers["x-kvroute-replica"]
    direct = httpx.post(gw.replica_url(served) + "/v1/responses", json=body, timeout=30)

    def events(text: str) -> list[tuple[str, dict[str, Any]]]:
        out = []
        for block in (b for b in text.split("\n\n") if b):
            name, data = block.split("\n", 1)
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[7:], json.loads(data[6:])))
        return out

    ours, theirs = events(via.text), events(direct.text)
    assert [e for e, _ in ours] == [e for e, _ in theirs]
    assert ours[0][0] == "response.created" and ours[-1][0] == "response.completed"
    deltas = "".join(d["delta"] for e, d in ours if e == "response.output_text.delta")
    assert deltas == "".join(d["delta"] for e, d in theirs if e == "response.output_text.delta")
    rid = ours[0][1]["response"]["id"]
    assert gw.app.state.response_homes.get(rid) == served
    # The streamed usage is read too: predicted vs delivered counts this request.
    assert ours[-1][1]["response"]["usage"]["input_tokens_details"]["cached_tokens"] >= 0


# --- other endpoints routed by their prompt ------------------------------------------------


def test_embeddings_and_pooling_go_to_the_replica_holding_their_prefix(gw: Gateway) -> None:
    text = SYSTEM + " Embedding test: the quick brown fox."
    gw.warm("sim-1", "/v1/embeddings", {"model": MODEL, "input": text})
    assert _least_loaded_first(gw) == "sim-0"
    client = gw.client()
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=[text, text + " again"])
    assert raw.headers["x-kvroute-replica"] == "sim-1"
    embedded = raw.parse()
    assert [d.index for d in embedded.data] == [0, 1]
    assert len(embedded.data[0].embedding) == 8  # the sim's vectors, decoded from base64
    pooled = httpx.post(f"{gw.url}/pooling", json={"model": MODEL, "input": text}, timeout=30)
    assert pooled.status_code == 200, pooled.text
    assert pooled.headers["x-kvroute-replica"] == "sim-1"
    assert pooled.json()["data"][0]["object"] == "pooling"


def test_anthropic_messages_are_routed_by_the_rendered_conversation(gw: Gateway) -> None:
    system = SYSTEM + " Anthropic test."
    warm = {"model": MODEL, "system": system, "messages": [{"role": "user", "content": "w"}]}
    gw.warm("sim-1", "/v1/messages", {**warm, "max_tokens": 2})
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "system": [{"type": "text", "text": system}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    }
    before = gw.accuracy("sim-1")
    resp = httpx.post(f"{gw.url}/v1/messages", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvroute-replica"] == "sim-1"
    out = resp.json()
    assert out["type"] == "message" and out["content"][0]["type"] == "text"
    after = gw.accuracy("sim-1")
    predicted = after["predicted_on_reported"] - before["predicted_on_reported"]
    delivered = after["delivered_cached_tokens"] - before["delivered_cached_tokens"]
    assert predicted == delivered == out["usage"]["cache_read_input_tokens"] > 0


def test_a_batch_goes_to_the_replica_holding_most_of_it(gw: Gateway) -> None:
    """Two of three prompts are cached on sim-1, none on sim-0: the whole batch goes to sim-1
    (one request, one replica, choices in prompt order), and the cached tokens vLLM reports
    for a batch (its last prompt's) are the ones predicted for that prompt."""
    prompts = [SYSTEM + f" Batch prompt {i}: tell me about blocks." for i in range(3)]
    for p in prompts[1:]:
        gw.warm("sim-1", "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 1})
    before = gw.accuracy("sim-1")
    raw = gw.client().completions.with_raw_response.create(
        model=MODEL, prompt=[p + " Go." for p in prompts], max_tokens=2
    )
    assert raw.headers["x-kvroute-replica"] == "sim-1"
    completion = raw.parse()
    assert [c.index for c in completion.choices] == [0, 1, 2]
    delivered = completion.usage.prompt_tokens_details.cached_tokens
    after = gw.accuracy("sim-1")
    predicted = after["predicted_on_reported"] - before["predicted_on_reported"]
    assert after["reported_requests"] == before["reported_requests"] + 1
    assert delivered > 0 and abs(predicted - delivered) < BLOCK
    routed = httpx.post(
        f"{gw.url}/debug/route",
        json={"model": MODEL, "prompt": [p + " Go." for p in prompts]},
        timeout=30,
    ).json()
    views = {v["name"]: v for v in routed["replicas"]}
    # Summed over the batch: sim-1 holds the two warmed prompts (and now all three).
    assert views["sim-1"]["predicted_cached_tokens"] > views["sim-0"]["predicted_cached_tokens"]
    assert routed["prompt_tokens"] == completion.usage.prompt_tokens


# --- passthrough ---------------------------------------------------------------------------


def test_any_other_path_is_the_replicas_to_answer(gw: Gateway) -> None:
    version = httpx.get(f"{gw.url}/version", timeout=10)
    assert version.status_code == 200 and version.json() == {"version": "0.32.0"}
    assert version.headers["x-kvroute-replica"] in ("sim-0", "sim-1")

    unknown = httpx.post(f"{gw.url}/v1/not/a/route?x=1", json={"model": MODEL}, timeout=10)
    direct = httpx.post(gw.replica_url("sim-0") + "/v1/not/a/route?x=1", json={"model": MODEL})
    assert unknown.status_code == 404
    assert unknown.content == direct.content  # the replica's own body, untouched
    assert unknown.headers["x-kvroute-replica"] in ("sim-0", "sim-1")

    # Method and query string pass as sent; a HEAD answer ends with its headers (no hang).
    head = httpx.head(f"{gw.url}/version", timeout=10)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["x-kvroute-replica"] in ("sim-0", "sim-1")
    wrong = httpx.put(f"{gw.url}/v1/responses?probe=1", json={}, timeout=10)
    assert wrong.status_code == 405 and wrong.headers["x-kvroute-replica"] in ("sim-0", "sim-1")

    # The router's own refusals never name a replica: a client can tell them apart.
    refused = httpx.post(f"{gw.url}/v1/responses", content=b"not json", timeout=10)
    assert refused.status_code == 400 and "x-kvroute-replica" not in refused.headers
    assert refused.json()["error"]["type"] == "BadRequestError"
