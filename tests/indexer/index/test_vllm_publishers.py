"""vLLM 0.32's publishers beyond the device tier, as the index takes them (docs/indexer.md, "Who
publishes what"): the SimpleCPUOffloadConnector's bare clear, the FS/OBJ tiers that never
remove (locality REMOTE credited to a storage domain), Mooncake's store with vLLM's hashes and
no extra keys, re-stores after a reset that published nothing, the router-seen connector reset,
and events of a type the decoder does not know.

Events go through the wire decoder from maps shaped as each publisher's code builds them (the
fields and values read from vLLM 0.32's sources, named at each builder), so the decoder's
classification is tested with the index's rules; tests/indexer/test_vllm_upstream_publishers.py
runs vLLM's own classes where they run on CPU.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex, domain_key
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.wire import AllBlocksCleared, BlockStored, Event, Medium, decode_batch
from tests.indexer.builders import BS, DOC, hashes_of, removed, stored, tier_only

N_BLOCKS = len(DOC) // BS


def decoded(*events: dict[str, Any]) -> list[Event]:
    batch = decode_batch(msgspec.msgpack.encode([1.0, list(events)]))
    assert not batch.rejected, batch.rejected
    return batch.events


def _store_map(
    tokens: list[int], start: int, n: int, medium: str, salt: str = "", **fields: Any
) -> dict[str, Any]:
    hashes = hashes_of(tokens, start, n, salt)
    parent = None if start == 0 else hashes_of(tokens, start - 1, 1, salt)[0]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens[start * BS : (start + n) * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    event.update(fields)
    return event


def simple_cpu_store(tokens: list[int], b: int, medium: str = "CPU") -> dict[str, Any]:
    """``SimpleCPUOffloadScheduler._process_store_completion``: one block per event,
    ``locality="LOCAL"``, the group's spec kind, ``extra_keys`` None for a plain block."""
    return _store_map(
        tokens,
        b,
        1,
        medium,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality="LOCAL",
    )


def simple_cpu_removed(tokens: list[int], blocks: list[int], medium: str = "CPU") -> dict[str, Any]:
    """``SimpleCPUOffloadScheduler.take_events``: the CPU pool's removal, medium and locality
    set."""
    return {
        "type": "BlockRemoved",
        "block_hashes": [hashes_of(tokens, b, 1)[0] for b in blocks],
        "medium": medium,
        "group_idx": 0,
        "locality": "LOCAL",
    }


CLEAR = {"type": "AllBlocksCleared"}  # BlockPool.reset_prefix_cache: no fields


def fs_store(
    tokens: list[int], start: int, n: int, locality: str | None, salt: str = ""
) -> dict[str, Any]:
    """``OffloadingEventsTracker._take_stored_event`` for an ``OffloadingEvent`` of
    ``FileSystemTierManager`` (self-describing mode): the chunk's hashes and tokens, the
    tier's locality, no extra keys, no ownership."""
    return _store_map(
        tokens, start, n, "STORAGE", salt, group_idx=0, kv_cache_spec_kind="full_attention",
        locality=locality,
    )  # fmt: skip


def mooncake_store(tokens: list[int], b: int, salt: str = "", with_tokens: bool = True) -> dict:
    """``KVCacheStoreSendingThread`` (mooncake/store/worker.py): one block, vLLM's hash and
    parent, ``lora_id``/``lora_name`` None, medium ``"cpu"``, ``group_idx`` set."""
    event = _store_map(tokens, b, 1, "cpu", salt, group_idx=0)
    if not with_tokens:
        event["token_ids"] = []
    return event


def _tiers(index: InMemoryPrefixIndex, replica: str, tokens: list[int], **kw: Any) -> dict:
    m = index.lookup(RequestKeys(tokens, **kw), replicas=[replica])[replica]
    return {
        **{t.name: n for t, n in m.blocks_by_tier.items()},
        **{t.name + "?": n for t, n in m.unconfirmed_by_tier.items()},
    }


# --- SimpleCPUOffloadConnector: a bare clear that may be its CPU pool's ---------------------


def _simple_cpu_replica() -> InMemoryPrefixIndex:
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", decoded(*(simple_cpu_store(DOC, b) for b in range(N_BLOCKS))))
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)))])  # the device evicted them all
    assert _tiers(index, "r", DOC) == {"CPU": N_BLOCKS}
    return index


def test_a_bare_clear_alone_clears_device_and_the_simple_cpu_pool() -> None:
    """The block pool's and the CPU pool's resets both send ``AllBlocksCleared()``: alone in
    its batch, nothing says whose it is, so both are dropped."""
    index = _simple_cpu_replica()
    index.apply("r", [stored(DOC, 0, 2)])
    result = index.apply("r", decoded(CLEAR))
    assert result.device_cleared == 1 and result.cleared == 1
    assert _tiers(index, "r", DOC) == {}


def test_a_bare_clear_before_device_events_is_the_block_pools() -> None:
    """The scheduler publishes the device's events before the connector's: a clear followed by
    a device store in its batch is the block pool's, and the CPU pool is kept."""
    index = _simple_cpu_replica()
    events = decoded(CLEAR, _store_map(DOC, 0, 1, "GPU", extra_keys=[None]))
    index.apply("r", events)
    assert _tiers(index, "r", DOC) == {"GPU": 1, "CPU": N_BLOCKS - 1}


def test_a_bare_clear_after_the_connectors_events_is_the_cpu_pools() -> None:
    index = _simple_cpu_replica()
    index.apply("r", [stored(DOC, 0, 2)])
    result = index.apply("r", decoded(simple_cpu_removed(DOC, [7]), CLEAR))
    assert result.device_cleared == 0
    assert _tiers(index, "r", DOC) == {"GPU": 2}


def test_without_a_pool_tier_a_bare_clear_is_the_devices_only() -> None:
    """vLLM's OffloadingConnector and kvroute's connector keep their tiers on a device reset."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", [stored(DOC, 0, N_BLOCKS, Medium.CPU)])
    index.apply("r", decoded(CLEAR))
    assert _tiers(index, "r", DOC) == {"CPU": N_BLOCKS}


def test_simple_cpu_disk_mode_is_held_unconfirmed_and_its_removals_and_clears_apply() -> None:
    """With a disk pool the SimpleCPUOffloadConnector publishes STORAGE stores that look like
    vLLM's FS tier (no extra keys for plain blocks): held unconfirmed, but its removals and its
    pool's bare clear still take them out."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", decoded(*(simple_cpu_store(DOC, b, "STORAGE") for b in range(N_BLOCKS))))
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)))])
    assert _tiers(index, "r", DOC) == {"STORAGE?": N_BLOCKS}
    index.apply("r", decoded(simple_cpu_removed(DOC, [5], "STORAGE")))
    assert _tiers(index, "r", DOC) == {"STORAGE?": 5}
    index.apply("r", decoded(CLEAR))
    assert _tiers(index, "r", DOC) == {}


# --- vLLM's FS/OBJ tiers: stores only --------------------------------------------------------


def test_fs_tier_stores_are_unconfirmed_age_out_and_keep_their_lora() -> None:
    now = [0.0]
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=60, clock=lambda: now[0])
    lora = [("adapter",)] * N_BLOCKS
    index.apply("r", [stored(DOC, 0, N_BLOCKS, lora_name="adapter", extra=lora, salt="L")])
    index.apply("r", decoded(fs_store(DOC, 0, 4, None, salt="L"), fs_store(DOC, 4, 4, None, "L")))
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)), salt="L")])
    # resolved through vLLM's hashes: the adapter's requests see it, plain ones do not
    assert _tiers(index, "r", DOC, lora_name="adapter") == {"STORAGE?": N_BLOCKS}
    assert _tiers(index, "r", DOC) == {}
    now[0] = 61.0
    index.expire()
    assert _tiers(index, "r", DOC, lora_name="adapter") == {}


def test_kvroutes_own_storage_stays_confirmed() -> None:
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    events = decoded(_store_map(DOC, 0, N_BLOCKS, "STORAGE", extra_keys=[None] * N_BLOCKS))
    assert isinstance(events[0], BlockStored) and events[0].confirmed
    index.apply("r", events)
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)))])
    assert _tiers(index, "r", DOC) == {"STORAGE": N_BLOCKS}


def test_a_remote_fs_tier_is_credited_to_its_storage_domain() -> None:
    """``locality: REMOTE`` is a shared root directory: replicas of the same storage domain
    load those files too (unconfirmed, like the files themselves); LOCAL stays the writer's."""
    index = InMemoryPrefixIndex()
    for r in ("a", "b", "c"):
        index.attach(r, "d" if r != "c" else None)
        index.apply(r, [stored(DOC, 0, 1)])  # each knows the block size (and holds block 0)
    index.apply("a", [stored(DOC, 1, N_BLOCKS - 1)])  # as vLLM: a hit is not stored again
    index.apply("a", decoded(fs_store(DOC, 0, 4, "REMOTE"), fs_store(DOC, 4, 4, "REMOTE")))
    assert _tiers(index, "b", DOC) == {"GPU": 1, "STORAGE?": N_BLOCKS - 1}
    assert _tiers(index, "c", DOC) == {"GPU": 1}
    # the same files written by b are held once by the domain
    domain = index._replicas[domain_key("d")]
    assert domain.tier_counts[int(Medium.STORAGE) + 3] == N_BLOCKS
    index.apply("b", [stored(DOC, 1, N_BLOCKS - 1)])  # as vLLM: a hit is not stored again
    index.apply("b", decoded(fs_store(DOC, 0, 4, "REMOTE")))
    assert domain.tier_counts[int(Medium.STORAGE) + 3] == N_BLOCKS
    assert domain.unconfirmed_blocks == N_BLOCKS
    # LOCAL: the writer's own
    index.apply("c", [stored(DOC, 1, N_BLOCKS - 1)])  # as vLLM: a hit is not stored again
    index.apply("c", decoded(fs_store(DOC, 0, 4, "LOCAL"), fs_store(DOC, 4, 4, "LOCAL")))
    index.apply("c", [removed(DOC, list(range(N_BLOCKS)))])
    assert _tiers(index, "c", DOC) == {"STORAGE?": N_BLOCKS}
    index.attach("c", "d")
    assert _tiers(index, "c", DOC) == {"STORAGE?": N_BLOCKS}


def test_index_stats_shows_a_domains_unconfirmed_blocks_until_they_age_out() -> None:
    """/index/stats's ``storage_domains`` counts a domain's unconfirmed chunks apart from its
    confirmed ones (here vLLM's REMOTE FS files; llm-d's PVC over HTTP in
    tests/router/routing/test_llmd_pvc.py), and the count follows the age-out."""
    now = [0.0]
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=60.0, clock=lambda: now[0])
    index.attach("a", "d")
    index.apply("a", [stored(DOC, 0, N_BLOCKS)])
    index.apply("a", decoded(fs_store(DOC, 0, 4, "REMOTE"), fs_store(DOC, 4, 4, "REMOTE")))
    index.apply("a", [stored(DOC, 0, 4, Medium.STORAGE)])  # kvroute's connector: confirmed
    domain = collect_stats(index).to_dict()["storage_domains"]["d"]
    assert (domain["blocks"], domain["unconfirmed_blocks"]) == (4, N_BLOCKS)
    assert domain["attached"] == ["a"]
    now[0] = 61.0
    index.expire()
    domain = collect_stats(index).to_dict()["storage_domains"]["d"]
    assert (domain["blocks"], domain["unconfirmed_blocks"]) == (4, 0)


# --- Mooncake's store: vLLM's hashes, no extra keys -----------------------------------------


def test_mooncake_blocks_resolve_through_vllm_hashes_never_by_tokens() -> None:
    """A LoRA request's blocks stored by Mooncake carry neither LoRA nor extra keys: keyed by
    their tokens they would be credited to plain requests. Resolved through the device events'
    map, they stay the adapter's."""
    index = InMemoryPrefixIndex()
    lora = [("adapter",)] * N_BLOCKS
    index.apply("r", [stored(DOC, 0, N_BLOCKS, lora_name="adapter", extra=lora, salt="L")])
    index.apply("r", decoded(*(mooncake_store(DOC, b, "L", b % 2 == 0) for b in range(N_BLOCKS))))
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)), salt="L")])
    assert _tiers(index, "r", DOC, lora_name="adapter") == {"CPU?": N_BLOCKS}
    assert _tiers(index, "r", DOC) == {}
    # a block whose hash the replica never keyed is not guessed
    result = index.apply("r", decoded(mooncake_store(DOC, 0, salt="other")))
    assert result.unresolved == 1 and result.unconfirmed_blocks == 0


# --- resets that publish nothing ------------------------------------------------------------


def test_a_chunk_restored_after_a_silent_reset_goes_with_its_next_removal() -> None:
    """vLLM's OffloadingConnector never stores a chunk it holds: a second store of a held
    chunk follows ``reset_external`` (which published nothing); counted twice, the stale copy
    would outlive the chunk's removal forever."""
    for self_describing in (True, False):
        index = InMemoryPrefixIndex()
        index.apply("r", [stored(DOC, 0, N_BLOCKS)])
        if self_describing:
            store = [stored(DOC, 0, 4, Medium.CPU, with_extra_keys=False)]
        else:
            from tests.indexer.builders import tier_only

            store = [tier_only(DOC, [3], Medium.CPU)]
        index.apply("r", store)
        index.apply("r", store)  # the re-store after the silent reset
        index.apply("r", [removed(DOC, list(range(N_BLOCKS)))])
        removal = removed(DOC, [0, 1, 2, 3] if self_describing else [3], Medium.CPU)
        index.apply("r", [removal])
        assert _tiers(index, "r", DOC) == {}, self_described(self_describing)


def self_described(flag: bool) -> str:
    return "self-describing" if flag else "tier-only"


def test_reset_connector_drops_cpu_keeps_device_and_storage() -> None:
    """What ``reset_prefix_cache(reset_connector=True)`` empties without an event: vLLM's
    offloading CPU tier and Mooncake's store; FS/OBJ files and kvroute's disk stay."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", [stored(DOC, 0, 4, Medium.CPU, with_extra_keys=False)])
    index.apply("r", decoded(*(mooncake_store(DOC, b) for b in range(4, N_BLOCKS))))
    index.apply("r", [stored(DOC, 0, N_BLOCKS, Medium.STORAGE)])
    index.apply("r", [removed(DOC, list(range(2, N_BLOCKS)))])
    assert _tiers(index, "r", DOC) == {"GPU": 2, "CPU": 2, "STORAGE": 4}
    assert index.block_tiers("r", DOC)[5] == {"CPU_UNCONFIRMED", "STORAGE"}
    index.reset_connector("r")
    assert _tiers(index, "r", DOC) == {"GPU": 2, "STORAGE": N_BLOCKS - 2}
    assert index.block_tiers("r", DOC)[5] == {"STORAGE"}
    index.reset_connector("nobody")  # unknown replica: nothing happens


def test_a_reset_with_the_devices_drops_cpu_again_at_its_clear() -> None:
    """The router learns of a reset (``device_cleared``: vLLM reset the device's prefix cache
    with it) while the replica's stream is behind: batches published before the reset store
    CPU chunks after the router dropped CPU. The reset's own ``AllBlocksCleared`` comes after
    them in the stream and drops them; what is stored after it stays, and a later clear (no
    reset pending) keeps CPU."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS), stored(DOC, 0, 2, Medium.CPU)])
    index.reset_connector("r", device_cleared=True)
    assert _tiers(index, "r", DOC) == {"GPU": N_BLOCKS}
    # the backlog: a CPU store published before the reset, applied now
    index.apply("r", [stored(DOC, 0, 4, Medium.CPU)])
    assert _tiers(index, "r", DOC) == {"GPU": N_BLOCKS}
    assert index.block_tiers("r", DOC)[3] == {"GPU", "CPU"}
    # the reset's batch: the device's clear, then what the connector stored after it
    index.apply("r", [AllBlocksCleared(), stored(DOC, 0, 2, Medium.CPU)])
    assert [t for t in index.block_tiers("r", DOC)[:4]] == [{"CPU"}, {"CPU"}, set(), set()]
    index.apply("r", [AllBlocksCleared()])  # a device-only reset later: CPU is kept
    assert index.block_tiers("r", DOC)[:2] == [{"CPU"}, {"CPU"}]


def _offloaded_chunks(index: InMemoryPrefixIndex) -> None:
    """vLLM's OffloadingConnector (tier-only stores, 2-block chunks) holds DOC's first four
    blocks in CPU; the device keeps block 0."""
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", [tier_only(DOC, [1], Medium.CPU), tier_only(DOC, [3], Medium.CPU)])
    index.apply("r", [removed(DOC, list(range(1, N_BLOCKS)))])


def test_a_device_clear_nobody_announced_bounds_the_silent_cpu_tier() -> None:
    """A device clear the router was not told of may be a connector reset sent to the
    replica directly (vLLM resets the device with it when it can), which emptied vLLM's
    OffloadingConnector's CPU tier without a word: its chunks are held for
    ``unconfirmed_ttl_s`` only, unless stored again meanwhile."""
    now = [0.0]
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=60.0, clock=lambda: now[0])
    _offloaded_chunks(index)
    assert index.block_tiers("r", DOC)[:4] == [{"GPU", "CPU"}, {"CPU"}, {"CPU"}, {"CPU"}]
    index.apply("r", [AllBlocksCleared()])
    now[0] = 30.0
    index.apply("r", [tier_only(DOC, [3], Medium.CPU)])  # the connector stored it again
    index.expire()
    assert index.block_tiers("r", DOC)[:4] == [{"CPU"}, {"CPU"}, {"CPU"}, {"CPU"}]
    now[0] = 60.0
    assert index.expire() == 2
    assert index.block_tiers("r", DOC)[:4] == [set(), set(), {"CPU"}, {"CPU"}]


def test_a_device_reset_the_router_forwarded_keeps_the_cpu_tier() -> None:
    """``/reset_prefix_cache`` without ``reset_external`` through the router: the device
    alone; the CPU tier stays confirmed, without an age."""
    now = [0.0]
    index = InMemoryPrefixIndex(unconfirmed_ttl_s=60.0, clock=lambda: now[0])
    _offloaded_chunks(index)
    index.expect_device_reset("r")
    index.apply("r", [AllBlocksCleared()])
    now[0] = 600.0
    assert index.expire() == 0
    assert index.block_tiers("r", DOC)[:4] == [{"CPU"}, {"CPU"}, {"CPU"}, {"CPU"}]
    index.apply("r", [AllBlocksCleared()])  # the next one, unannounced: aged again
    now[0] = 660.0
    assert index.expire() == 4


def test_a_reset_alone_marks_nothing_and_a_cleared_stream_keeps_the_mark() -> None:
    """Without the device's reset (``{"success": false}``) nothing marks the reset in the
    stream: a later device clear keeps CPU. A stream cleared after a gap keeps the mark: the
    replay refills it from batches that may predate the reset, and the reset's clear, replayed
    after them, drops their CPU stores."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, 2)])
    index.reset_connector("r")
    index.apply("r", [stored(DOC, 0, 2, Medium.CPU), AllBlocksCleared()])
    assert index.block_tiers("r", DOC)[:2] == [{"CPU"}, {"CPU"}]
    index.reset_connector("r", device_cleared=True)
    index.clear_source("r", "", restarted=False)
    index.apply("r", [stored(DOC, 0, 2), stored(DOC, 0, 2, Medium.CPU), AllBlocksCleared()])
    assert index.block_tiers("r", DOC)[:2] == [set(), set()]


# --- events of a type the decoder does not know ---------------------------------------------


def test_an_unknown_event_type_drops_the_lower_tiers_of_its_stream() -> None:
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])
    index.apply("r", [stored(DOC, 0, 4, Medium.CPU), stored(DOC, 4, 4, Medium.STORAGE)])
    index.apply("r", decoded(fs_store(DOC, 0, 4, None)))
    index.apply("r", decoded(mooncake_store(DOC, 0)), source="aux")
    events = decoded({"type": "TierBlocksCleared", "medium": "CPU"})
    result = index.apply("r", events)
    assert result.distrusted == 1 and result.applied == 1
    m = index.lookup(DOC, replicas=["r"])["r"]
    assert m.blocks_by_tier == {Medium.GPU: N_BLOCKS}
    # the other stream's holdings are its own (it sent nothing unknown)
    index.apply("r", [removed(DOC, list(range(N_BLOCKS)))])
    assert _tiers(index, "r", DOC) == {"CPU?": 1}


# --- the rule in general ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["dev", "pool", "evict", "pool_evict", "clear", "clear+dev"]),
            st.integers(0, N_BLOCKS - 1),
        ),
        max_size=25,
    )
)
def test_a_simple_cpu_replica_never_holds_a_block_its_pools_lost(ops: list) -> None:
    """A model of a SimpleCPUOffloadConnector replica: a device pool and a CPU pool, each a
    set of blocks; a reset (``reset_external``) clears both and publishes a bare clear per
    pool, in the scheduler's order (device's first, then the connector's). Whatever the mix,
    the index never claims a block in a tier that lost it."""
    index = InMemoryPrefixIndex()
    gpu: set[int] = set()
    cpu: set[int] = set()
    for op, b in ops:
        batch: list[Any] = []
        if op == "dev" and b not in gpu:
            parent = b == 0 or (b - 1) in gpu
            if parent:
                batch.append(_store_map(DOC, b, 1, "GPU", extra_keys=[None]))
                gpu.add(b)
        elif op == "pool" and b in gpu and b not in cpu:
            batch.append(simple_cpu_store(DOC, b))
            cpu.add(b)
        elif op == "evict" and b in gpu:
            batch.append({"type": "BlockRemoved", "block_hashes": hashes_of(DOC, b, 1)})
            gpu.discard(b)
        elif op == "pool_evict" and b in cpu:
            batch.append(simple_cpu_removed(DOC, [b]))
            cpu.discard(b)
        elif op in ("clear", "clear+dev"):
            device_too = op == "clear+dev"
            if device_too:
                batch.append(CLEAR)
                gpu.clear()
            batch.append(CLEAR)  # the CPU pool's, after the device's
            cpu.clear()
        if batch:
            index.apply("r", decoded(*batch))
        tiers = index.block_tiers("r", DOC)
        for i, held in enumerate(tiers):
            assert "GPU" not in held or i in gpu, (ops, i, held)
            assert "CPU" not in held or i in cpu, (ops, i, held)


@settings(max_examples=150, deadline=None)
@given(
    st.booleans(),
    st.lists(
        st.tuples(st.sampled_from(["store", "evict", "silent_reset"]), st.integers(0, 3)),
        max_size=30,
    ),
)
def test_after_a_silent_reset_an_entry_lives_only_until_its_chunk_is_stored_again(
    self_describing: bool, ops: list
) -> None:
    """A model of vLLM's OffloadingConnector CPU tier (chunks of 2 blocks): it stores a
    prompt's chunks in order, each only when it does not hold it, announces evictions, and its
    reset announces nothing. The
    index holds a chunk exactly when vLLM does, or when vLLM held it at a silent reset and has
    not stored it since: once stored again, its next removal takes it out for good."""
    index = InMemoryPrefixIndex()
    index.apply("r", [stored(DOC, 0, N_BLOCKS)])  # the device keeps DOC: every hash known
    held: set[int] = set()
    stale: set[int] = set()
    for op, k in ops:
        if op == "store":
            # a prompt's chunks, in order, those it does not hold (one step's batch)
            missing = [c for c in range(k + 1) if c not in held]
            if self_describing:
                events = [stored(DOC, 2 * c, 2, Medium.CPU, with_extra_keys=False) for c in missing]
            else:
                events = [tier_only(DOC, [2 * c + 1], Medium.CPU) for c in missing]
            index.apply("r", events)
            held.update(missing)
            stale.difference_update(missing)
        elif op == "evict" and k in held:
            blocks = [2 * k, 2 * k + 1] if self_describing else [2 * k + 1]
            index.apply("r", [removed(DOC, blocks, Medium.CPU)])
            held.discard(k)
        elif op == "silent_reset":
            stale |= held
            held = set()
        tiers = index.block_tiers("r", DOC)
        for chunk in range(4):
            want = chunk in held or chunk in stale
            assert ("CPU" in tiers[2 * chunk + 1]) == want, (ops, chunk, held, stale)
            # the chunk's first block: claimed whole once the chunk length is learned
            assert "CPU" not in tiers[2 * chunk] or want, (ops, chunk, held, stale)
