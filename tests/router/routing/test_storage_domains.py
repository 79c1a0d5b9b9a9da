"""A long prefix replica r0 wrote into storage domain d is a hit for idle replica r1 of the
same domain: the router sends it there and counts it as predicted cached tokens; a replica
outside the domain sees nothing; the domain's evictor feed removes it again.

Real parts: simulated vLLM replicas over HTTP (tests/router/sim_replica.py), the router as
`kvroute serve` runs it, and real ZMQ publishers in vLLM's wire format for r0's stream and the
domain's evictor stream (kvroute.indexer.publisher). r0's stream is scripted (its device and
STORAGE stores, then its device eviction), as the simulator does not write shared storage.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from kvroute.indexer.publisher import EventPublisher
from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium
from kvroute.router.app import create_app
from kvroute.router.config import ReplicaConfig, RouterSettings, StorageDomainConfig
from kvroute.router.serving.http_protocol import header_deadline_protocol
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import ReplicaFaults, SimServer

BS = 16  # the simulated replicas' block size
CHUNK = 4  # blocks per stored chunk
PROMPT = [5 + (i * 7) % 500 for i in range(20 * BS + 10)]  # 20 full blocks and a tail
HASHES = [0xD0_0000 + b for b in range(20)]


def _publish_r0(pub: EventPublisher) -> None:
    """r0 computed the prompt, wrote its 5 chunks to the domain, then evicted its device copy."""
    tokens = PROMPT[: 20 * BS]
    pub.publish([BlockStored(HASHES, None, tokens, BS, Medium.GPU, extra_keys=[None] * 20)])
    chunks = []
    for k in range(0, 20, CHUNK):
        chunks.append(
            BlockStored(
                HASHES[k : k + CHUNK],
                HASHES[k - 1] if k else None,
                tokens[k * BS : (k + CHUNK) * BS],
                BS,
                Medium.STORAGE,
                extra_keys=[None] * CHUNK,
            )
        )
    pub.publish(chunks)
    pub.publish([BlockRemoved(HASHES, Medium.GPU)])


@pytest.fixture
def domain_fleet(local_tokenizer: LocalTokenizer) -> Iterator[tuple[str, EventPublisher]]:
    sims = [
        SimServer(
            "r0", local_tokenizer.name, loras=["busy"], faults=ReplicaFaults(prefill_delay_s=5)
        ),
        SimServer("r1", local_tokenizer.name),
        SimServer("r2", local_tokenizer.name),
    ]
    pubs = [
        EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True)
        for _ in range(2)
    ]
    r0_events, evictor = pubs
    router = None
    try:
        for s in sims:
            s.start()
        settings = RouterSettings(
            replicas=[
                ReplicaConfig(
                    sims[0].url,
                    events=r0_events.endpoint,
                    replay=r0_events.replay_endpoint,
                    name="r0",
                    storage_domain="d",
                ),
                ReplicaConfig(sims[1].url, name="r1", storage_domain="d"),  # no feed of its own
                ReplicaConfig(sims[2].url, name="r2"),
            ],
            storage_domains=[StorageDomainConfig("d", evictor.endpoint, evictor.replay_endpoint)],
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
            hint_ttl_s=0.0,
        )
        router = ServerThread(
            create_app(settings, tokenizer=local_tokenizer),
            http=header_deadline_protocol(settings.header_timeout_s),
        ).start()
        service = router.app.state.service
        wait_until(lambda: len(service.registry.healthy()) == 3)
        _publish_r0(r0_events)
        yield router.url, evictor
    finally:
        if router is not None:
            router.stop()
        for p in pubs:
            p.close()
        for s in sims:
            s.close()


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/index/stats", timeout=5).json()


def _route(url: str) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
    return httpx.post(f"{url}/debug/route", json=body, timeout=10).json()


def test_a_prefix_in_shared_storage_goes_to_the_least_loaded_replica_of_its_domain(
    domain_fleet: tuple[str, EventPublisher],
) -> None:
    url, evictor = domain_fleet
    wait_until(lambda: _stats(url)["storage_domains"]["d"]["blocks"] == 20)
    wait_until(lambda: _stats(url)["storage_domains"]["d"]["feed"]["freshness"] == "live")
    # r0 is busy: requests for its own adapter wait on its slow prefill
    busy = [
        threading.Thread(
            target=httpx.post,
            args=(f"{url}/v1/completions",),
            kwargs={"json": {"model": "busy", "prompt": "x", "max_tokens": 1}, "timeout": 30},
        )
        for _ in range(4)
    ]
    for t in busy:
        t.start()
    try:
        wait_until(lambda: _stats(url)["replicas"]["r0"]["load"]["in_flight"] == 4)
        decision = _route(url)
        views = {v["name"]: v for v in decision["replicas"]}
        assert decision["chosen"] == "r1", decision
        assert views["r1"]["tokens_by_tier"] == {"STORAGE": 20 * BS}
        assert views["r1"]["predicted_cached_tokens"] == 20 * BS
        assert views["r1"]["storage_domain"] == "d"
        assert views["r1"]["storage_domain_freshness"] == "live"
        assert views["r0"]["tokens_by_tier"] == {"STORAGE": 20 * BS}
        assert views["r2"]["predicted_cached_tokens"] == 0 and views["r2"]["storage_domain"] is None
        resp = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvroute-replica"] == "r1"
        stats = _stats(url)
        assert stats["replicas"]["r1"]["predicted_cached_tokens"] == 20 * BS
        assert stats["replicas"]["r1"]["storage_domain"] == "d"
        assert stats["storage_domains"]["d"]["attached"] == ["r0", "r1"]
        assert "domain:d" not in stats["replicas"]
        # the evictor removes the last chunk: the domain's match ends a chunk earlier
        evictor.publish([BlockRemoved(HASHES[16:], Medium.STORAGE)])
        wait_until(lambda: _stats(url)["storage_domains"]["d"]["blocks"] == 16)
        views = {v["name"]: v for v in _route(url)["replicas"]}
        assert views["r1"]["tokens_by_tier"] == {"STORAGE": 16 * BS}
    finally:
        for t in busy:
            t.join(timeout=30)


def test_domains_parse_from_flags_files_and_the_command_line() -> None:
    import argparse

    from kvroute.router.cli import add_arguments, settings_from_args
    from kvroute.router.config import ConfigError
    from kvroute.router.specs import parse_replica, parse_replica_flag, parse_storage_domain_flag

    assert parse_replica_flag("http://h:1,name=a,storage_domain=rack-1").storage_domain == "rack-1"
    assert parse_replica({"url": "http://h:1", "storage_domain": "d.2"}).storage_domain == "d.2"
    assert parse_replica("http://h:1").storage_domain is None
    assert parse_storage_domain_flag("d=tcp://h:5600,replay=tcp://h:5601") == StorageDomainConfig(
        "d", "tcp://h:5600", "tcp://h:5601"
    )
    for bad in ("http://h:1,storage_domain=a:b", "http://h:1,storage_domain="):
        with pytest.raises(ConfigError, match="storage domain name"):
            parse_replica_flag(bad)
    with pytest.raises(ConfigError, match="storage_domain"):
        parse_replica({"url": "http://h:1", "storage_domain": 3})
    for bad in ("d", "=tcp://h:1", "d=tcp://h:1,bogus=1", "d#1=tcp://h:1"):
        with pytest.raises(ConfigError):
            parse_storage_domain_flag(bad)
    with pytest.raises(ConfigError, match="unique"):
        RouterSettings(storage_domains=[StorageDomainConfig("d", "tcp://a:1")] * 2)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--replica",
            "http://h:1,storage_domain=d",
            "--storage-domain",
            "d=tcp://gc:5600,replay=tcp://gc:5601",
        ]
    )
    settings = settings_from_args(args)
    assert settings.replicas[0].storage_domain == "d"
    assert settings.storage_domains == [StorageDomainConfig("d", "tcp://gc:5600", "tcp://gc:5601")]


def test_domain_storage_tokens_are_believed_by_the_domain_feed() -> None:
    """A new replica's own feed may still be connecting: its domain's tokens count by the
    domain's evictor feed (none configured: in full), its own tiers by its own feed."""
    from kvroute.router.routing.policies import ReplicaView, make_policy

    policy = make_policy("kvroute", RouterSettings())

    def load_s(own: str | None, domain: str | None, shared: str | None) -> float:
        view = ReplicaView(
            "r",
            tokens_by_tier={"STORAGE": 1000},
            match_tokens=1000,
            freshness=own,
            storage_domain=domain,
            storage_domain_freshness=shared,
        )
        return policy.estimate(view, 1000).load_s

    full = load_s("live", None, None)
    assert full > 0
    assert load_s("connecting", None, None) == 0  # a private disk: its own feed decides
    assert load_s("connecting", "d", "live") == full
    assert load_s("connecting", "d", None) == full  # no evictor feed: nothing evicts unseen
    assert load_s("live", "d", "stale") == pytest.approx(0.25 * full)
    assert load_s("live", "d", "connecting") == 0


def test_layouts_parse_from_flags_files_and_pod_annotations() -> None:
    from kvroute.router.config import ConfigError
    from kvroute.router.fleet.discovery.k8s_pods import ANNOTATIONS
    from kvroute.router.specs import parse_replica, parse_replica_flag

    flag = parse_replica_flag("http://h:1,storage_domain=pvc,layout=Qwen_Qwen3-0.6B_3f2a9c1b7d4e")
    assert (flag.storage_domain, flag.layout) == ("pvc", "Qwen_Qwen3-0.6B_3f2a9c1b7d4e")
    item = parse_replica({"url": "http://h:1", "storage_domain": "d", "layout": "9a1b2c3d4e5f6a7b"})
    assert item.layout == "9a1b2c3d4e5f6a7b"
    assert parse_replica("http://h:1,storage_domain=d").layout is None
    assert "layout" in ANNOTATIONS
    with pytest.raises(ConfigError, match="needs storage_domain"):
        parse_replica_flag("http://h:1,layout=x")
    for bad in ("a#b", "a:b", ""):
        with pytest.raises(ConfigError, match="layout"):
            ReplicaConfig("http://h:1", storage_domain="d", layout=bad)
