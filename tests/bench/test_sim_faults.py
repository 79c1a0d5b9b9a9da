"""Failure injection: engine errors, a replica that dies mid-request and comes back with a
fresh event sequence. Uses replica sim-2 only and leaves it healthy."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import zmq

from kvroute.bench.sim.fleet import SimFleet
from kvroute.indexer.wire import Frame, decode_batch, decode_replay_reply, encode_replay_request

REPLICA = "sim-2"


def _replica(fleet: SimFleet):
    return next(r for r in fleet.replicas if r.name == REPLICA)


def _client(fleet: SimFleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=_replica(fleet).url + "/v1", api_key="unused", max_retries=0)


def test_error_rate_answers_500_in_vllm_schema(sim_fleet: SimFleet) -> None:
    sim_fleet.set_faults(REPLICA, error_rate=1.0)
    try:
        with pytest.raises(openai.InternalServerError):
            _client(sim_fleet).chat.completions.create(
                model="kvroute-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        resp = httpx.post(
            _replica(sim_fleet).url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        assert resp.status_code == 500
        assert resp.json()["error"]["type"] == "InternalServerError"
    finally:
        sim_fleet.set_faults(REPLICA, error_rate=0.0)
    out = _client(sim_fleet).chat.completions.create(
        model="kvroute-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert out.choices[0].message.content


def test_partial_error_rate_fails_some_requests(sim_fleet: SimFleet) -> None:
    sim_fleet.set_faults(REPLICA, error_rate=0.5)
    try:
        codes = [
            httpx.post(
                _replica(sim_fleet).url + "/v1/completions",
                json={"prompt": f"request {i}", "max_tokens": 1},
            ).status_code
            for i in range(40)
        ]
    finally:
        sim_fleet.set_faults(REPLICA, error_rate=0.0)
    assert set(codes) == {200, 500}
    with pytest.raises(httpx.HTTPStatusError):
        sim_fleet.set_faults(REPLICA, error_rate=2.0)


def _replay(endpoint: str) -> list[Frame]:
    """Every batch the replica's replay socket still buffers, from seq 0."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart(encode_replay_request(0))
        frames: list[Frame] = []
        while (frame := decode_replay_reply(dealer.recv_multipart())) is not None:
            frames.append(frame)
        return frames
    finally:
        dealer.close(linger=0)


def test_death_fails_in_flight_requests_and_restart_resets_seq(sim_fleet: SimFleet) -> None:
    r = _replica(sim_fleet)
    for i in range(3):
        _client(sim_fleet).completions.create(
            model="kvroute-sim", prompt=f"before {i} " * 40, max_tokens=1
        )
    before = _replay(r.replay)
    assert [f.seq for f in before] == list(range(len(before))) and len(before) >= 3

    # A long generation (600 tokens, ~0.4 s here) is streaming when the replica dies.
    outcome: dict[str, object] = {}
    streaming = threading.Event()

    def long_request() -> None:
        try:
            with httpx.stream(
                "POST",
                r.url + "/v1/completions",
                json={"prompt": "long " * 20, "max_tokens": 600, "stream": True},
                timeout=30,
            ) as resp:
                lines = []
                for line in resp.iter_lines():
                    streaming.set()
                    if line:
                        lines.append(line)
            outcome["done"] = lines[-1] if lines else None
        except httpx.HTTPError as exc:
            streaming.set()
            outcome["error"] = exc

    worker = threading.Thread(target=long_request)
    worker.start()
    assert streaming.wait(10)
    sim_fleet.kill(REPLICA)
    worker.join(timeout=20)
    assert not worker.is_alive()
    assert "error" in outcome or outcome.get("done") != "data: [DONE]", outcome
    with pytest.raises(httpx.ConnectError):
        httpx.get(r.url + "/health")

    sim_fleet.restart(REPLICA)
    assert httpx.get(r.url + "/health").status_code == 200
    _client(sim_fleet).completions.create(model="kvroute-sim", prompt="after " * 40, max_tokens=1)
    after = _replay(r.replay)
    # A new process: a new replay buffer, numbered from 0, holding only its own batches.
    assert after and after[0].seq == 0 and len(after) < len(before) + 2
    assert decode_batch(after[0].payload).events


def test_a_restart_with_down_time_refuses_connections_until_it_is_back(
    sim_fleet: SimFleet,
) -> None:
    """A restarting vLLM is down while it starts: nothing listens, /health is refused (what
    the router's probe of a 500 sees), then the new process serves."""
    r = _replica(sim_fleet)
    seen: dict[str, object] = {}

    def restart() -> None:
        sim_fleet.restart(REPLICA, down_s=1.5)
        seen["back"] = True

    worker = threading.Thread(target=restart)
    worker.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and "refused" not in seen:
            try:
                httpx.get(r.url + "/health", timeout=1)
            except httpx.ConnectError:
                seen["refused"] = time.monotonic()
            time.sleep(0.05)
        assert "refused" in seen and "back" not in seen
    finally:
        worker.join(timeout=20)
    assert seen.get("back") is True
    assert httpx.get(r.url + "/health").status_code == 200
    with pytest.raises(httpx.HTTPStatusError):
        resp = httpx.post(
            sim_fleet.control + f"/replicas/{REPLICA}/restart", json={"down_s": -1}, timeout=5
        )
        resp.raise_for_status()
