"""Admission through a real router stack (the app under uvicorn, simulated replicas) with the
official ``openai`` client: a saturated fleet queues instead of refusing, serves the queue by
priority, and sheds with 429 + Retry-After in OpenAI's schema only what cannot start in
time; a queued client that hangs up leaves the queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from kvroute.router.common.admission_queue import AdmissionSettings
from tests.router.sim_fleet import Fleet, make_fleet
from tests.router.sim_replica import ReplicaFaults


def _admission(fleet: Fleet) -> dict[str, Any]:
    return httpx.get(f"{fleet.url}/index/stats", timeout=10).json()["admission"]


def _queued(fleet: Fleet) -> int:
    return _admission(fleet)["models"].get("tiny", {}).get("queued", 0)


async def _until(check: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _client(fleet: Fleet) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fleet.url}/v1", api_key="sk-test", max_retries=0)


@pytest.fixture
def slow_fleet(local_tokenizer: Any, request: pytest.FixtureRequest) -> Any:
    """One replica that takes 0.6 s per request, at most one pending."""
    admission = getattr(request, "param", AdmissionSettings())
    with make_fleet(
        local_tokenizer,
        n=1,
        faults=[ReplicaFaults(prefill_delay_s=0.6)],
        max_pending_per_replica=1,
        hint_ttl_s=0,
        admission=admission,
    ) as fleet:
        yield fleet


def test_a_saturated_fleet_queues_and_serves_by_priority_instead_of_refusing(
    slow_fleet: Fleet,
) -> None:
    fleet = slow_fleet

    async def scenario() -> list[str]:
        client = _client(fleet)

        async def ask(prompt: str, **kw: Any) -> str:
            answer = await client.completions.create(
                model="tiny", prompt=prompt, max_tokens=1, **kw
            )
            return answer.choices[0].text

        tasks = [asyncio.create_task(ask("first"))]
        await _until(lambda: len(fleet.fakes[0].seen) == 1)
        # Queued in this order; vLLM's body field and kvroute's header both set the class.
        for i, (prompt, kw) in enumerate(
            [
                ("low one", {"extra_body": {"priority": 5}}),
                ("low two", {"extra_body": {"priority": 5}}),
                ("high", {"extra_headers": {"x-kvroute-priority": "-1"}}),
            ]
        ):
            tasks.append(asyncio.create_task(ask(prompt, **kw)))
            await _until(lambda n=i + 1: _queued(fleet) == n)
        await asyncio.gather(*tasks)
        await client.close()
        return [seen.body["prompt"] for seen in fleet.fakes[0].seen]

    order = asyncio.run(scenario())
    assert order == ["first", "high", "low one", "low two"]
    stats = _admission(fleet)
    assert stats["enabled"] and stats["queued"] == 3 and stats["admitted"] == 3
    assert stats["shed"] == 0 and stats["models"]["tiny"]["queued"] == 0
    metrics = httpx.get(f"{fleet.url}/metrics").text
    assert 'kvroute_admission_wait_seconds_count{outcome="admitted",priority="5"} 2.0' in metrics
    assert 'kvroute_admission_queued{priority="5"} 0.0' in metrics


@pytest.mark.parametrize("slow_fleet", [AdmissionSettings(max_queued=1)], indirect=True)
def test_what_cannot_start_in_time_is_shed_with_429_and_retry_after(slow_fleet: Fleet) -> None:
    fleet = slow_fleet

    async def scenario() -> tuple[list[openai.RateLimitError], int]:
        client = _client(fleet)
        body = {"model": "tiny", "max_tokens": 1}
        busy = asyncio.create_task(client.completions.create(prompt="busy", **body))
        await _until(lambda: len(fleet.fakes[0].seen) == 1)
        queued = asyncio.create_task(client.completions.create(prompt="queued", **body))
        await _until(lambda: _queued(fleet) == 1)
        refused = []
        # The queue is full, and this one ranks no higher than the one in it.
        with pytest.raises(openai.RateLimitError) as full:
            await client.completions.create(prompt="no room", **body)
        refused.append(full.value)
        # A higher class displaces the queued one; its deadline is shorter than the wait:
        # shed when it passes, never sent.
        with pytest.raises(openai.RateLimitError) as late:
            await client.completions.create(
                prompt="in a hurry",
                extra_headers={"x-kvroute-priority": "-5", "x-kvroute-max-wait-s": "0.05"},
                **body,
            )
        refused.append(late.value)
        with pytest.raises(openai.RateLimitError) as displaced:
            await queued
        refused.append(displaced.value)
        await busy
        await client.close()
        return refused, len(fleet.fakes[0].seen)

    refused, seen = asyncio.run(scenario())
    assert seen == 1  # the shed ones never reached the replica
    for exc in refused:
        assert exc.status_code == 429 and int(exc.response.headers["retry-after"]) >= 1
        error = exc.response.json()["error"]
        assert error["type"] == "RateLimitError" and error["code"] == 429
    stats = _admission(fleet)
    assert stats["shed_by_reason"] == {"full": 1, "displaced": 1, "deadline": 1}
    assert stats["shed"] == 3 and stats["admitted"] == 0


def test_a_queued_client_that_hangs_up_leaves_the_queue(slow_fleet: Fleet) -> None:
    fleet = slow_fleet

    async def scenario() -> None:
        client = _client(fleet)
        busy = asyncio.create_task(
            client.completions.create(model="tiny", prompt="busy", max_tokens=1)
        )
        await _until(lambda: len(fleet.fakes[0].seen) == 1)
        async with httpx.AsyncClient(base_url=fleet.url) as raw:
            hang_up = asyncio.create_task(
                raw.post("/v1/completions", json={"model": "tiny", "prompt": "bye"})
            )
            await _until(lambda: _queued(fleet) == 1)
            hang_up.cancel()  # the connection closes while the request waits
            with pytest.raises(asyncio.CancelledError):
                await hang_up
        await _until(lambda: _admission(fleet)["disconnected"] == 1)
        await busy
        await client.close()

    asyncio.run(scenario())
    stats = _admission(fleet)
    assert stats["models"]["tiny"]["queued"] == 0 and stats["admitted"] == 0
    assert [s.body["prompt"] for s in fleet.fakes[0].seen] == ["busy"]


def test_a_bad_priority_is_a_400_in_openais_schema(slow_fleet: Fleet) -> None:
    async def scenario() -> openai.BadRequestError:
        client = _client(slow_fleet)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(
                model="tiny", prompt="x", max_tokens=1, extra_body={"priority": "urgent"}
            )
        await client.close()
        return bad.value

    err = asyncio.run(scenario())
    assert err.response.json()["error"]["param"] == "priority"
    assert len(slow_fleet.fakes[0].seen) == 0
