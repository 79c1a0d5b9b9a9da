"""A small fake vLLM server for the router tests (a real HTTP server; only the model is fake).

It speaks the parts of vLLM's OpenAI API the router touches: /health, /v1/models (with LoRA
cards), /metrics (load gauges), /tokenize and /detokenize (vLLM's rules, written plainly:
render the chat template to text, then encode; ``chat_template`` plays vLLM's
``--chat-template``), the render endpoints of vLLM 0.32 (``/v1/chat/completions/render``,
``/v1/completions/render``: token ids and multimodal features; ``render_status`` 403 answers
as a vLLM without ``--enable-scale-out`` does), completions and chat completions with and
without SSE streaming (stream_options.include_usage, data: [DONE]). It keeps a prefix cache
of the prompts it served and, when given an EventPublisher, publishes BlockStored events for
new blocks like vLLM does; usage.prompt_tokens_details.cached_tokens follows vLLM's rule.
Knobs inject failures: HTTP errors, a stream that dies mid-way, slow prefill, no health.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import xxhash
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from kvroute.bench.publisher import EventPublisher
from kvroute.indexer.wire import BlockStored


@dataclass
class FakeKnobs:
    delay_s: float = 0.0  # before the first byte (prefill)
    chunk_delay_s: float = 0.0
    chunks: int = 3
    fail_status: int | None = None  # answer completions with this status
    die_after_chunks: int | None = None  # kill the stream after this many chunks
    healthy: bool = True
    report_cached: bool = True
    publish_events: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    tokenize_delay_s: float = 0.0  # /tokenize answers this late (without blocking the server)
    headers: dict[str, str] = field(default_factory=dict)  # added to completion responses


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeVLLM:
    name: str
    tokenizer: Any
    model: str = "tiny"
    loras: list[str] = field(default_factory=list)
    block_size: int = 16
    chat_template: str | None = None  # the server's --chat-template (None: the tokenizer's)
    render_status: int | None = 403  # None: serve the render endpoints; else answer this
    publisher: EventPublisher | None = None
    knobs: FakeKnobs = field(default_factory=FakeKnobs)

    def __post_init__(self) -> None:
        self.seen: list[Seen] = []
        self.cancelled = 0
        self.completed = 0
        self.active = 0
        self._blocks: dict[tuple[int, str | None], int] = {}  # (chain hash) -> engine hash
        self._lock = threading.Lock()
        self.app = self._build()

    # --- vLLM-like tokenization and prefix cache ---------------------------------------------

    def tokenize_prompt(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            messages = []
            for m in body["messages"]:
                m = dict(m)
                if isinstance(m.get("content"), list):
                    m["content"] = "\n".join(p["text"] for p in m["content"] if p["type"] == "text")
                messages.append(m)
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=body.get("chat_template") or self.chat_template,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tokenize=False,
                **(body.get("chat_template_kwargs") or {}),
            )
            return list(
                self.tokenizer(text, add_special_tokens=body.get("add_special_tokens", False))[
                    "input_ids"
                ]
            )
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list):
            return list(prompt)
        return list(
            self.tokenizer(prompt, add_special_tokens=body.get("add_special_tokens", True))[
                "input_ids"
            ]
        )

    def _prefill(self, tokens: list[int], lora: str | None) -> int:
        """Cache the prompt's full blocks; return the cached tokens vLLM would report."""
        bs = self.block_size
        n_full = len(tokens) // bs
        hit = 0
        parent: int | None = None
        new_hashes: list[int] = []
        new_tokens: list[int] = []
        first_parent: int | None = None
        chain = 0
        with self._lock:
            for i in range(n_full):
                block = tokens[i * bs : (i + 1) * bs]
                chain = xxhash.xxh3_64_intdigest(json.dumps([chain, block, lora]).encode())
                engine = self._blocks.get((chain, lora))
                if engine is not None and not new_hashes:
                    hit += 1
                    parent = engine
                    continue
                engine = chain >> 1
                self._blocks[(chain, lora)] = engine
                if not new_hashes:
                    first_parent = parent
                new_hashes.append(engine)
                new_tokens.extend(block)
        if new_hashes and self.publisher is not None and self.knobs.publish_events:
            self.publisher.publish(
                [
                    BlockStored(
                        block_hashes=new_hashes,
                        parent_block_hash=first_parent,
                        token_ids=new_tokens,
                        block_size=bs,
                        lora_name=lora,
                    )
                ]
            )
        return min(hit * bs, ((len(tokens) - 1) // bs) * bs)

    # --- app ---------------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()
        fake = self

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if fake.knobs.healthy else 503)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            cards = [
                {
                    "id": fake.model,
                    "object": "model",
                    "owned_by": "vllm",
                    "root": fake.model,
                    "parent": None,
                    "max_model_len": 4096,
                }
            ]
            cards += [
                {
                    "id": name,
                    "object": "model",
                    "owned_by": "vllm",
                    "root": f"/loras/{name}",
                    "parent": fake.model,
                    "max_model_len": 4096,
                }
                for name in fake.loras
            ]
            return {"object": "list", "data": cards}

        @app.get("/metrics")
        async def metrics() -> Response:
            k = fake.knobs
            text = (
                "# HELP vllm:num_requests_running Number of requests running.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="{fake.model}"}} '
                f"{k.running + fake.active}\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="{fake.model}"}} {k.waiting}\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{fake.model}"}} {k.kv_usage}\n'
            )
            return PlainTextResponse(text)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await request.json()
            fake.seen.append(Seen(request.url.path, body, dict(request.headers)))
            if fake.knobs.tokenize_delay_s:
                await asyncio.sleep(fake.knobs.tokenize_delay_s)
            if body.get("model") not in (None, fake.model, *fake.loras):
                return _error(404, f"The model `{body.get('model')}` does not exist.")
            tokens = fake.tokenize_prompt(body)
            return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

        async def render(request: Request, chat: bool) -> Response:
            body = await request.json()
            fake.seen.append(Seen(request.url.path, body, dict(request.headers)))
            if fake.render_status is not None:
                return _error(
                    fake.render_status,
                    "Scale-out endpoints are disabled. Restart vllm serve with "
                    "--enable-scale-out to enable them.",
                )
            if body.get("model") not in (fake.model, *fake.loras):
                return _error(404, f"The model `{body.get('model')}` does not exist.")
            tokens = fake.tokenize_prompt(body)
            keep = body.get("truncate_prompt_tokens")
            if isinstance(keep, int) and 0 <= keep < len(tokens):
                tokens = tokens[len(tokens) - keep :] if keep else []
            images = [
                p["image_url"]["url"]
                for m in body.get("messages") or ()
                if isinstance(m.get("content"), list)
                for p in m["content"]
                if p.get("type") == "image_url"
            ]
            features = None
            if images:  # one placeholder token per image, at the start (the fake's layout)
                features = {
                    "mm_hashes": {"image": [xxhash.xxh3_64_hexdigest(u.encode()) for u in images]},
                    "mm_placeholders": {
                        "image": [{"offset": i, "length": 1} for i in range(len(images))]
                    },
                }
            out = {"request_id": uuid.uuid4().hex, "token_ids": tokens, "features": features}
            return JSONResponse(out if chat else [out])

        @app.post("/v1/chat/completions/render")
        async def render_chat(request: Request) -> Response:
            return await render(request, True)

        @app.post("/v1/completions/render")
        async def render_completion(request: Request) -> Response:
            return await render(request, False)

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            body = await request.json()
            return JSONResponse({"prompt": fake.tokenizer.decode(body["tokens"])})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await fake._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await fake._generate(request, chat=True)

        return app

    async def _wait(self, request: Request, seconds: float) -> bool:
        """Sleep, watching for the client going away (True: it went away)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                return True
            await asyncio.sleep(min(0.01, max(0.0, deadline - time.monotonic())))
        return False

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        body = await request.json()
        self.seen.append(Seen(request.url.path, body, dict(request.headers)))
        k = self.knobs
        if k.fail_status is not None:
            return _error(k.fail_status, f"injected failure on {self.name}")
        if body.get("model") not in (self.model, *self.loras):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        lora = body["model"] if body["model"] in self.loras else None
        tokens = self.tokenize_prompt(body)
        self.active += 1
        try:
            if k.delay_s and await self._wait(request, k.delay_s):
                self.cancelled += 1
                return Response(status_code=499)
            cached = self._prefill(tokens, lora)
        finally:
            self.active -= 1
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": k.chunks,
            "total_tokens": len(tokens) + k.chunks,
            "prompt_tokens_details": {"cached_tokens": cached} if k.report_cached else None,
        }
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if not body.get("stream"):
            self.completed += 1
            text = " ".join(f"tok{i}" for i in range(k.chunks))
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                    "logprobs": None,
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            )
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": body["model"],
                    "choices": [choice],
                    "usage": usage,
                    "served_by": self.name,
                },
                headers=k.headers,
            )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            self._stream(request, chat, rid, created, body["model"], usage, include_usage),
            media_type="text/event-stream",
            headers=k.headers,
        )

    async def _stream(
        self,
        request: Request,
        chat: bool,
        rid: str,
        created: int,
        model: str,
        usage: dict[str, Any],
        include_usage: bool,
    ):
        k = self.knobs
        obj = "chat.completion.chunk" if chat else "text_completion"
        finished = False
        try:
            for i in range(k.chunks):
                if k.die_after_chunks is not None and i >= k.die_after_chunks:
                    raise RuntimeError("injected mid-stream death")
                if i and k.chunk_delay_s and await self._wait(request, k.chunk_delay_s):
                    return
                choice: dict[str, Any] = (
                    {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}
                    if chat
                    else {"index": 0, "text": f"tok{i} ", "finish_reason": None}
                )
                chunk = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "served_by": self.name,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            if include_usage:
                chunk = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
            finished = True
            self.completed += 1
        finally:
            if not finished and k.die_after_chunks is None:
                self.cancelled += 1


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "BadRequestError" if status < 500 else "Error",
                "param": None,
                "code": status,
            }
        },
        status_code=status,
    )
