"""Hybrid models, differentially: random workloads run through vLLM's own scheduler, block pool
and hybrid coordinator (the fixture generator's ``Replica``: no model runs), their KV events
applied to the index, and after every step the index's prediction for a set of probe prompts
compared with what vLLM's ``get_computed_blocks`` (``find_longest_cache_hit`` over every KV
cache group) returns for them.

Group layouts: Mamba first, sliding window first, full attention first with a masked window
group (blocks half its size), full attention + Mamba, and partial blocks (a prefix-match unit
finer than the block, Mamba first or second). Workloads: prompts that share prefixes
of any length, decodes that complete blocks, requests that skip the prefix cache
(``prompt_logprobs``: second copies from token 0), prefix-cache hits re-announced
(``kv_cache_report_mode: "full"``), and the evictions the small pool forces. The prediction
equals vLLM's hit, except that after a request that skipped the prefix cache it may be lower
(never higher).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import decode_batch
from kvroute.router.routing.router import predicted_cached_tokens

pytestmark = pytest.mark.vllm

LAYOUTS = {
    "mamba+full": {"block_size": 16, "num_gpu_blocks": 24, "groups": "mamba+full"},
    "swa+full": {"block_size": 16, "num_gpu_blocks": 24, "groups": "swa+full", "window": 32},
    "full+swa masked": {
        "block_size": 32,
        "num_gpu_blocks": 32,
        "groups": "full+swa",
        "window": 16,
        "swa_block_size": 16,
    },
    "full+mamba": {"block_size": 16, "num_gpu_blocks": 24, "groups": "full+mamba"},
    # partial blocks (prefix-match unit 16 in 64-token blocks), Mamba first or second
    "mamba+full unit 16": {
        "block_size": 64,
        "num_gpu_blocks": 16,
        "groups": "mamba+full",
        "prefix_match_unit": 16,
    },
    "full+mamba unit 32": {
        "block_size": 64,
        "num_gpu_blocks": 16,
        "groups": "full+mamba",
        "prefix_match_unit": 32,
    },
    # EAGLE-style drafts (drafts.py): every hit one block (or unit) short, in every group
    "full eagle": {"block_size": 16, "num_gpu_blocks": 24, "groups": "full", "eagle": True},
    "mamba+full eagle": {
        "block_size": 16,
        "num_gpu_blocks": 24,
        "groups": "mamba+full",
        "eagle": True,
    },
    "swa+full eagle": {
        "block_size": 16,
        "num_gpu_blocks": 24,
        "groups": "swa+full",
        "window": 32,
        "eagle": True,
    },
    "full+swa masked eagle": {
        "block_size": 32,
        "num_gpu_blocks": 32,
        "groups": "full+swa",
        "window": 16,
        "swa_block_size": 16,
        "eagle": True,
    },
    "full+mamba unit 32 eagle": {
        "block_size": 64,
        "num_gpu_blocks": 16,
        "groups": "full+mamba",
        "prefix_match_unit": 32,
        "eagle": True,
    },
}
# Layouts the index predicts at most (not exactly) vLLM's hit for: partial blocks (some are not
# resolved: docs/indexer.md, "What the index cannot know").
# With EAGLE a window hit needs one block more: in "full+swa masked" that can be a window block
# ending inside a keyed block, which the index cannot place (it is keyed only by the keyed
# group's hashes, one per 32 tokens): the prediction is then lower.
AT_MOST = {
    "mamba+full unit 16",
    "full+mamba unit 32",
    "full+mamba unit 32 eagle",
    "full+swa masked eagle",
}
# Prompts are a stem of one of three roots: prefixes shared at any length.
ROOTS = [list(range(1000 * (i + 1), 1000 * (i + 1) + 120)) for i in range(3)]
_names = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from tests.fixtures.vllm_events import generate

    d = tmp_path_factory.mktemp("model")
    (d / "config.json").write_text(json.dumps(generate.MODEL_CONFIG))
    yield d


request_st = st.tuples(
    st.integers(0, 2),  # root
    st.integers(8, 110),  # prompt length
    st.integers(0, 2),  # tail: 0 the root's own tokens, else a private tail after a cut
    st.integers(1, 20),  # max tokens
    st.sampled_from(["plain", "plain", "logprobs", "report full"]),
)


def _prompt(root: int, length: int, tail: int) -> list[int]:
    if not tail:
        return ROOTS[root][:length]
    cut = length * tail // 3
    return ROOTS[root][:cut] + list(range(50_000 + 700 * tail + cut, 50_000 + 700 * tail + length))


@settings(
    max_examples=24,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(layout=st.sampled_from(sorted(LAYOUTS)), steps=st.lists(request_st, min_size=2, max_size=10))
# A one-block prompt whose block is held: vLLM recomputes its last token, so it computes the
# block again from token 0, a second copy the index does not count (docs/indexer.md); after
# the first copy's eviction the index predicts less than vLLM serves (found by this test).
@example(
    layout="swa+full",
    steps=[
        (0, 8, 0, 1, "plain"),
        (0, 8, 0, 1, "plain"),
        (0, 45, 0, 20, "plain"),
        (0, 13, 0, 20, "plain"),
        (0, 16, 0, 1, "plain"),
        (0, 46, 1, 20, "plain"),
    ],
)
# EAGLE's drop leaves a two-block prompt's hit empty: its first block, held, is computed again
# from token 0, a second copy the index cannot tell from a re-announced one-block hit
# (found by this test, on the code before today too: 0 predicted where vLLM served 16).
@example(
    layout="swa+full eagle",
    steps=[
        (0, 8, 0, 1, "plain"),
        (1, 32, 0, 17, "plain"),
        (1, 17, 0, 16, "plain"),
        (0, 78, 0, 20, "plain"),
    ],
)
# A re-announced hit ("report full") after second copies the index never counted (a request
# that skipped the cache, then the first copies' eviction) was taken for a computation: its
# groups' listings of every block became states and copies it does not hold (found by this
# test: the index predicted 16, 48 and 80 tokens where vLLM served 0, 32 and 0).
@example(
    layout="full+mamba",
    steps=[
        (0, 8, 0, 1, "plain"),
        (0, 8, 0, 1, "plain"),
        (0, 8, 0, 1, "plain"),
        (2, 64, 0, 1, "plain"),
        (2, 80, 0, 17, "logprobs"),
        (0, 73, 0, 20, "plain"),
        (2, 96, 0, 1, "report full"),
        (0, 13, 0, 20, "plain"),
        (0, 13, 0, 20, "plain"),
        (0, 60, 1, 6, "plain"),
    ],
)
@example(
    layout="full+mamba",
    steps=[
        (0, 8, 0, 1, "plain"),
        (0, 8, 0, 1, "plain"),
        (2, 64, 0, 1, "plain"),
        (2, 77, 0, 20, "logprobs"),
        (0, 8, 0, 1, "plain"),
        (0, 62, 0, 20, "plain"),
        (2, 49, 0, 16, "report full"),
        (0, 34, 2, 20, "report full"),
        (2, 23, 2, 20, "report full"),
        (2, 61, 2, 20, "report full"),
    ],
)
@example(
    layout="full+mamba",
    steps=[
        (0, 8, 0, 1, "plain"),
        (0, 8, 0, 1, "plain"),
        (2, 64, 0, 1, "plain"),
        (0, 77, 0, 20, "plain"),
        (2, 77, 0, 20, "logprobs"),
        (0, 8, 0, 1, "plain"),
        (2, 49, 0, 1, "report full"),
    ],
)
def test_the_index_predicts_vllms_hybrid_hit(
    model_dir: Path, layout: str, steps: list[tuple[int, int, int, int, str]]
) -> None:
    from tests.fixtures.vllm_events.generate import Replica, ReplicaSpec

    r = Replica(f"hyb{next(_names)}", ReplicaSpec(**LAYOUTS[layout]), model_dir)  # type: ignore[arg-type]
    index = InMemoryPrefixIndex()
    index.add_replica("r")
    if LAYOUTS[layout].get("eagle"):
        index.set_speculative("r", "eagle")
    applied = 0
    skipped_cache = False
    block_size = LAYOUTS[layout]["block_size"]
    first_blocks: set[tuple[int, ...]] = set()  # the first block of every prompt sent
    # every prompt sent, and stems of every root, each probed with one more token
    probes = {tuple(_prompt(root, n, tail)) for root, n, tail, *_ in steps}
    probes |= {tuple(root[:k]) for root in ROOTS for k in (20, 47, 64, 96)}
    try:
        for i, (root, length, tail, max_tokens, mode) in enumerate(steps):
            if mode == "report full" and "unit" in layout:
                # vLLM 0.32's emit_cached_block_events indexes past the request's hashes when
                # the hit ends on a partial block (IndexError in the scheduler): not sent.
                mode = "plain"
            prompt = _prompt(root, length, tail)
            r.add(
                f"q{i}",
                prompt,
                max_tokens=max_tokens,
                prompt_logprobs=1 if mode == "logprobs" else None,
                extra_args={"kv_cache_report_mode": "full"} if mode == "report full" else None,
            )
            r.run()
            # A request that skipped the prefix cache stores second copies of held blocks from
            # token 0, which the index cannot tell from a re-announced hit: it may then know
            # less than vLLM holds (docs/indexer.md), never more.
            skipped_cache = skipped_cache or mode == "logprobs"
            # A prompt of exactly one held block is computed again from token 0 (its last
            # token is always recomputed): the same second copy, uncounted. So is one of at
            # most two blocks on an EAGLE replica, whose drop of the hit's last block leaves
            # it empty: its store looks like a re-announced one-block hit (drafts.py).
            first = tuple(prompt[:block_size])
            one_block = len(prompt) == block_size
            eagle_empty = LAYOUTS[layout].get("eagle") and (len(prompt) - 1) // block_size <= 1
            skipped_cache = skipped_cache or ((one_block or eagle_empty) and first in first_blocks)
            if len(prompt) >= block_size:
                first_blocks.add(first)
            for frame in r.frames[applied:]:
                batch = decode_batch(frame.payload)
                assert not batch.rejected, batch.rejected
                result = index.apply("r", batch.events)
                # after a lost second copy, a later store may name that block as its parent
                assert skipped_cache or not result.rejected, (layout, steps[: i + 1], result)
            applied = len(r.frames)
            for tokens in sorted(probes):
                probe = [*tokens, 7]
                req = r.make_request(f"p{i}-{len(tokens)}", probe)
                vllm_hit = r.truth(req)["gpu_hit_tokens"]
                match = index.lookup(RequestKeys(probe))["r"]
                unit = index.partial_unit("r") if match.partial_tokens else None
                predicted = predicted_cached_tokens(
                    match.tokens, len(probe), unit or match.block_size
                )
                where = (layout, steps[: i + 1], len(probe), predicted, vllm_hit)
                assert predicted <= vllm_hit, where
                if not skipped_cache and layout not in AT_MOST:
                    assert predicted == vllm_hit, where
    finally:
        r.shutdown()
