"""One simulated replica in-process: its deterministic faults, the record of what it received,
LoRA adapters, the server's chat template and the render endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from kvroute.bench.sim.api import request_token_ids
from kvroute.bench.sim.dp import make_server
from kvroute.bench.sim.faults import RequestLog, SeenRequest
from kvroute.bench.sim.latency import LatencyModel
from kvroute.bench.sim.replica import SimReplica, SimReplicaConfig
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.deploy.tiny_model import build_tiny_model
from kvroute.indexer.wire import BlockStored

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
FREE = LatencyModel(
    prefill_s_per_token=0.0,
    load_cpu_s_per_token=0.0,
    load_storage_s_per_token=0.0,
    decode_s_per_step=0.0,
    decode_s_per_seq=0.0,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> SimTokenizer:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", weights=False)
    return SimTokenizer(Path(model_dir))


Scenario = Callable[[SimReplica, httpx.AsyncClient], Awaitable[None]]


def _serve(tokenizer: SimTokenizer, scenario: Scenario, **config: object) -> None:
    """Run ``scenario`` against a freshly started replica (no latency, 3 tokens by default)."""

    async def go() -> None:
        replica = make_server(
            SimReplicaConfig(
                name="t",
                latency=FREE,
                stream_interval_s=0.0,
                default_max_tokens=3,
                **config,  # type: ignore[arg-type]
            ),
            tokenizer,
        )
        assert isinstance(replica, SimReplica)
        await replica.start()
        try:
            async with httpx.AsyncClient(base_url=replica.url, timeout=10) as client:
                await scenario(replica, client)
        finally:
            await replica.stop()

    asyncio.run(go())


def _completion(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": "kvroute-sim", "prompt": prompt, **extra}


def test_forced_status_health_and_headers(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        replica.faults.fail_status = 503
        replica.faults.headers = {"x-extra": "1"}
        resp = await client.post("/v1/completions", json=_completion("hi"))
        assert resp.status_code == 503
        assert resp.json()["error"]["message"] == "injected failure on t"
        assert resp.headers["x-extra"] == "1"
        # Not a generation endpoint: unaffected.
        assert (await client.post("/tokenize", json=_completion("hi"))).status_code == 200
        replica.faults.fail_status = None
        assert (await client.post("/v1/completions", json=_completion("hi"))).status_code == 200
        assert (await client.get("/health")).status_code == 200
        replica.faults.healthy = False
        assert (await client.get("/health")).status_code == 503

    _serve(tokenizer, scenario)


def test_seen_requests_are_recorded_and_bounded(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        await client.post("/v1/completions", json=_completion("a"), headers={"x-k": "v"})
        await client.post("/tokenize", json=_completion("b"))
        await client.get("/v1/models")  # GETs are not recorded
        seen = list(replica.seen)
        assert [s.path for s in seen] == ["/v1/completions", "/tokenize"]
        assert seen[0].body["prompt"] == "a" and seen[0].headers["x-k"] == "v"

    _serve(tokenizer, scenario)
    log = RequestLog(limit=2)
    for i in range(3):
        log.append(SeenRequest(f"/{i}", {}, {}))
    assert [s.path for s in log] == ["/1", "/2"] and len(log) == 2


def test_mid_stream_death_breaks_the_connection(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        replica.faults.die_after_chunks = 1
        chunks: list[bytes] = []
        with pytest.raises(httpx.RemoteProtocolError):
            body = _completion("die", stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for chunk in resp.aiter_bytes():
                    chunks.append(chunk)
        assert b"[DONE]" not in b"".join(chunks)
        assert replica.requests_aborted == 1

    _serve(tokenizer, scenario)


def test_slow_prefill_and_a_client_that_leaves(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        replica.faults.prefill_delay_s = 5.0
        for stream in (False, True):
            task = asyncio.create_task(
                client.post("/v1/completions", json=_completion("slow", stream=stream))
            )
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        for _ in range(100):
            if replica.requests_aborted == 2 and replica.scheduler.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert replica.requests_aborted == 2 and replica.scheduler.num_running == 0

    _serve(tokenizer, scenario)


def test_tokenizer_drift_and_tokenize_delay(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        plain = (await client.post("/tokenize", json=_completion("hello"))).json()["tokens"]
        assert plain == request_token_ids(replica, _completion("hello"))
        replica.faults.tokenizer_prefix = [7]
        replica.faults.tokenize_delay_s = 0.2
        loop = asyncio.get_running_loop()
        start = loop.time()
        drifted = (await client.post("/tokenize", json=_completion("hello"))).json()["tokens"]
        assert drifted == [7, *plain] and loop.time() - start >= 0.2

    _serve(tokenizer, scenario)


def test_lora_adapters_listed_loaded_and_keyed_apart(tokenizer: SimTokenizer) -> None:
    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        models = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("kvroute-sim", None),
            ("sql", "kvroute-sim"),
        ]
        published: list[object] = []
        assert replica.publisher is not None
        publish = replica.publisher.publish

        def recording(events: list[object], **kw: object) -> None:
            published.extend(events)
            publish(events, **kw)  # type: ignore[arg-type]

        replica.publisher.publish = recording  # type: ignore[method-assign]
        prompt = "x " * 40
        base = await client.post("/v1/completions", json=_completion(prompt))
        again_as_lora = await client.post(
            "/v1/completions", json=_completion(prompt) | {"model": "sql"}
        )
        assert base.status_code == again_as_lora.status_code == 200
        # The adapter's blocks are keyed by its name: the base model's cache does not hit.
        assert again_as_lora.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stored = [e for e in published if isinstance(e, BlockStored)]
        assert [e.lora_name for e in stored] == [None, "sql"]
        assert stored[1].extra_keys and all(k == ("sql",) for k in stored[1].extra_keys)
        missing = await client.post("/v1/completions", json=_completion("x") | {"model": "new"})
        assert missing.status_code == 404
        load = {"lora_name": "new", "lora_path": "/loras/new"}
        loaded = await client.post("/v1/load_lora_adapter", json=load)
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 400
        ok = await client.post("/v1/completions", json=_completion("x") | {"model": "new"})
        assert ok.status_code == 200
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        assert gone.status_code == 200
        assert (
            await client.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
        ).status_code == 404

    _serve(tokenizer, scenario, loras=("sql",))


def test_server_chat_template_and_render_endpoints(tokenizer: SimTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]

    async def scenario(replica: SimReplica, client: httpx.AsyncClient) -> None:
        ids = (await client.post("/tokenize", json={"messages": messages})).json()["tokens"]
        assert tokenizer.decode(ids) == "[user] hi\n"
        chat = await client.post(
            "/v1/chat/completions/render", json={"messages": messages, "model": "kvroute-sim"}
        )
        assert chat.status_code == 200 and chat.json()["token_ids"] == ids
        cut = await client.post(
            "/v1/completions/render", json={"prompt": "one two three", "truncate_prompt_tokens": 1}
        )
        assert cut.json()[0]["token_ids"] == tokenizer.encode("one two three")[-1:]
        replica.config.scale_out = False
        refused = await client.post("/v1/completions/render", json={"prompt": "x"})
        assert refused.status_code == 403
        assert refused.json()["error"]["type"] == "PermissionDeniedError"
        assert "--enable-scale-out" in refused.json()["error"]["message"]

    _serve(tokenizer, scenario, chat_template=TEMPLATE, scale_out=True)
