"""The proxy against real HTTP upstreams: the official openai client, streaming and not,
headers, failover, mid-stream failure, client disconnects, ejection and return."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvroute.router.config import CostSettings
from tests.router.servers import wait_until
from tests.router.sim_fleet import Fleet, make_fleet, prefill_only
from tests.router.sim_replica import ReplicaFaults

LONG = "You are a careful assistant that answers questions about caches. " * 12


def _client(fleet: Fleet, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-test", max_retries=0, **kw)


def test_openai_client_completion_and_chat(fleet: Fleet) -> None:
    client = _client(fleet)
    expect = fleet.fakes[0].generated_text
    completion = client.completions.create(model="tiny", prompt=LONG + "Q1", max_tokens=3)
    assert completion.choices[0].text == "".join(expect({"prompt": LONG + "Q1"}))
    assert completion.usage is not None and completion.usage.prompt_tokens > 100
    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
    assert chat.choices[0].message.content == "".join(expect({"messages": messages}))
    served = {s.path for f in fleet.fakes for s in f.seen}
    assert served == {"/v1/completions", "/v1/chat/completions"}


def test_openai_client_streaming_with_usage(fleet: Fleet) -> None:
    client = _client(fleet)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": LONG}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages = [{"role": "user", "content": LONG}]
    assert text == "".join(fleet.fakes[0].generated_text({"messages": messages}))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 100


def test_stream_bytes_pass_through_unchanged(fleet: Fleet) -> None:
    body = {
        "model": "tiny",
        "prompt": "abc " * 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    via = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=10)
    assert via.headers["content-type"].startswith("text/event-stream")
    events = [e for e in via.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    served_by = via.headers["x-kvroute-replica"]
    direct = httpx.post(f"{fleet.servers[int(served_by[1:])].url}/v1/completions", json=body)

    def normalize(text: str) -> list[object]:
        out: list[object] = []
        for event in (e for e in text.split("\n\n") if e):
            if event == "data: [DONE]":
                out.append(event)
                continue
            chunk = json.loads(event[6:]) | {"id": 0, "created": 0}
            if chunk.get("usage"):
                chunk["usage"]["prompt_tokens_details"] = None  # the second pass hits cache
            out.append(chunk)
        return out

    assert normalize(via.text) == normalize(direct.text)
    usage = json.loads(events[-2][6:])["usage"]
    assert usage["prompt_tokens"] == len(fleet.fakes[0].tokenize_prompt(body))


def test_headers_request_id_and_authorization(fleet: Fleet) -> None:
    resp = httpx.post(
        f"{fleet.url}/v1/completions",
        json={"model": "tiny", "prompt": "hello"},
        headers={
            "Authorization": "Bearer secret-1",
            "X-Request-Id": "req-42",
            "Connection": "keep-alive",
            "X-Custom": "yes",
        },
    )
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "req-42"
    seen = next(s for f in fleet.fakes for s in f.seen)
    assert seen.headers["authorization"] == "Bearer secret-1"
    assert seen.headers["x-request-id"] == "req-42"
    assert seen.headers["x-custom"] == "yes"
    assert seen.headers.get("host", "").endswith(str(fleet.servers[0].port)) or seen.headers.get(
        "host", ""
    ).endswith(str(fleet.servers[1].port))
    created = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    assert len(created.headers["x-request-id"]) == 32


def test_replica_header_names_the_replica_that_answered(fleet: Fleet) -> None:
    """x-kvroute-replica is the registry name of the replica whose engine served the request,
    streamed or not, and a replica cannot forge it (its own header of that name is dropped)."""
    for fake in fleet.fakes:
        fake.faults.headers = {"x-kvroute-replica": "forged"}
    seen: set[str] = set()
    for i in range(6):
        for stream in (False, True):
            prompt = f"header {i} {stream}"
            resp = httpx.post(
                f"{fleet.url}/v1/completions",
                json={"model": "tiny", "prompt": prompt, "stream": stream},
                timeout=10,
            )
            assert resp.status_code == 200
            served_by = _receiver(fleet, prompt)
            assert resp.headers.get_list("x-kvroute-replica") == [served_by]
            seen.add(served_by)
    assert seen <= {"r0", "r1"} and seen


def _receiver(fleet: Fleet, prompt: str) -> str:
    """The name of the one replica that received a completion of ``prompt``."""
    (name,) = {f.name for f in fleet.fakes for s in f.seen if s.body.get("prompt") == prompt}
    return name


def test_models_union_tokenize_detokenize(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, loras=["sql-lora"]) as fleet:
        fleet.fakes[1].replica.config.model = "other"
        # Refresh model lists now rather than waiting for models_refresh_s.
        for r in fleet.service.registry:
            r.models_at = None
        wait_until(lambda: "other" in fleet.service.registry.known_models())
        ids = {m["id"] for m in httpx.get(f"{fleet.url}/v1/models").json()["data"]}
        assert ids == {"tiny", "other", "sql-lora"}
        tok = httpx.post(f"{fleet.url}/tokenize", json={"model": "tiny", "prompt": "hello world"})
        assert tok.status_code == 200
        tokens = tok.json()["tokens"]
        assert tokens == local_tokenizer.tok("hello world")["input_ids"]
        detok = httpx.post(f"{fleet.url}/detokenize", json={"model": "tiny", "tokens": tokens})
        assert detok.json()["prompt"] == "hello world"


def test_failover_before_first_byte(local_tokenizer) -> None:
    faults = [ReplicaFaults(fail_status=503), ReplicaFaults()]
    with make_fleet(local_tokenizer, faults=faults, policy="round_robin") as fleet:
        for i in range(4):
            resp = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": f"p{i}"}
            )
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-kvroute-replica"] == "r1"
        assert any(s.path == "/v1/completions" for s in fleet.fakes[0].seen)
        # A replica that stops listening is ejected by the first refused connection.
        fleet.servers[1].stop()
        fleet.fakes[0].faults.fail_status = None
        for i in range(3):
            resp = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": f"q{i}"}
            )
            assert resp.status_code == 200
            assert resp.headers["x-kvroute-replica"] == "r0"
        assert fleet.service.registry.get("r1").healthy is False
        metrics = httpx.get(f"{fleet.url}/metrics").text
        assert "kvroute_retries_total" in metrics


def test_all_attempts_fail_gives_503(local_tokenizer) -> None:
    faults = [ReplicaFaults(fail_status=503), ReplicaFaults(fail_status=503)]
    with make_fleet(local_tokenizer, faults=faults) as fleet:
        resp = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        # The last replica's own 503 is passed through unchanged (OpenAI schema from vLLM).
        assert resp.status_code == 503
        assert resp.json()["error"]["message"].startswith("injected failure")


def test_midstream_failure_ends_with_sse_error(local_tokenizer) -> None:
    faults = [ReplicaFaults(die_after_chunks=1)] * 2
    with make_fleet(local_tokenizer, faults=faults) as fleet:
        body = {"model": "tiny", "prompt": "hello", "stream": True, "max_tokens": 3}
        resp = httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=10)
        events = [e for e in resp.text.split("\n\n") if e]
        first = fleet.fakes[0].generated_text(body)[0]
        assert json.loads(events[0][6:])["choices"][0]["text"] == first
        assert len(events) == 3  # one chunk of three, then the router's error and [DONE]
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == 502 and "failed" in error["message"]
        assert events[-1] == "data: [DONE]"
        client = _client(fleet)
        with pytest.raises(openai.APIError):
            list(client.completions.create(model="tiny", prompt="hello", stream=True))


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_upstream(local_tokenizer, stream: bool) -> None:
    faults = [ReplicaFaults(prefill_delay_s=5.0)] * 2
    with make_fleet(local_tokenizer, faults=faults) as fleet:

        async def go() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                task = asyncio.create_task(
                    client.post(
                        f"{fleet.url}/v1/completions",
                        json={"model": "tiny", "prompt": "slow", "stream": stream},
                    )
                )
                await asyncio.sleep(0.5)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        started = time.monotonic()
        asyncio.run(go())
        wait_until(lambda: sum(f.cancelled for f in fleet.fakes) == 1, timeout_s=3)
        assert time.monotonic() - started < 4  # cancelled, not waited out
        wait_until(lambda: sum(r.in_flight for r in fleet.service.registry) == 0, timeout_s=3)
        assert 'outcome="cancelled"' in httpx.get(f"{fleet.url}/metrics").text


def test_ejection_and_return(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, unhealthy_after=2) as fleet:
        port = fleet.servers[0].port
        fleet.servers[0].stop()
        wait_until(lambda: fleet.stats()["replicas"]["r0"]["health"]["healthy"] is False)
        for i in range(4):
            resp = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": i * "z" + "a"}
            )
            assert resp.headers["x-kvroute-replica"] == "r1"
        fleet.fakes[1].faults.healthy = False
        wait_until(lambda: httpx.get(f"{fleet.url}/health").status_code == 503)
        resp = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "a"})
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "2"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
        back = fleet.servers[0].start()  # on the same port
        assert back.port == port
        wait_until(lambda: httpx.get(f"{fleet.url}/health").status_code == 200)
        resp = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "b"})
        assert resp.headers["x-kvroute-replica"] == "r0"
        assert fleet.stats()["replicas"]["r0"]["health"]["ejections"] == 1


def test_queue_delay_is_learned_from_streamed_first_bytes(local_tokenizer) -> None:
    """r0 takes 1 s to its first byte, r1 answers at once: once concurrent streams have
    queued behind each other on both, the router's learned seconds per pending request
    (/index/stats) is far higher for r0 than for r1 and than the 0.02 s prior. The learning
    weight is raised from the default 0.03 so that two dozen samples show it. The two are
    told apart at an eighth of r0's delay: r1's first bytes take what the machine allows,
    tens of ms on a busy one (make test runs real vLLM beside this)."""
    delay = 1.0
    faults = [ReplicaFaults(prefill_delay_s=delay), ReplicaFaults()]
    cost = CostSettings(queue_learn_weight=0.1)
    with make_fleet(local_tokenizer, faults=faults, policy="round_robin", cost=cost) as fleet:

        async def one(client: httpx.AsyncClient, i: int) -> None:
            body = {"model": "tiny", "prompt": f"{i} {LONG}", "max_tokens": 2, "stream": True}
            async with client.stream("POST", f"{fleet.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    pass

        async def burst() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                for wave in range(3):
                    await asyncio.gather(*(one(client, 10 * wave + i) for i in range(8)))

        asyncio.run(burst())
        load = {
            n: e["load"]
            for n, e in httpx.get(f"{fleet.url}/index/stats").json()["replicas"].items()
        }
        learned = fleet.service.router.queue_delay.to_dict()
        assert learned["r0"]["samples"] > 0 and learned["r1"]["samples"] > 0
        assert load["r0"]["queue_s_per_request"] > delay / 8
        assert load["r1"]["queue_s_per_request"] < delay / 8
        assert load["r0"]["queue_s_per_request"] > 5 * load["r1"]["queue_s_per_request"]


def test_prefill_rate_is_learned_from_answered_streams(local_tokenizer) -> None:
    """The replicas prefill at 2e-4 s per uncached token (wall clock); the router's prior is
    10x too low. Streamed requests, new prompts and returning ones, one at a time: each answer
    (its first byte, the cached tokens it reports) is a sample, and the rate every replica is
    priced with ends within 35% of the truth, in /index/stats and /debug/route alike."""
    latency = prefill_only(2e-4)
    cost = CostSettings(prefill_s_per_token=2e-5)
    with make_fleet(local_tokenizer, latency=latency, cost=cost) as fleet:
        client = _client(fleet)
        for i in range(24):
            words = " ".join(f"w{i % 6}-{k}" for k in range(40 + 30 * (i % 6)))
            for _chunk in client.completions.create(
                model="tiny",
                prompt=words,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            ):
                pass

        # The router takes the sample once the stream has ended, just after the client has
        # read its last byte.
        def learned() -> dict[str, dict]:
            stats = httpx.get(f"{fleet.url}/index/stats").json()
            return {n: e["cost_rates"] for n, e in stats["replicas"].items()}

        # Each of the 24 answers is one sample once its stream has been closed on the
        # router's side; wait for them all (a busy machine may take seconds), say how many came.
        # The replicas' prefill counters give further samples (prefill_evidence.py).
        evidence = fleet.service.router.prefill_evidence

        def answers() -> int:
            return sum(r["samples"] for r in learned().values()) - evidence.samples

        deadline = time.monotonic() + 30
        while (taken := answers()) < 24:
            assert time.monotonic() < deadline, f"{taken} of 24 samples taken: {learned()}"
            time.sleep(0.05)
        rates = learned()
        for name, r in rates.items():
            assert r["learned"] and r["samples"] > 0, (name, r)
            assert 0.65 < r["prefill_s_per_token"] / 2e-4 < 1.35, (name, r)
        route = httpx.post(
            f"{fleet.url}/debug/route", json={"model": "tiny", "prompt": "a new prompt"}
        ).json()
        shown = {v["name"]: v["prefill_s_per_token"] for v in route["replicas"]}
        assert all(0.65 < v / 2e-4 < 1.35 for v in shown.values()), shown
