"""The proxy's own HTTP/1.1 client against real sockets: keep-alive reuse, a replica that
closed its idle connection, chunked bodies, timeouts, truncated answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvroute.router.serving.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamStreamError,
)
from tests.router.sim_fleet import make_fleet
from tests.router.sim_replica import SimServer

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def test_keep_alive_reuse_and_stale_connection_retry(tiny_model_dir) -> None:
    server = SimServer("u", tiny_model_dir).start()
    port = server.port
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True, "max_tokens": 2}).encode()

    async def go() -> None:
        client = UpstreamClient()
        for _ in range(5):
            resp = await client.request(server.url, "/v1/completions", body, [])
            assert resp.status == 200
            assert (b"content-type", b"text/event-stream; charset=utf-8") in resp.headers
            chunks = b"".join([c async for c in resp.chunks()])  # chunked encoding undone
            assert chunks.endswith(b"data: [DONE]\n\n")
            resp.release()
        pool = next(iter(client._pools.values()))
        assert pool.open == 1 and len(pool.idle) == 1  # one connection served all five
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # back on the same port
        assert server.port == port
        # The pooled connection is dead; the request must go out on a fresh one.
        resp = await client.request(server.url, "/v1/completions", body, [])
        assert resp.status == 200
        await resp.read()
        resp.release()
        client.close()

    try:
        asyncio.run(go())
    finally:
        server.close()


def test_timeouts_and_truncated_bodies() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)
        writer.close()

    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        await writer.drain()
        writer.close()

    async def go() -> None:
        s1, url1 = await _raw_server(silent)
        s2, url2 = await _raw_server(truncated)
        client = UpstreamClient(read_timeout_s=0.3)
        with pytest.raises(UpstreamConnectError, match="no response"):
            await client.request(url1, "/v1/completions", b"{}", [])
        resp = await client.request(url2, "/v1/completions", b"{}", [])
        with pytest.raises(UpstreamStreamError):
            await resp.read()
        resp.close()
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await client.request("http://127.0.0.1:9", "/x", b"{}", [])
        for s in (s1, s2):
            s.close()
            await s.wait_closed()
        client.close()

    asyncio.run(go())


def test_truncated_non_streaming_answer_is_a_502(local_tokenizer) -> None:
    """A replica that dies mid-body on a non-streaming request: 502 in OpenAI's schema."""
    with make_fleet(local_tokenizer, n=1) as fleet:

        async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await _read_request(reader)
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"id": ')
            await writer.drain()
            writer.close()

        async def go() -> httpx.Response:
            server, url = await _raw_server(truncated)
            replica = fleet.service.registry.get("r0")
            original = replica.config
            # Point the replica at the broken server for one request (same loop: the
            # router's own thread does the proxying, this loop serves the socket).
            object.__setattr__(original, "url", url)
            try:
                async with httpx.AsyncClient(timeout=10) as client:
                    return await client.post(
                        f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"}
                    )
            finally:
                object.__setattr__(original, "url", fleet.servers[0].url)
                server.close()

        resp = asyncio.run(go())
        assert resp.status_code == 502
        assert "failed mid-response" in resp.json()["error"]["message"]


def test_wait_body_returns_at_the_first_bytes_and_raises_a_death_before_them() -> None:
    """``Response.wait_body``: a replica that answered its headers and died before any
    body (vLLM's streamed answer starts before the first token) raises, so a caller that
    relayed nothing can send the request elsewhere; the first bytes are left for
    ``chunks``."""

    async def died(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()

    async def answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.write(b"5\r\nhello\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def go() -> None:
        s1, url1 = await _raw_server(died)
        s2, url2 = await _raw_server(answered)
        client = UpstreamClient(read_timeout_s=2.0)
        resp = await client.request(url1, "/v1/completions", b"{}", [])
        assert resp.status == 200
        with pytest.raises(UpstreamStreamError):
            await resp.wait_body()
        resp.close()
        resp = await client.request(url2, "/v1/completions", b"{}", [])
        await resp.wait_body()
        assert b"".join([c async for c in resp.chunks()]) == b"hello"
        resp.close()
        for s in (s1, s2):
            s.close()
            await s.wait_closed()
        client.close()

    asyncio.run(go())
