"""The router bounds what a client can make it hold: requests in flight (429 with
Retry-After past ``max_in_flight``, not an unbounded queue) and the time a request body may
take to arrive (408: a trickling client does not keep its connection and buffer)."""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

import httpx

from kvroute.router.common.admission_queue import AdmissionSettings
from tests.router.sim_fleet import make_fleet
from tests.router.sim_replica import ReplicaFaults


def test_past_max_in_flight_the_router_answers_429(local_tokenizer) -> None:
    faults = [ReplicaFaults(prefill_delay_s=1.0)]
    with make_fleet(local_tokenizer, n=1, faults=faults, max_in_flight=2, hint_ttl_s=0) as fleet:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as client:
                body = {"model": "tiny", "prompt": "hold on", "max_tokens": 1}
                return await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(5))
                )

        codes = sorted(r.status_code for r in asyncio.run(burst()))
        assert codes == [200, 200, 429, 429, 429], codes
        refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
        assert refused and all(r.headers["retry-after"] == "2" for r in refused)
        error = refused[0].json()["error"]
        assert error["code"] == 429 and error["type"] == "RateLimitError"
        # The slots are given back: one at a time, everything is served.
        for _ in range(3):
            ok = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30
            )
            assert ok.status_code == 200
        # The handler gives its slot back just after the answer's last byte, which the client
        # may read first: wait for it (a slot that leaked would never come back).
        deadline = time.monotonic() + 5
        while fleet.service.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fleet.service.in_flight == 0
        metrics = httpx.get(f"{fleet.url}/metrics").text
        assert 'kvroute_requests_total{endpoint="completions",outcome="unavailable"}' in metrics


def test_a_body_that_trickles_in_is_cut_off_with_408(local_tokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, body_timeout_s=0.5) as fleet:
        url = urlsplit(fleet.url)
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny", '
            )
            started = time.monotonic()
            answer = b""
            while b'"code"' not in answer:
                part = sock.recv(65536)
                if not part:
                    break
                answer += part
            waited = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"code":408' in answer.replace(b" ", b"")
        assert waited < 5  # bounded by the setting, not by the client
        assert sum(len(f.seen) for f in fleet.fakes) == 0
        ok = httpx.post(f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert ok.status_code == 200


def test_a_client_that_stops_reading_a_stream_is_given_up() -> None:
    """send_stream waits on the server's send (a full client socket buffer); past the
    timeout it gives the client up, which closes the upstream stream (the caller cancels)."""
    from types import SimpleNamespace

    from kvroute.router.serving.proxy import ClientGone, send_stream

    async def chunks():  # an endless upstream stream
        while True:
            yield b"data: {}\n\n"
            await asyncio.sleep(0)

    upstream = SimpleNamespace(
        status=200,
        raw_headers=[],
        replica=SimpleNamespace(name="r0"),
        started=time.perf_counter(),
        response=SimpleNamespace(chunks=chunks),
    )
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) > 3:
            await asyncio.Event().wait()  # the client's buffer is full, for ever

    async def relay() -> None:
        await send_stream(send, upstream, "req", lambda _s: None, client_timeout_s=0.2)

    started = time.monotonic()
    try:
        asyncio.run(relay())
    except ClientGone:
        pass
    else:
        raise AssertionError("a client that never reads was not given up")
    assert time.monotonic() - started < 5
    assert len(sent) == 4


def test_a_connection_that_never_completes_its_headers_is_closed(local_tokenizer) -> None:
    """Slowloris: silent connections and header tricklers are closed after
    ``header_timeout_s``; a request whose headers arrive in time is served, also on a
    kept-alive connection idle for less than uvicorn's keep-alive timeout."""
    with make_fleet(local_tokenizer, n=1, header_timeout_s=0.6) as fleet:
        url = urlsplit(fleet.url)

        def closed_after(send: bytes, trickle: bytes = b"") -> float:
            with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
                started = time.monotonic()
                sock.sendall(send)
                for byte in trickle:  # one byte every 0.1 s: headers never complete in time
                    try:
                        sock.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.1)
                assert sock.recv(65536) == b""  # closed without an answer
                return time.monotonic() - started

        assert 0.5 < closed_after(b"") < 5
        assert 0.5 < closed_after(b"GET /health HTTP/1.1\r\n", b"X-Slow: " + b"a" * 100) < 5
        # Headers in time, then a slow but complete request: served, and kept alive.
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            for _ in range(2):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = b""
                while not answer.endswith(b"}"):
                    part = sock.recv(65536)
                    assert part, answer
                    answer += part
                assert answer.startswith(b"HTTP/1.1 200"), answer
                time.sleep(0.3)  # idle between requests: the header clock starts again
        assert httpx.get(f"{fleet.url}/health").status_code == 200


def test_with_admission_off_saturated_replicas_take_no_more_and_the_router_answers_503(
    local_tokenizer,
) -> None:
    """With ``max_pending_per_replica`` 1 and ``--no-admission``, two slow replicas take one
    request each; the third finds both saturated and gets 503 with Retry-After at once, not
    a queue (tests/router/serving/test_admission_http.py: the queue, admission's default)."""
    faults = [ReplicaFaults(prefill_delay_s=1.5), ReplicaFaults(prefill_delay_s=1.5)]
    with make_fleet(
        local_tokenizer,
        n=2,
        faults=faults,
        max_pending_per_replica=1,
        hint_ttl_s=0,
        admission=AdmissionSettings(enabled=False),
    ) as fleet:

        async def burst() -> list[tuple[int, float, str | None]]:
            async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as client:

                async def one(delay: float) -> tuple[int, float, str | None]:
                    await asyncio.sleep(delay)
                    started = time.monotonic()
                    resp = await client.post(
                        "/v1/completions", json={"model": "tiny", "prompt": "busy", "max_tokens": 1}
                    )
                    return (
                        resp.status_code,
                        time.monotonic() - started,
                        resp.headers.get("retry-after"),
                    )

                return await asyncio.gather(one(0), one(0.1), one(0.4))

        results = asyncio.run(burst())
        assert sorted(r[0] for r in results) == [200, 200, 503], results
        refused = next(r for r in results if r[0] == 503)
        assert refused[1] < 1.0 and refused[2] == "2", refused
        # Room again once the slow ones finished and the next load scrape has seen it.
        deadline = time.monotonic() + 10
        status = 0
        while status != 200 and time.monotonic() < deadline:
            status = httpx.post(
                f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=30
            ).status_code
            time.sleep(0.1)
        assert status == 200
