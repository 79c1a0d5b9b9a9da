"""Resets that publish no event: when the router forwards one and the replica accepts it, the
index forgets what the reset emptied (kvroute.router.serving.cache_resets).

Real HTTP servers on 127.0.0.1: the router, and simulated vLLM replicas (bench/sim) that
answer ``POST /reset_prefix_cache`` as vLLM does. The replicas' event feeds are off: the CPU
tier under test is put in the router's index directly, as vLLM's OffloadingConnector's events
would have (its reset then says nothing).
"""

from __future__ import annotations

import httpx
import pytest

from kvroute.indexer.wire import AllBlocksCleared, Medium
from kvroute.router.serving.cache_resets import (
    resets_connector,
    resets_device,
    resets_device_only,
)
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.indexer.builders import BS, DOC, removed, stored
from tests.router.sim_fleet import Fleet, make_fleet

N = len(DOC) // BS


def _offloaded(fleet: Fleet) -> None:
    """Both replicas computed DOC, offloaded it to CPU (one block per chunk, self-describing)
    and evicted all but its first block from the device."""
    index = fleet.service.index
    for name in fleet.names():
        index.apply(name, [stored(DOC, 0, N)])
        index.apply(name, [stored(DOC, b, 1, Medium.CPU, with_extra_keys=False) for b in range(N)])
        index.apply(name, [removed(DOC, list(range(1, N)))])


def _cpu(fleet: Fleet) -> dict[str, int]:
    matches = fleet.service.index.lookup(DOC)
    return {name: matches[name].blocks_by_tier.get(Medium.CPU, 0) for name in fleet.names()}


@pytest.fixture
def fleet(local_tokenizer: LocalTokenizer):  # type: ignore[no-untyped-def]
    with make_fleet(local_tokenizer, n=2, events=False) as f:
        yield f


def test_an_accepted_external_reset_forgets_that_replicas_cpu_tier(fleet: Fleet) -> None:
    _offloaded(fleet)
    assert _cpu(fleet) == {"r0": N - 1, "r1": N - 1}
    # the device-only reset keeps the connector's tiers (vLLM's default): nothing forgotten
    r = httpx.post(f"{fleet.url}/reset_prefix_cache", timeout=10)
    assert r.status_code == 200
    assert _cpu(fleet) == {"r0": N - 1, "r1": N - 1}
    r = httpx.post(f"{fleet.url}/reset_prefix_cache?reset_external=true", timeout=10)
    assert r.status_code == 200
    answered = r.headers["x-kvroute-replica"]
    other = next(n for n in fleet.names() if n != answered)
    assert _cpu(fleet) == {answered: 0, other: N - 1}
    # the device tier is the block pool's to announce: untouched here
    assert fleet.service.index.lookup(DOC)[answered].blocks_by_tier.get(Medium.GPU) == 1


def test_a_refused_reset_forgets_nothing(fleet: Fleet) -> None:
    """The simulator has no RL ``/pause`` endpoint (404): nothing was reset."""
    _offloaded(fleet)
    r = httpx.post(f"{fleet.url}/pause", timeout=10)
    assert r.status_code == 404
    assert _cpu(fleet) == {"r0": N - 1, "r1": N - 1}


@pytest.mark.parametrize(
    ("method", "target", "resets"),
    [
        ("POST", "/reset_prefix_cache", False),
        ("POST", "/reset_prefix_cache?reset_external=true", True),
        ("POST", "/reset_prefix_cache?reset_external=True&reset_running_requests=1", True),
        ("POST", "/reset_prefix_cache?reset_external=false", False),
        ("POST", "/reset_prefix_cache?reset_external=maybe", False),  # vLLM answers 422
        ("GET", "/reset_prefix_cache?reset_external=true", False),
        ("POST", "/pause", True),  # clear_cache defaults to true
        ("POST", "/pause?mode=keep", True),  # keep clears too (EngineCore._finish_pause)
        ("POST", "/pause?clear_cache=false", False),
        ("POST", "/pause?mode=wait&clear_cache=0", False),
        ("POST", "/sleep", True),  # level 1 by default
        ("POST", "/sleep?level=0", False),
        ("POST", "/sleep?level=2", True),
        ("POST", "/release_kv_cache_memory", True),
        ("POST", "/resume", False),
        ("POST", "/v1/completions", False),
    ],
)
def test_which_requests_reset_the_connector(method: str, target: str, resets: bool) -> None:
    """vLLM 0.32's API server: the query flags and their defaults."""
    path, _, query = target.partition("?")
    assert resets_connector(method, path, query.encode()) is resets


@pytest.mark.parametrize(
    ("path", "body", "device"),
    [
        ("/reset_prefix_cache", b'{"success": true}', True),
        ("/reset_prefix_cache", b'{"success": false}', False),  # blocks in use: connector only
        ("/reset_prefix_cache", b"not json", False),
        ("/reset_prefix_cache/", b'{"success": 1}', False),
        ("/pause", b"", True),  # reset_running_requests=True: succeeds or fails the request
        ("/sleep", b"{}", True),
        ("/release_kv_cache_memory", b"", True),
    ],
)
def test_which_accepted_resets_reset_the_device_too(path: str, body: bytes, device: bool) -> None:
    """Whether vLLM's block pool published the ``AllBlocksCleared`` that marks the reset in
    the replica's stream (indexer/index/resets.py drops CPU again there)."""
    assert resets_device(path, body) is device


def test_a_forwarded_reset_drops_cpu_again_at_the_replicas_clear(fleet: Fleet) -> None:
    """The simulator answers ``{"success": true}``: the router forgets the CPU tier now, and
    again at the device clear still to come on the replica's stream (after a CPU store
    published before the reset)."""
    _offloaded(fleet)
    r = httpx.post(f"{fleet.url}/reset_prefix_cache?reset_external=true", timeout=10)
    assert r.status_code == 200 and r.json().get("success") is True
    answered = r.headers["x-kvroute-replica"]
    index = fleet.service.index
    index.apply(answered, [stored(DOC, 1, N - 1, Medium.CPU)])
    # the backlog's store, applied after the reset
    assert all("CPU" in t for t in index.block_tiers(answered, DOC)[1:])
    index.apply(answered, [AllBlocksCleared()])
    assert not any(index.block_tiers(answered, DOC))


@pytest.mark.parametrize(
    ("method", "target", "device_only"),
    [
        ("POST", "/reset_prefix_cache", True),
        ("POST", "/reset_prefix_cache?reset_external=false", True),
        ("POST", "/reset_prefix_cache?reset_external=true", False),
        ("GET", "/reset_prefix_cache", False),
        ("POST", "/pause", False),
    ],
)
def test_which_requests_reset_the_device_alone(method: str, target: str, device_only: bool) -> None:
    path, _, query = target.partition("?")
    assert resets_device_only(method, path, query.encode()) is device_only


def test_a_forwarded_device_reset_is_not_taken_for_a_connector_reset(fleet: Fleet) -> None:
    """A plain ``/reset_prefix_cache`` through the router: the clear it brings keeps the CPU
    tier for good (a clear nobody announced would age it: a direct connector reset)."""
    _offloaded(fleet)
    r = httpx.post(f"{fleet.url}/reset_prefix_cache", timeout=10)
    assert r.status_code == 200 and r.json().get("success") is True
    answered = r.headers["x-kvroute-replica"]
    index = fleet.service.index
    index.apply(answered, [AllBlocksCleared()])
    assert _cpu(fleet)[answered] == N  # block 0 now from CPU too
    # nothing set to age (the index's clock is the real one: its state says it)
    assert index._replicas[answered].doubted == {}  # type: ignore[attr-defined]
