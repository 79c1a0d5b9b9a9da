"""Drive a workload through an OpenAI-compatible endpoint and record what each request saw.

Requests are streamed chat completions with ``stream_options.include_usage``, so the client
measures time to first token itself and reads ``prompt_tokens_details.cached_tokens`` from the
final usage chunk. Every session is a coroutine on one loop (httpx, no per-request threads);
the run is bounded by ``deadline_s`` of wall time, after which unfinished sessions are
cancelled and their requests counted as not completed.

Several routers (an HA deployment behind a Service or an L7 balancer): each request goes to
one of ``base_url``'s routers, chosen by a hash of (session, turn), so every policy sees the
same requests at the same routers and a conversation's turns spread over all of them, as a
per-request load balancer spreads them.

Times: the fleet's clock runs ``time_scale`` wall seconds per simulated second, so the
workload's think times and arrivals are scaled into wall time, and latencies are scaled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvroute.bench.workloads.base import Session, Workload

__all__ = ["RequestRecord", "pick_router", "run_workload"]


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in wall seconds since the run's start)."""

    session: str
    turn: int
    messages: list[dict[str, str]]
    max_tokens: int
    sent: float
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    status: int | None = None
    replica: str | None = None  # the router's x-kvroute-replica header: who answered
    reply: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None and self.done is not None


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rec: RequestRecord,
    t0: float,
    headers: dict[str, str],
) -> None:
    body = {
        "model": model,
        "messages": rec.messages,
        "max_tokens": rec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            rec.replica = resp.headers.get("x-kvroute-replica")
            if resp.status_code != 200:
                raw = await resp.aread()
                rec.error = f"HTTP {resp.status_code}: {raw[:300].decode(errors='replace')}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {chunk['error']}"
                    return
                for choice in chunk.get("choices") or ():
                    if rec.first_token is None:
                        rec.first_token = time.monotonic() - t0
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        parts.append(content)
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens", 0)
                    rec.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
        rec.done = time.monotonic() - t0
        rec.reply = "".join(parts)
        if rec.first_token is None:
            rec.error = "stream ended without a token"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"


def pick_router(urls: Sequence[str], session: str, turn: int) -> str:
    """The router a request goes to: stable across runs and policies, spread evenly."""
    return urls[zlib.crc32(f"{session}/{turn}".encode()) % len(urls)]


async def _session(
    client: httpx.AsyncClient,
    urls: Sequence[str],
    model: str,
    session: Session,
    time_scale: float,
    t0: float,
    records: list[RequestRecord],
    session_header: str,
) -> None:
    await asyncio.sleep(max(0.0, t0 + session.start_s * time_scale - time.monotonic()))
    history: list[dict[str, str]] = []
    if session.system is not None:
        history.append({"role": "system", "content": session.system})
    headers = {session_header: session.id}
    for i, turn in enumerate(session.turns):
        if turn.think_s:
            await asyncio.sleep(turn.think_s * time_scale)
        history.append({"role": turn.role, "content": turn.content})
        rec = RequestRecord(
            session=session.id,
            turn=i,
            messages=list(history),
            max_tokens=turn.max_tokens,
            sent=time.monotonic() - t0,
        )
        records.append(rec)
        await _one(client, pick_router(urls, session.id, i), model, rec, t0, headers)
        if rec.ok:
            history.append({"role": "assistant", "content": rec.reply})
        else:
            history.pop()  # a failed turn is not part of the conversation


async def run_workload(
    workload: Workload,
    base_url: str | Sequence[str],
    *,
    model: str,
    time_scale: float,
    deadline_s: float,
    session_header: str = "x-session-id",
) -> tuple[list[RequestRecord], float]:
    """Run every session; returns the records (in send order) and the run's wall duration.
    ``base_url``: one router, or several that share the traffic (see ``pick_router``)."""
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
    records: list[RequestRecord] = []
    bases = [base_url] if isinstance(base_url, str) else list(base_url)
    if not bases:
        raise ValueError("run_workload needs at least one base URL")
    urls = [b.rstrip("/") + "/v1/chat/completions" for b in bases]
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(deadline_s, connect=10.0), limits=limits
    ) as client:
        t0 = time.monotonic()
        tasks = [
            asyncio.create_task(
                _session(client, urls, model, s, time_scale, t0, records, session_header)
            )
            for s in workload.sessions
        ]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        duration = time.monotonic() - t0
    for rec in records:
        if rec.done is None and rec.error is None:
            rec.error = "not completed before the deadline"
    records.sort(key=lambda r: r.sent)
    return records, duration


def summarize_errors(records: list[RequestRecord]) -> dict[str, Any]:
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            key = r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return errors
