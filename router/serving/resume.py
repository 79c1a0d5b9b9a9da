"""Finishing a streamed answer on another replica when its replica fails mid-answer.

Once a streamed answer's first bytes reached the client, a failed replica cannot be retried
as a whole: the client already holds part of the answer. The router can still finish it. It
asks vLLM for the ids it streams (``return_token_ids``; a client that did not ask gets them
as vLLM would have sent them, null) and, when the stream breaks (the connection drops, the
body ends with neither a finish reason nor ``[DONE]``, or an error event of a server fault
arrives), sends the prompt's ids plus the ids streamed so far to the next replica of the
ranking as a ``/v1/completions`` request for what is left of the budget. Its answer is relayed
in the original's framing: the original's id, created and model, chat chunks for a chat
request, usage counted from the original prompt. The model's next token is a function of the
context, so a greedy answer goes on exactly as it would have; a sampled one goes on with a
fresh sample.

What can be resumed (``resume_blocker``): one streamed answer (``n`` 1) of /v1/completions or
/v1/chat/completions without logprobs, echo or prompt logprobs, tools, structured output or
a multimodal prompt (vLLM's ids of one carry placeholders that mean nothing without the
media) or stop strings (vLLM holds back the text a stop string may begin, and that text
would be lost at a break). A chat answer that went through a reasoning or tool parser (a
delta with reasoning or tool calls) is not resumed either: the continuation is raw text.
Streamed ids whose text vLLM still holds back (the bytes of an unfinished character) are
computed again (``drop_held_back``). The cached tokens the final usage reports are the
continuing replica's (at most the prompt's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import Any

import msgspec

from kvroute.router.errors import RouterError, sse_error
from kvroute.router.fleet.replicas import Replica, ReplicaRegistry
from kvroute.router.serving.proxy import Forwarder, Upstream, downstream_headers, send_body
from kvroute.router.serving.upstream import UpstreamError

__all__ = ["RESUMABLE_KINDS", "StreamResume", "continuation_target", "resume_blocker"]

log = logging.getLogger(__name__)

RESUMABLE_KINDS = frozenset({"completion", "chat"})
# What a continuation keeps of the client's body: vLLM's sampling parameters, which mean
# the same on /v1/completions (everything else is the prompt's, or refused above).
_KEPT = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "priority",
    "cache_salt",
    "user",
    "vllm_xargs",
)
_STRUCTURED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
)
_encode = msgspec.json.encode
_decode = msgspec.json.decode
_DONE = b"[DONE]"
_MAX_EVENT = 1 << 20  # an event longer than this is relayed unparsed


def resume_blocker(kind: str, body: dict[str, Any], multimodal: bool = False) -> str | None:
    """Why a request's stream cannot be resumed (None: it can; module docstring)."""
    if kind not in RESUMABLE_KINDS:
        return "endpoint"
    if body.get("stream") is not True:
        return "not streamed"
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "several answers"
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        return "logprobs"
    if body.get("prompt_logprobs") is not None or body.get("echo") is True:
        return "prompt logprobs or echo"
    if multimodal:
        return "multimodal prompt"
    if any(body.get(k) is not None for k in _STRUCTURED):
        return "structured output"
    if body.get("stop"):  # vLLM holds back the text a stop string may begin: lost at a break
        return "stop strings"
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return "structured output"
    if kind == "chat":
        if body.get("tools") and body.get("tool_choice") != "none":
            return "tools"
        if body.get("functions"):
            return "tools"
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
            return "a batch of prompts"
        if body.get("suffix") is not None:
            return "suffix"
    return None


def continuation_target(kind: str, target: str) -> str:
    """Where a continuation goes: /v1/completions beside the client's endpoint."""
    if kind != "chat":
        return target
    path, sep, query = target.partition("?")
    if path.endswith("/chat/completions"):
        path = path[: -len("/chat/completions")] + "/completions"
    return path + sep + query


class StreamResume:
    """One resumable streamed answer: what it streamed so far, and its continuation on the
    next replica of ``ranked`` when its replica fails (module docstring)."""

    def __init__(
        self,
        kind: str,
        body: dict[str, Any],
        prompt_ids: list[int] | None,
        *,
        forwarder: Forwarder,
        registry: ReplicaRegistry,
        ranked: list[Replica],
        target: str,
        headers: list[tuple[bytes, bytes]],
        commit: Callable[[Replica], None] | None,
        attempts: int = 2,
    ) -> None:
        self.kind = kind
        self.body = body
        self.prompt = prompt_ids  # the replica's own, once its first chunk names them
        self.forwarder = forwarder
        self.registry = registry
        self.ranked = ranked
        self.target = continuation_target(kind, target)
        self.headers = headers
        self.commit = commit
        self.attempts = attempts
        self.client_ids = body.get("return_token_ids") is True
        self.generated: list[int] = []
        self.offset = 0  # ids generated before the current continuation
        self.tracking = True  # every streamed id is known
        self.finished = False  # a finish reason was streamed
        self.head: dict[str, Any] = {}  # the original's id, created and model
        self.resumed = 0  # continuations that answered
        self.broke = False  # the original's stream failed (its connection is not reusable)
        self.gave_up: str | None = None  # why a broken stream was not finished

    def upstream_body(self) -> bytes:
        """The client's body, asking for the streamed ids."""
        return _encode({**self.body, "return_token_ids": True})

    # --- relaying -------------------------------------------------------------------------

    async def relay(
        self,
        send: Callable[[MutableMapping[str, Any]], Any],
        upstream: Upstream,
        request_id: str,
        on_first_byte: Callable[[float], None],
        client_timeout_s: float | None = None,
    ) -> tuple[bytes, str | None]:
        """Relay ``upstream``'s SSE body, then continuations while it breaks. Returns (the
        last bytes sent, an error or None), as kvroute.router.serving.proxy.send_stream."""
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status,
                "headers": downstream_headers(
                    upstream.raw_headers, request_id, upstream.replica.name
                ),
            }
        )
        tail = [b""]

        async def out(data: bytes) -> None:
            if data:
                await send_body(send, data, client_timeout_s)
                tail[0] = (tail[0] + data)[-8192:]

        current, tried, error = upstream, {upstream.replica.name}, None
        while True:
            original = current is upstream
            if original:  # the caller closes it
                failure = await self._pump(current, out, on_first_byte, True)
            else:
                failure = "cancelled"
                try:
                    failure = await self._pump(current, out, None, False)
                finally:
                    self.forwarder.close(current, complete=failure is None)
            if failure is None:
                break
            if original:
                self.broke = True
            if not self.finished and self._spent():  # every id came, the finish chunk did not
                last = self._continued({"choices": [{"finish_reason": "length", "token_ids": []}]})
                await out(b"data: " + _encode(last) + b"\n\n")
            if self.finished:  # only the end was lost: say it
                await out(b"data: [DONE]\n\n")
                break
            log.warning("request %s: %s", request_id, failure)
            nxt, why = await self._reopen(tried)
            if nxt is None:
                self.gave_up = why
                error = f"{failure}; not resumed: {why}"
                await out(sse_error(502, error))
                break
            log.info("request %s: resumed on %s", request_id, nxt.replica.name)
            current = nxt
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return tail[0], error

    async def _pump(
        self,
        upstream: Upstream,
        out: Callable[[bytes], Any],
        on_first_byte: Callable[[float], None] | None,
        original: bool,
    ) -> str | None:
        """Relay one upstream's events; None when it ended with ``[DONE]``, else what
        failed."""
        name = upstream.replica.name
        buffer = b""
        done = False
        try:
            async for chunk in upstream.response.chunks():
                if not chunk:
                    continue
                if on_first_byte is not None:
                    on_first_byte(time.perf_counter() - upstream.started)
                    on_first_byte = None
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                sent: list[bytes] = []
                for event in events:
                    kept, failed = self._event(event, original)
                    if failed is not None:
                        await out(b"".join(sent))
                        return f"replica {name} failed mid-stream: {failed}"
                    done = done or kept == b"data: [DONE]"
                    if kept:
                        sent.append(kept + b"\n\n")
                if len(buffer) > _MAX_EVENT:  # not vLLM's stream: relay it as it comes
                    self.tracking = False
                    sent.append(buffer)
                    buffer = b""
                await out(b"".join(sent))
        except UpstreamError as exc:
            self.registry.record_failure(upstream.replica, f"proxy: {exc!r}")
            return f"upstream stream from {name} failed: {exc!r}"
        if done:
            return None
        return f"the stream from {name} ended before its end"

    def _event(self, event: bytes, original: bool) -> tuple[bytes, str | None]:
        """One SSE event as the client gets it (b"" to drop it), or the failure it reports."""
        data = b"".join(
            line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        )
        if not data:
            return event, None
        if data == _DONE:
            return b"data: [DONE]", None
        try:
            obj = _decode(data)
        except msgspec.DecodeError:
            self.tracking = False
            return event, None
        if not isinstance(obj, dict):
            self.tracking = False
            return event, None
        err = obj.get("error")
        if err is not None and not obj.get("choices"):
            code = err.get("code") if isinstance(err, dict) else None
            if not isinstance(code, int) or code >= 500:
                return b"", f"error event {_encode(err).decode(errors='replace')[:200]}"
            return event, None
        shown = self._original(obj) if original else self._continued(obj)
        return (b"data: " + _encode(shown) if shown is not None else b""), None

    # --- the original stream --------------------------------------------------------------

    def _original(self, obj: dict[str, Any]) -> dict[str, Any]:
        if not self.head:
            self.head = {k: obj.get(k) for k in ("id", "created", "model")}
        ids = obj.get("prompt_token_ids")
        choices = obj.get("choices")
        choices = choices if isinstance(choices, list) else []
        for choice in choices:
            if not isinstance(choice, dict):
                self.tracking = False
                continue
            ids = choice.get("prompt_token_ids", ids)
            self._track(choice)
            if not self.client_ids:
                for key in ("token_ids", "prompt_token_ids"):
                    if key in choice:
                        choice[key] = None
        if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
            self.prompt = ids
        if not self.client_ids and "prompt_token_ids" in obj:
            obj["prompt_token_ids"] = None
        return obj

    def _track(self, choice: dict[str, Any]) -> None:
        if choice.get("index", 0) != 0:
            self.tracking = False
        if self.kind == "chat":
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            if delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"):
                self.tracking = False  # a parser shaped it: raw text would not continue it
            text = delta.get("content")
        else:
            text = choice.get("text")
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            self.generated.extend(ids)
        elif text:
            self.tracking = False
        if choice.get("finish_reason") is not None:
            self.finished = True

    # --- continuations --------------------------------------------------------------------

    def _budget(self) -> int | None:
        """The client's output budget (None: up to the context length)."""
        budget = self.body.get("max_completion_tokens") if self.kind == "chat" else None
        if budget is None:
            budget = self.body.get("max_tokens")
        return budget if isinstance(budget, int) else None

    def _spent(self) -> bool:
        budget = self._budget()
        return budget is not None and len(self.generated) >= budget

    def _blocker(self) -> str | None:
        if not self.tracking:
            return "the streamed ids are not known"
        if not self.prompt:
            return "the prompt's ids are not known"
        if self.resumed >= self.attempts:
            return f"{self.resumed} continuations failed"
        return None

    def continuation_body(self) -> dict[str, Any]:
        """The /v1/completions body that goes on from the ids streamed so far."""
        body = self.body
        out = {k: body[k] for k in _KEPT if k in body}
        assert self.prompt is not None
        out["prompt"] = [*self.prompt, *self.generated]
        done = len(self.generated)
        budget = self._budget()
        if budget is not None:
            out["max_tokens"] = max(1, budget - done)
        least = body.get("min_tokens")
        if isinstance(least, int) and least - done > 0:
            out["min_tokens"] = least - done
        out["stream"] = True
        out["return_token_ids"] = True
        opts = body.get("stream_options")
        if isinstance(opts, dict):
            out["stream_options"] = opts
        return out

    async def _reopen(self, tried: set[str]) -> tuple[Upstream | None, str]:
        """The next replica's answer to the continuation, or (None, why not)."""
        why = self._blocker()
        if why is not None:
            return None, why
        ranked = [r for r in self.ranked if r.name not in tried]
        if not ranked:
            return None, "no other replica"
        await self.drop_held_back(partial(self._detokenize, ranked[0]))
        self.offset = len(self.generated)
        body = _encode(self.continuation_body())
        try:
            upstream = await self.forwarder.open(
                ranked, self.target, body, self.headers, self.commit
            )
        except RouterError as exc:
            return None, exc.message
        tried.add(upstream.replica.name)
        if upstream.status != 200:
            await self.forwarder.discard(upstream)
            return None, f"{upstream.replica.name} answered {upstream.status}"
        self.resumed += 1
        return upstream, ""

    async def drop_held_back(self, detokenize: Callable[[list[int]], Awaitable[str | None]]) -> int:
        """Drop the streamed ids whose text vLLM still held back: the bytes of a character
        not yet complete (vLLM sends text only once it decodes without a trailing U+FFFD).
        The continuation computes them again; primed with them, vLLM's incremental
        detokenizer (tokenizers' DecodeStream) would answer the whole prompt's text as the
        first token's. The replica's own /detokenize says where the text ends. Returns how
        many were dropped."""
        dropped = 0
        while self.generated and dropped < 4:  # a UTF-8 character is at most 4 bytes
            text = await detokenize(self.generated[-8:])
            if text is None or not text.endswith("\ufffd"):
                break
            self.generated.pop()
            dropped += 1
        return dropped

    async def _detokenize(self, replica: Replica, ids: list[int]) -> str | None:
        body = _encode({"model": self.body.get("model"), "tokens": ids})
        try:
            upstream = await self.forwarder.open([replica], "/detokenize", body, self.headers)
        except RouterError:
            return None
        complete = False
        try:
            data = await upstream.response.read()
            complete = True
        except UpstreamError:
            return None
        finally:
            self.forwarder.close(upstream, complete=complete)
        if upstream.status != 200:
            return None
        try:
            text = _decode(data).get("prompt")
        except (msgspec.DecodeError, AttributeError):
            return None
        return text if isinstance(text, str) else None

    def _continued(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's chunk in the original's framing (None: nothing to show)."""
        chat = self.kind == "chat"
        choices = obj.get("choices")
        shown: list[dict[str, Any]] = []
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            text = choice.get("text") or ""
            if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                self.generated.extend(ids)
            elif text:
                self.tracking = False
            finish = choice.get("finish_reason")
            if finish is not None:
                self.finished = True
            if not text and finish is None and not self.client_ids:
                continue
            piece: dict[str, Any] = {"index": 0}
            if chat:
                piece["delta"] = {"content": text}
            else:
                piece["text"] = text
            piece["logprobs"] = None
            piece["finish_reason"] = finish
            piece["stop_reason"] = choice.get("stop_reason")
            piece["token_ids"] = ids if self.client_ids else None
            shown.append(piece)
        usage = obj.get("usage")
        if not shown and not isinstance(usage, dict):
            return None
        out: dict[str, Any] = {
            "id": self.head.get("id"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": shown,
        }
        if isinstance(usage, dict):
            out["usage"] = self._usage(usage)
        return out

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage counted from the original prompt: its prompt is the
        original's plus ``offset`` generated ids."""
        prompt = len(self.prompt or ())
        generated = usage.get("completion_tokens")
        completion = self.offset + (generated if isinstance(generated, int) else 0)
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens")
            details = dict(details)
            if isinstance(cached, int):
                details["cached_tokens"] = min(cached, prompt)
            out["prompt_tokens_details"] = details
        return out
