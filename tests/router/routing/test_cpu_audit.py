"""An answer as proof the CPU tier lacks chunks (router/routing/cpu_audit.py), and the index's
``refute_cpu`` (indexer/index/resets.py): only what the answer proves, only for connectors
that reset without a word."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockRemoved, Medium
from kvroute.router.routing.cpu_audit import audit_cpu, skips_prefix_cache
from kvroute.router.routing.policies import ReplicaView
from kvroute.router.routing.router import Decision
from tests.indexer.builders import BS, hashes_of, stored, tier_only

PROMPT = list(range(40))  # ten blocks of four tokens
CHUNK = 2  # blocks per chunk of the offloading connector


def _offloaded(index: InMemoryPrefixIndex, *, self_describing: bool = False) -> None:
    """Blocks 0-7 computed; 0-1 stay on the device; 2-7 offloaded in chunks of two by vLLM's
    OffloadingConnector (tier-only, or self-describing without extra keys), then evicted."""
    index.apply("r", [stored(PROMPT, 0, 8)])
    if self_describing:
        index.apply(
            "r",
            [stored(PROMPT, s, CHUNK, Medium.CPU, with_extra_keys=False) for s in (2, 4, 6)],
        )
    else:
        index.apply("r", [tier_only(PROMPT, [3, 5], Medium.CPU)])
        index.apply("r", [tier_only(PROMPT, [7], Medium.CPU)])
    index.apply("r", [BlockRemoved(hashes_of(PROMPT, 2, 6), Medium.GPU)])


def _decision(index: InMemoryPrefixIndex, **view_fields: object) -> Decision:
    """What the router decided for PROMPT: the index's match as ``_match`` records it."""
    request = RequestKeys(PROMPT)
    match = index.lookup(request)["r"]
    view = ReplicaView(name="r", block_size=BS)
    view.match_tokens = match.tokens
    view.tokens_by_tier = {t.name: n * BS for t, n in match.blocks_by_tier.items() if n}
    for name, value in view_fields.items():
        setattr(view, name, value)
    decision = Decision("kvroute", "", [], [view], len(PROMPT))
    decision.keys = {BS: request.keys(BS)}
    return decision


def _cpu_blocks(index: InMemoryPrefixIndex) -> list[bool]:
    return ["CPU" in t for t in index.block_tiers("r", PROMPT)]


@pytest.mark.parametrize("self_describing", [False, True])
def test_an_answer_stopping_at_the_device_refutes_the_predicted_chunks(
    self_describing: bool,
) -> None:
    index = InMemoryPrefixIndex()
    _offloaded(index, self_describing=self_describing)
    decision = _decision(index)
    assert decision.views[0].tokens_by_tier == {"GPU": 8, "CPU": 24}
    assert audit_cpu(index, decision, "r", delivered=40) == 0  # more than the device: held
    assert audit_cpu(index, decision, "r", delivered=12) == 0  # past the device's part
    assert _cpu_blocks(index)[:8] == [False, False] + [True] * 6
    assert audit_cpu(index, decision, "r", delivered=8) == 6  # the device's part only
    assert _cpu_blocks(index)[:8] == [False] * 8
    assert index.stats().refuted_cpu_blocks == 6
    assert index.summary()[0].entries_by_tier.get("CPU", 0) == 0


def test_what_an_answer_cannot_prove_is_left_alone() -> None:
    index = InMemoryPrefixIndex()
    _offloaded(index)
    cases = [
        _decision(index, hint_tokens=36),  # a router-local hint priced more of the device
        _decision(index, tokens_by_tier={"GPU": 8, "CPU": 16, "STORAGE": 8}),
    ]
    skipped = _decision(index)
    skipped.skips_cache = True  # prompt logprobs: vLLM read no cache at all
    remote = _decision(index)
    remote.remote_prefill = True  # a P/D decode leg reports its prefill's cached tokens
    batch = _decision(index)
    batch.batch_sizes = [40, 40]
    for decision in [*cases, skipped, remote, batch]:
        assert audit_cpu(index, decision, "r", delivered=0) == 0
    assert audit_cpu(index, _decision(index), "r", delivered=None) == 0  # not reported
    assert audit_cpu(index, _decision(index), "other", delivered=0) == 0  # not a candidate
    assert _cpu_blocks(index)[2:8] == [True] * 6


def test_connectors_that_announce_their_resets_are_not_refuted() -> None:
    """kvroute's connector (stores with extra keys) and the SimpleCPUOffloadConnector's pool
    publish their resets: a short answer there is a race or a failed load, not a reset."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(PROMPT, 0, 8)])
    index.apply("r", [stored(PROMPT, 2, CHUNK, Medium.CPU), stored(PROMPT, 4, CHUNK, Medium.CPU)])
    index.apply("r", [BlockRemoved(hashes_of(PROMPT, 2, 6), Medium.GPU)])
    decision = _decision(index)
    assert decision.views[0].tokens_by_tier == {"GPU": 8, "CPU": 16}
    assert audit_cpu(index, decision, "r", delivered=8) == 0
    pool = InMemoryPrefixIndex()
    pool.apply("r", [stored(PROMPT, 0, 8)])
    for b in range(2, 6):
        event = stored(PROMPT, b, 1, Medium.CPU)
        pool.apply("r", [replace(event, pool_tier=True)])
    pool.apply("r", [BlockRemoved(hashes_of(PROMPT, 2, 6), Medium.GPU)])
    assert pool.refute_cpu("r", RequestKeys(PROMPT).keys(BS)) == 0


def test_skipping_the_prefix_cache_is_read_from_the_body() -> None:
    assert skips_prefix_cache({"prompt_logprobs": 0})
    assert skips_prefix_cache({"prompt_logprobs": 5})
    assert skips_prefix_cache({"echo": True, "logprobs": 2})
    assert skips_prefix_cache({"skip_reading_prefix_cache": True})
    assert not skips_prefix_cache({"prompt_logprobs": None, "echo": True})
    assert not skips_prefix_cache({"logprobs": 2})
