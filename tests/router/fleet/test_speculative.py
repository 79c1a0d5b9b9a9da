"""A replica's speculative decoding method (``speculative=``): the flag, the replicas file, the
Kubernetes annotation, data-parallel ranks, and the router's index applying EAGLE's dropped
block to that replica alone (indexer/index/drafts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.router.config import ConfigError, ReplicaConfig
from kvroute.router.fleet.discovery.k8s_pods import ANNOTATIONS, pod_replicas
from kvroute.router.fleet.dp import static_targets
from kvroute.router.specs import load_replicas_file, parse_replica_flag
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.indexer.builders import BS, DOC, stored
from tests.router.k8s_apiserver import make_pod
from tests.router.sim_fleet import make_fleet
from tests.waiting import wait_until


def test_the_flag_names_vllms_method_in_lower_case_and_none_is_none() -> None:
    assert parse_replica_flag("http://h:1").speculative is None
    assert parse_replica_flag("http://h:1,speculative=EAGLE3").speculative == "eagle3"
    assert parse_replica_flag("http://h:1,speculative=ngram_gpu").speculative == "ngram_gpu"
    assert parse_replica_flag("http://h:1,speculative=none").speculative is None
    for bad in ("a#b", "", "x y"):
        with pytest.raises(ConfigError, match="speculative"):
            ReplicaConfig("http://h:1", speculative=bad)


def test_a_replicas_file_and_a_pod_annotation_set_it(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text(
        "replicas:\n  - {url: 'http://a:1', name: a, speculative: mtp}\n  - http://b:1,name=b\n"
    )
    assert {r.name: r.speculative for r in load_replicas_file(path)} == {"a": "mtp", "b": None}
    path.write_text("replicas:\n  - {url: 'http://a:1', speculative: 3}\n")
    with pytest.raises(ConfigError, match="'speculative' must be a string"):
        load_replicas_file(path)
    assert "speculative" in ANNOTATIONS
    pod = make_pod("p-0", "10.0.0.1", annotations={"kvroute.io/speculative": "eagle"})
    (replica,) = pod_replicas(pod)
    assert replica.speculative == "eagle"
    assert pod_replicas(make_pod("p-1", "10.0.0.2"))[0].speculative is None


def test_data_parallel_ranks_keep_their_servers_method() -> None:
    server = ReplicaConfig("http://h:1", name="s", dp=2, events="tcp://h:5557", speculative="mtp")
    assert [t.speculative for t in static_targets(server)] == ["mtp", "mtp"]


def test_the_router_predicts_its_eagle_replica_one_block_lower(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=1, events=False) as fleet:
        service = fleet.service
        url = service.registry.get("r0").config.url  # type: ignore[union-attr]
        service.add_replica(ReplicaConfig(url, name="drafts", speculative="eagle"))
        index = service.index
        assert isinstance(index, InMemoryPrefixIndex)
        for name in ("r0", "drafts"):
            index.apply(name, [stored(DOC, 0, 5)])
        wait_until(lambda: index.lookup(DOC)["drafts"].blocks == 4, timeout_s=10)
        matches = index.lookup(DOC)
        assert (matches["r0"].blocks, matches["drafts"].blocks) == (5, 4)
        assert matches["drafts"].tokens == 4 * BS


_PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 0.0
"""


@pytest.mark.parametrize(
    ("setting", "page", "warned"),
    [
        (None, _PAGE, True),
        ("eagle", _PAGE, False),  # configured: nothing to say
        ("ngram", _PAGE, False),
        (None, _PAGE.replace("spec_decode_num_drafts", "other"), False),  # no drafts at all
    ],
)
def test_drafts_on_a_replica_whose_method_is_unknown_are_warned_of(
    setting: str | None, page: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's spec-decode counters say that drafts are on, never which method: the router
    can only ask for ``speculative=`` (one warning, and ``Replica.drafts_unknown``)."""
    import asyncio

    import httpx

    from kvroute.router.fleet.health import HealthChecker
    from kvroute.router.fleet.replicas import ReplicaRegistry

    registry = ReplicaRegistry()
    replica = registry.add(ReplicaConfig("http://h:1", name="r", speculative=setting))
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=page))

    async def scrape_twice() -> None:
        async with httpx.AsyncClient(transport=transport) as client:
            checker = HealthChecker(registry, client)
            await checker._scrape([replica])
            await checker._scrape([replica])

    with caplog.at_level("WARNING"):
        asyncio.run(scrape_twice())
    assert replica.drafts_unknown is warned
    assert replica.running == 1.0
    messages = [r.getMessage() for r in caplog.records if "speculative" in r.getMessage()]
    assert len(messages) == (1 if warned else 0)
