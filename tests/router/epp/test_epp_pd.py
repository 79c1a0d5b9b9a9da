"""P/D through the endpoint picker (router/epp/disagg.py), the way llm-d's P/D works.

Simulated replicas (bench/sim: vLLM's HTTP API and ZMQ KV events) with P/D roles, r0 and r1
prefill, r2 decode, behind a router whose endpoint picker is driven over Envoy's ext_proc
protocol by a real ``grpc.aio`` client (tests/router/epp/test_epp.py's gateway side; Envoy
and llm-d's routing sidecar cannot run here: the test reads the header mutation the sidecar
would get). Checked: a split names the decode replica as the destination and the prefill
replica holding the prompt in ``x-prefiller-host-port`` (llm-d's header, ``ip:port``); a
prompt the decode replica holds goes decode-only, without the header, and a client's own
``x-prefiller-host-port`` is removed; the subset hint bounds the prefill pick.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvroute.deploy.processes import free_port
from kvroute.router.config import DisaggSettings
from tests.router.epp.test_epp import Stream, _body, _destination, header_map
from tests.router.sim_fleet import Fleet, make_fleet
from tests.waiting import wait_until

PREFILL_HEADER = "x-prefiller-host-port"
# A cheap pull: a prefill replica holding the prompt beats recomputing it on decode.
AUTO = DisaggSettings(mode="auto", skip_tokens=16, skip_fraction=0.1)


@pytest.fixture
def pd_fleet(local_tokenizer: Any) -> Iterator[tuple[Fleet, str]]:
    port = free_port("127.0.0.1")
    with make_fleet(
        local_tokenizer,
        3,
        roles=["prefill", "prefill", "decode"],
        disagg=AUTO,
        epp_port=port,
        epp_plaintext=True,
    ) as fleet:
        yield fleet, f"127.0.0.1:{port}"


def _endpoint(fleet: Fleet, i: int) -> str:
    return fleet.fakes[i].url.removeprefix("http://")


def _chat(system: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "max_tokens": 2,
    }


def _route(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    return httpx.post(f"{fleet.url}/debug/route", json=body, timeout=10).json()["disaggregation"]


def _pick(epp: str, body: dict[str, Any], **headers: Any) -> tuple[str, dict[str, str], list[str]]:
    """One duplex pick: (destination, set headers, removed headers)."""

    async def main() -> tuple[str, dict[str, str], list[str]]:
        async with grpc.aio.insecure_channel(epp) as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            try:
                stream = Stream(call)
                await stream.send(header_map(authorization=None, **headers))
                await stream.send(_body(json.dumps(body).encode()))
                endpoint, _, set_headers, removed = _destination(await stream.read())
                return endpoint, set_headers, removed
            finally:
                call.cancel()

    return asyncio.run(main())


def _hold(fleet: Fleet, i: int, body: dict[str, Any]) -> None:
    """Replica i computes the prompt (a request sent to it directly) and announces it."""
    httpx.post(f"{fleet.fakes[i].url}/v1/chat/completions", json=body, timeout=30)


def test_a_split_names_the_prefill_replica_holding_the_prompt_in_llm_ds_header(
    pd_fleet: tuple[Fleet, str],
) -> None:
    fleet, epp = pd_fleet
    body = _chat("You are the P/D picker's assistant. " + "Answer in one line. " * 60)
    _hold(fleet, 1, body)
    wait_until(lambda: _route(fleet, body).get("prefill") == "r1")  # r1's prefix indexed
    # The proxy would serve it whole on r1 (/debug/route shows the proxy's plan); the
    # picker, whose destination is its decode pick, is not offered that choice: it splits.
    assert _route(fleet, body)["reason"] in ("split", "whole_on_prefill")
    endpoint, headers, removed = _pick(epp, body)
    assert endpoint == _endpoint(fleet, 2)  # the decode replica is the destination
    assert headers[PREFILL_HEADER] == _endpoint(fleet, 1)
    assert PREFILL_HEADER not in removed
    stats = fleet.stats()["disaggregation"]
    assert stats["split"] == 1 and stats["decisions"]["split"] == 1
    # The gateway allows only r0 and the decode replica: r1 is never named, and the split
    # goes there only if the cost model still says it pays (r0 must compute the prompt).
    subset = [_endpoint(fleet, 0), _endpoint(fleet, 2)]
    endpoint, headers, _ = _pick(epp, body, subset=subset)
    assert endpoint == _endpoint(fleet, 2)
    assert headers.get(PREFILL_HEADER) in (None, _endpoint(fleet, 0))


def test_a_prompt_the_decode_replica_holds_goes_decode_only_and_a_clients_header_is_removed(
    pd_fleet: tuple[Fleet, str],
) -> None:
    fleet, epp = pd_fleet
    body = _chat("You are the decode replica's own assistant. " + "Be brief. " * 60)
    _hold(fleet, 2, body)
    wait_until(lambda: _route(fleet, body)["reason"] in ("small_uncached", "small_fraction"))
    endpoint, headers, removed = _pick(epp, body, extra={PREFILL_HEADER: "203.0.113.9:8000"})
    assert endpoint == _endpoint(fleet, 2)
    assert PREFILL_HEADER not in headers
    assert PREFILL_HEADER in removed  # a client never names the host the sidecar prefills on
    assert fleet.stats()["disaggregation"]["split"] == 0
