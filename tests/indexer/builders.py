"""Events as each publisher writes them, for the indexer's tests.

vLLM's block pool (device stores with one ``extra_keys`` entry per block), kvroute's connector
(lower-tier stores with the same fields), vLLM's offloading connector (lower-tier stores without
``extra_keys``, or tier-only stores naming a chunk's last block), LMCache (its own chunk hashes,
the chunk's token count as block size, medium ``cpu``, stores only) and llm-d's FS backend
(tier-only, ``SHARED_STORAGE``, stores only). Engine hashes are vLLM-like: a digest of the whole
prefix and its extra keys, so equal prefixes have equal hashes and nothing else does.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import strategies as st

from kvroute.indexer.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, Medium

__all__ = [
    "BS",
    "DOC",
    "DOCS",
    "OTHER",
    "ehash",
    "hashes_of",
    "lmcache_chunk",
    "operation",
    "removed",
    "stored",
    "tier_only",
]

BS = 4
DOC = list(range(100, 132))  # 8 blocks
OTHER = list(range(100, 108)) + list(range(900, 924))  # shares DOC's first 2 blocks
# Two documents sharing their first two blocks, so replicas hold overlapping prefixes.
DOCS = [list(range(24)), list(range(8)) + list(range(500, 516))]


def ehash(tokens: tuple[int, ...], salt: str = "") -> int:
    """A vLLM-like engine hash: a digest of the whole prefix (and its extra keys), as an int."""
    digest = hashlib.sha256(repr((salt, tokens)).encode()).digest()
    return int.from_bytes(digest[-8:], "big")


def hashes_of(tokens: list[int], start: int, n: int, salt: str = "") -> list[int]:
    return [ehash(tuple(tokens[: (b + 1) * BS]), salt) for b in range(start, start + n)]


def stored(
    tokens: list[int],
    start: int,
    n: int,
    medium: Medium = Medium.GPU,
    *,
    salt: str = "",
    extra: list[Any] | None = None,
    lora_name: str | None = None,
    with_extra_keys: bool = True,
) -> BlockStored:
    """Blocks [start, start+n) of ``tokens`` as vLLM's block pool (or kvroute's connector, for
    a lower tier) publishes them: one ``extra_keys`` entry per block. ``with_extra_keys=False``
    is vLLM's offloading connector's self-describing store."""
    hashes = hashes_of(tokens, start, n, salt)
    parent = None if start == 0 else ehash(tuple(tokens[: start * BS]), salt)
    if extra is None:
        extra = [None] * n
    return BlockStored(
        hashes,
        parent,
        tokens[start * BS : (start + n) * BS],
        BS,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra if with_extra_keys else None,
    )


def removed(
    tokens: list[int], blocks: list[int], medium: Medium = Medium.GPU, salt: str = ""
) -> BlockRemoved:
    return BlockRemoved([ehash(tuple(tokens[: (b + 1) * BS]), salt) for b in blocks], medium)


def tier_only(tokens: list[int], blocks: list[int], medium: Medium, **kw: Any) -> BlockStored:
    """vLLM's offloading connector without self-describing events (or llm-d's FS backend):
    the last block hash of each chunk, nothing else."""
    return BlockStored(
        [ehash(tuple(tokens[: (b + 1) * BS])) for b in blocks], None, [], 0, medium=medium, **kw
    )


def lmcache_chunk(
    tokens: list[int], start: int, size: int, chunk_hash: int, parent: int | None
) -> BlockStored:
    """LMCache's store event as vLLM's LMCacheConnectorV1 forwards it: one event per chunk,
    LMCache's own hashes, the chunk's token count as block_size, medium "cpu", and LMCache
    0.5.x's token list ``tokens[start:end + 1]`` (the next chunk's first token too, when
    there is one: lmcache.utils.convert_tokens_to_list)."""
    return BlockStored(
        [chunk_hash],
        parent,
        tokens[start : start + size + 1],
        size,
        medium=Medium.CPU,
        confirmed=False,
        medium_name="cpu",
    )


replica_st = st.sampled_from(["r0", "r1", "r2"])
doc_st = st.integers(0, len(DOCS) - 1)
lower_st = st.sampled_from([Medium.CPU, Medium.STORAGE])


@st.composite
def operation(
    draw: st.DrawFn,
    *,
    chunk_grid: int = 0,
    tier_only_medium: Medium | None = None,
    sized_kind: str | None = None,
) -> tuple[str, Event]:
    """One event of a replica's stream, of any kind a vLLM publisher sends.

    By default a tier-only store names any blocks, in a tier sized stores use too. With
    ``chunk_grid`` and ``tier_only_medium`` the stream is one real publisher's: vLLM's
    offloading connector cuts a prompt into chunks of ``chunk_grid`` blocks from its first
    block and names the last block of each chunk of the prompt, from the first chunk on, in a
    tier of its own (sized lower stores then use the other lower tier). ``sized_kind``
    (``"lower"``: kvroute's connector, with extra keys; ``"lower_by_hash"``: vLLM's offloading
    connector, self-describing) makes every sized lower store one publisher's."""
    replica = draw(replica_st)
    doc = DOCS[draw(doc_st)]
    n_blocks = len(doc) // BS
    sized = ["lower", "lower_by_hash"] if sized_kind is None else [sized_kind, sized_kind]
    kinds = ["device", "device", "device", *sized, "tier_only", "remove"]
    kind = draw(st.sampled_from([*kinds, "clear", "clear_tier"]))
    start = draw(st.integers(0, n_blocks - 1))
    n = draw(st.integers(1, n_blocks - start))
    sized_st = lower_st
    if tier_only_medium is not None:
        sized_st = st.just(Medium.STORAGE if tier_only_medium is Medium.CPU else Medium.CPU)
    if kind == "device":
        return replica, stored(doc, start, n)
    if kind == "lower":
        return replica, stored(doc, start, n, draw(sized_st))
    if kind == "lower_by_hash":
        return replica, stored(doc, start, n, draw(sized_st), with_extra_keys=False)
    blocks = draw(st.lists(st.integers(0, n_blocks - 1), min_size=1, max_size=3))
    if kind == "tier_only":
        if chunk_grid and tier_only_medium is not None:
            chunks = n_blocks // chunk_grid
            last = draw(st.integers(0, chunks - 1))
            ends = [(c + 1) * chunk_grid - 1 for c in range(last + 1)]
            return replica, tier_only(doc, ends, tier_only_medium)
        return replica, tier_only(doc, blocks, draw(lower_st))
    if kind == "remove":
        return replica, removed(doc, blocks, draw(st.sampled_from(list(Medium))))
    if kind == "clear_tier":
        return replica, AllBlocksCleared(draw(lower_st))
    return replica, AllBlocksCleared()
