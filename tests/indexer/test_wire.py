"""The wire decoder: both encodings, every field, lenient on extras, strict on what it needs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.wire import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    UnknownEvent,
    WireError,
    classify_store,
    decode_batch,
    decode_frames,
    decode_replay_reply,
    encode_batch,
    encode_frames,
    encode_replay_end,
    encode_replay_reply,
    is_device_clear,
    medium_kind,
    touches_lower_tier,
)

enc = msgspec.msgpack.encode


def stored_map(**over: object) -> dict[str, object]:
    event: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": 10,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(over)
    return event


def test_map_tagged_block_stored_every_field() -> None:
    payload = enc(
        [
            1.5,
            [
                stored_map(
                    extra_keys=[["adapter", "salt"], None],
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                    kv_cache_spec_sliding_window=None,
                    locality="LOCAL",
                    ownership="x",
                    session_id="s",
                    lookahead_token_ids=[9],
                    lora_name="adapter",
                    lora_id=3,
                    some_future_field={"a": 1},
                )
            ],
            2,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 2 and batch.rejected == []
    (event,) = batch.events
    assert event == BlockStored(
        block_hashes=[11, 12],
        parent_block_hash=10,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        medium=Medium.GPU,
        lora_name="adapter",
        lora_id=3,
        extra_keys=[["adapter", "salt"], None],
        group_idx=0,
        locality="LOCAL",
        ownership="x",
        spec_kind="full_attention",
    )


def test_positional_array_events_from_older_vllm() -> None:
    payload = enc(
        [
            2.0,
            [
                ["BlockStored", [5], None, [7, 8], 2, None, "CPU", None],
                ["BlockRemoved", [5], "GPU"],
                ["BlockStored", [6], 5, [9, 9], 2, None],  # shorter: medium missing -> GPU
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored([5], None, [7, 8], 2, medium=Medium.CPU),
        BlockRemoved([5], Medium.GPU),
        BlockStored([6], 5, [9, 9], 2),
        AllBlocksCleared(),
    ]


def test_bytes_hashes_become_their_low_64_bits() -> None:
    digest = bytes(range(32))
    payload = enc(
        [0.0, [stored_map(block_hashes=[digest, digest[::-1]], parent_block_hash=digest)]]
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [
        int.from_bytes(digest[-8:], "big"),
        int.from_bytes(digest[::-1][-8:], "big"),
    ]
    assert event.parent_block_hash == int.from_bytes(digest[-8:], "big")


@pytest.mark.parametrize(
    ("raw", "tier", "confirmed"),
    [
        (None, Medium.GPU, True),
        ("GPU", Medium.GPU, True),
        ("CPU", Medium.CPU, True),
        ("STORAGE", Medium.STORAGE, True),
        ("cpu", Medium.CPU, False),  # LMCache: stores only
        ("SHARED_STORAGE", Medium.STORAGE, False),  # llm-d's FS backend: stores only
        ("OBJECT_STORE", Medium.STORAGE, False),
    ],
)
def test_media_of_known_publishers(raw: object, tier: Medium, confirmed: bool) -> None:
    kind = medium_kind(raw)
    assert (kind.tier, kind.confirmed) == (tier, confirmed)


def test_other_publishers_media_keep_their_spelling_on_the_wire() -> None:
    events = [
        BlockStored([5], None, [7, 8], 2, medium=Medium.CPU, confirmed=False, medium_name="cpu"),
        BlockStored([6], None, [], 0, Medium.STORAGE, confirmed=False, medium_name="OBJECT_STORE"),
    ]
    assert decode_batch(encode_batch(events, ts=1.0)).events == events


@pytest.mark.parametrize("raw", ["tape", "", "gpu", "cuda", "disk", "Storage", 3, ["GPU"]])
def test_unknown_medium_is_counted_never_guessed(raw: object) -> None:
    with pytest.raises(ValueError):
        medium_kind(raw)
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": raw}
    batch = decode_batch(
        enc([0.0, [stored_map(medium=raw), stored_map(block_hashes=[1, 2]), removed]])
    )
    assert len(batch.events) == 1 and batch.rejected == []
    assert sum(batch.unknown_media.values()) == 2


def test_llmd_fs_backend_nested_positional_events() -> None:
    """llm-d's FS backend: each event msgpack-packed on its own, positional, parent 0 meaning
    unknown, no data-parallel rank in the batch."""
    inner = enc(["BlockStored", [2**64 - 1, 7], 0, [], 0, None, "SHARED_STORAGE"])
    batch = decode_batch(enc([1.0, [inner, enc(["BlockStored", [8], 0, [], 0, None, "TAPE"])]]))
    assert batch.events == [
        BlockStored(
            [2**64 - 1, 7],
            None,
            [],
            0,
            medium=Medium.STORAGE,
            confirmed=False,
            medium_name="SHARED_STORAGE",
        )
    ]
    assert batch.unknown_media == {"TAPE": 1} and batch.data_parallel_rank is None


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (stored_map(token_ids=[1, 2, 3]), "tokens for 2 blocks"),
        (stored_map(block_hashes="nope"), "block_hashes"),
        (stored_map(block_hashes=[1.5, 2]), "block hash"),
        (stored_map(block_size=-2), "negative"),
        (stored_map(block_size=0), "block_size 0"),
        (stored_map(extra_keys=[None]), "extra_keys"),
        (stored_map(lora_name=5), "lora_name"),
        ({"no_type": 1}, "type"),
        (["BlockRemoved"], "block_hashes"),
        (42, "neither"),
    ],
)
def test_malformed_events_rejected_with_reason_rest_of_batch_kept(bad: object, reason: str) -> None:
    good = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    batch = decode_batch(enc([0.0, [good, bad, good]]))
    assert batch.events == [BlockRemoved([3]), BlockRemoved([3])]
    assert len(batch.rejected) == 1 and reason in batch.rejected[0]


def test_a_store_of_no_block_is_skipped_not_rejected() -> None:
    """vLLM 0.32's block pool queues a BlockStored even when a block mask leaves no block to
    store (a Mamba group with EAGLE's dropped block, tests/indexer/index/test_hybrid_vllm.py):
    nothing to apply, and nothing malformed."""
    good = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    batch = decode_batch(enc([0.0, [good, stored_map(block_hashes=[], token_ids=[]), good]]))
    assert batch.events == [BlockRemoved([3]), BlockRemoved([3])] and batch.rejected == []


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", enc({"x": 1}), enc([1.0]), enc(["ts", []]), enc([1.0, "events"]), enc(7)],
)
def test_undecodable_payload_raises_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_frames_round_trip_and_errors() -> None:
    frame = decode_frames(encode_frames("kv@a", 2**40 + 3, b"p"))
    assert (frame.topic, frame.seq, frame.payload) == ("kv@a", 2**40 + 3, b"p")
    for frames in (
        [b"t", b"\x00" * 8],
        [b"t", b"\x00" * 7, b"p"],
        [b"\xff\xfe", b"\x00" * 8, b"p"],
    ):
        with pytest.raises(WireError):
            decode_frames(frames)


def test_replay_reply_and_end_marker() -> None:
    reply = encode_replay_reply(b"id", "kv", 5, b"payload")[1:]  # a DEALER does not see the id
    frame = decode_replay_reply(reply)
    assert frame is not None and frame.seq == 5 and frame.payload == b"payload"
    assert decode_replay_reply(encode_replay_end(b"id")[1:]) is None
    with pytest.raises(WireError):
        decode_replay_reply([b"x", b"kv", b"\x00" * 8, b"p"])


def test_encoding_matches_vllm_layout() -> None:
    """The map layout and field order vLLM 0.32's msgspec structs produce (omit_defaults)."""
    payload = encode_batch(
        [
            BlockStored([1], None, [4, 5], 2, medium=Medium.CPU),
            BlockRemoved([1]),
            AllBlocksCleared(),
        ],
        ts=3.0,
    )
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 3.0 and raw[2] is None
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_an_older_vllm_map_without_the_later_fields_decodes_the_same() -> None:
    """A map lacking ``lora_id``, ``medium`` and ``lora_name`` (vLLM before them) is refused by
    the wire definition, whose fields vLLM 0.32 always sends, and decoded by the tolerant path
    to the same event."""
    old = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    old |= {"token_ids": [4, 5], "block_size": 2}
    batch = decode_batch(enc([1.0, [old, {"type": "BlockRemoved", "block_hashes": [1]}]]))
    assert batch.rejected == []
    assert batch.events == [BlockStored([1], None, [4, 5], 2), BlockRemoved([1])]


def test_which_events_clear_the_device_or_touch_a_lower_tier() -> None:
    assert is_device_clear(AllBlocksCleared()) and is_device_clear(AllBlocksCleared(Medium.GPU))
    assert not is_device_clear(AllBlocksCleared(Medium.CPU))
    assert not is_device_clear(BlockRemoved([1]))
    assert touches_lower_tier(AllBlocksCleared(Medium.STORAGE))
    assert touches_lower_tier(BlockRemoved([1], Medium.CPU))
    assert touches_lower_tier(BlockStored([1], None, [], 0, medium=Medium.GPU, confirmed=False))
    assert not touches_lower_tier(BlockStored([1], None, [1], 1))
    assert not touches_lower_tier(AllBlocksCleared())


hashes = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4)
media = st.sampled_from(list(Medium))


@st.composite
def events(draw: st.DrawFn) -> BlockStored | BlockRemoved | AllBlocksCleared:
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "stored":
        hs = draw(hashes)
        bs = draw(st.integers(1, 4))
        tokens = draw(st.lists(st.integers(0, 2**31), min_size=len(hs) * bs, max_size=len(hs) * bs))
        return BlockStored(
            hs,
            draw(st.none() | st.integers(0, 2**64 - 1)),
            tokens,
            bs,
            medium=draw(media),
            lora_name=draw(st.none() | st.text(max_size=5)),
        )
    if kind == "removed":
        return BlockRemoved(draw(hashes), draw(media))
    return AllBlocksCleared()


@settings(max_examples=200, deadline=None)
@given(st.lists(events(), max_size=6), st.booleans())
def test_encode_decode_round_trip(evs: list, positional: bool) -> None:
    batch = decode_batch(encode_batch(evs, ts=1.0, positional=positional))
    assert batch.rejected == []
    # What the publisher's shape says of it comes back with the event (classify_store: a
    # STORAGE store without extra keys is vLLM's FS/OBJ tier).
    for e in evs:
        if isinstance(e, BlockStored):
            e.confirmed, e.engine_hashes = classify_store(
                e.medium.name, MEDIA[e.medium.name], extra_keys=None, ownership=None, group_idx=None
            )
    assert batch.events == evs


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_escape_as_anything_but_wire_error(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except WireError:
        return
    assert isinstance(batch.events, list)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(json_like, max_size=4))
def test_forged_events_are_rejected_not_raised(raw_events: list) -> None:
    batch = decode_batch(enc([0.0, raw_events]))
    assert len(batch.events) + len(batch.rejected) == len(raw_events)


# --- who sent it: vLLM 0.32's publishers, told apart by their events' shape ----------------


def test_unknown_event_type_is_kept_in_place_and_counted() -> None:
    """An event of a type no definition has (vLLM's proposed TierBlocksCleared) is neither
    dropped nor rejected: it stays where it was in the batch, so the index can distrust what
    it may have changed, and is counted by type."""
    good = {"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU"}
    tier_clear = {"type": "TierBlocksCleared", "medium": "CPU"}
    for encoded in (tier_clear, ["TierBlocksCleared", "CPU"]):
        batch = decode_batch(enc([0.0, [good, encoded, good]]))
        assert batch.events == [
            BlockRemoved([3]),
            UnknownEvent("TierBlocksCleared"),
            BlockRemoved([3]),
        ]
        assert batch.rejected == [] and batch.unknown_types == {"TierBlocksCleared": 1}
    assert touches_lower_tier(UnknownEvent("X"))


def test_storage_without_extra_keys_or_ownership_is_vllm_fs_obj_tier() -> None:
    """vLLM's offloading connector never sends extra keys; of its STORAGE tiers only KVCR
    (``ownership="kvcr"``) announces removals: FS and OBJ stores are unconfirmed, resolved by
    vLLM's hashes. kvroute's connector and evictor send extra keys: confirmed."""
    fs = stored_map(medium="STORAGE", locality="REMOTE", kv_cache_spec_kind="full_attention")
    tier_only = stored_map(medium="STORAGE", token_ids=[], block_size=0, parent_block_hash=None)
    kvcr = stored_map(medium="STORAGE", token_ids=[], block_size=0, ownership="kvcr")
    kvroute = stored_map(medium="STORAGE", extra_keys=[None, None], locality="LOCAL")
    cpu = stored_map(medium="CPU")
    batch = decode_batch(enc([0.0, [fs, tier_only, kvcr, kvroute, cpu]]))
    got = [(e.confirmed, e.engine_hashes) for e in batch.events]
    assert got == [(False, True), (False, True), (True, False), (True, False), (True, False)]
    assert batch.events[0].locality == "REMOTE" and batch.events[2].ownership == "kvcr"


def test_mooncake_cpu_has_a_group_lmcache_none() -> None:
    """Mooncake's store connector sends ``medium="cpu"`` with ``group_idx`` (0 included) and
    vLLM's hashes; LMCache's events never carry the field. Both never remove: unconfirmed."""
    mooncake = stored_map(medium="cpu", block_hashes=[11], token_ids=[1, 2], group_idx=0)
    tokenless = stored_map(medium="cpu", block_hashes=[11], token_ids=[], group_idx=0)
    lmcache = stored_map(medium="cpu")
    for positional in (False, True):
        events = [mooncake, tokenless, lmcache]
        if positional:  # the tolerant path decides alike
            events = [*events, ["Unknown"]]
        batch = decode_batch(enc([0.0, events]))
        got = [(e.confirmed, e.engine_hashes) for e in batch.events if isinstance(e, BlockStored)]
        assert got == [(False, True), (False, True), (False, False)]
    # kvroute's encoder keeps group 0 on such an event (the simulator and tests publish it)
    (again,) = decode_batch(
        encode_batch([decode_batch(enc([0.0, [mooncake]])).events[0]], ts=0)
    ).events
    assert again.engine_hashes and again.group_idx == 0


def test_pool_tier_is_simple_cpu_offload_shape() -> None:
    """SimpleCPUOffloadConnector's stores: one block, ``locality="LOCAL"``, a spec kind."""
    simple = stored_map(
        medium="CPU",
        block_hashes=[11],
        token_ids=[1, 2],
        locality="LOCAL",
        kv_cache_spec_kind="full_attention",
        group_idx=0,
    )
    kvroute = stored_map(medium="CPU", extra_keys=[None, None], locality="LOCAL")
    offloading = stored_map(medium="CPU", kv_cache_spec_kind="full_attention", group_idx=0)
    batch = decode_batch(enc([0.0, [simple, kvroute, offloading]]))
    assert [e.pool_tier for e in batch.events] == [True, False, False]


def _lmcache_event(tokens: list[int], start: int, end: int, medium: object = "cpu") -> dict:
    """LMCache 0.5.x's CacheStoreEvent as vLLM's LMCacheConnectorV1 forwards it (positional
    fields of BlockStored): token_ids is ``tokens[start:end + 1]`` (lmcache.utils.
    convert_tokens_to_list), block_size the chunk's token count."""
    return {
        "type": "BlockStored",
        "block_hashes": [b"\x07" * 32],
        "parent_block_hash": None if start == 0 else b"\x06" * 32,
        "token_ids": tokens[start : end + 1],
        "block_size": end - start,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def test_lmcache_inclusive_end_chunk_is_keyed_by_its_own_tokens() -> None:
    """A chunk followed by another carries the next chunk's first token (257 ids for 256):
    the event keeps the chunk's 256; the final chunk of a store carries exactly its own."""
    tokens = list(range(1000, 1000 + 600))
    batch = decode_batch(
        enc([0.0, [_lmcache_event(tokens, 0, 256), _lmcache_event(tokens, 512, 600)]])
    )
    assert not batch.rejected
    first, last = batch.events
    assert isinstance(first, BlockStored) and isinstance(last, BlockStored)
    assert first.token_ids == tokens[:256] and first.block_size == 256
    assert (first.medium, first.confirmed, first.medium_name) == (Medium.CPU, False, "cpu")
    assert last.token_ids == tokens[512:600] and last.block_size == 88


@pytest.mark.parametrize(
    "over",
    [
        {"medium": "CPU"},  # vLLM's own offloading: exact counts, always
        {"medium": "GPU"},
        {"block_hashes": [1, 2]},  # one id more is LMCache's shape for one chunk only
    ],
)
def test_one_token_too_many_is_still_rejected_outside_lmcache(over: dict) -> None:
    tokens = list(range(300))
    event = dict(_lmcache_event(tokens, 0, 256), **over)
    batch = decode_batch(enc([0.0, [event]]))
    assert batch.events == [] and "tokens for" in batch.rejected[0]


def test_lmcache_tensor_path_medium_never_reaches_the_wire() -> None:
    """On LMCache's tensor path the medium is a ``torch.device``: msgspec cannot encode it,
    and vLLM's publisher drops the whole batch (its seq consumed, nothing buffered). A
    stringified device that somehow arrives is an unknown medium, counted, never guessed."""
    batch = decode_batch(enc([0.0, [_lmcache_event(list(range(256)), 0, 256, "cuda:0")]]))
    assert batch.events == [] and batch.unknown_media == {"cuda:0": 1}


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 40), st.sampled_from([4, 8, 16]), st.integers(0, 3))
def test_lmcache_chunks_decode_to_their_own_tokens(n: int, chunk: int, skipped: int) -> None:
    """Every chunk LMCache's store lists (``tokens[start:end + 1]``, the first ``skipped``
    chunks left out as when LMCache already held them) decodes to exactly its own tokens."""
    tokens = list(range(5000, 5000 + n))
    starts = list(range(0, n, chunk))[skipped:]
    events = [_lmcache_event(tokens, s, min(s + chunk, n)) for s in starts]
    batch = decode_batch(enc([0.0, events]))
    assert not batch.rejected and len(batch.events) == len(starts)
    for s, ev in zip(starts, batch.events, strict=True):
        assert isinstance(ev, BlockStored)
        assert ev.token_ids == tokens[s : s + chunk] and ev.block_size == len(ev.token_ids)
