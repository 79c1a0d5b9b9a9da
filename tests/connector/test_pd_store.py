"""P/D through a storage domain (connector/pd_store.py): a prefill replica's answer names
its chunks, a decode replica waits for exactly those, up to a deadline, then loads them
or recomputes. Two replicas (planner + worker executor each, plain torch CPU tensors
standing in for vLLM's paged KV, real files in one temp directory); a fake clock for the
deadline. The real-vLLM check is ``tests/e2e/test_pd_storage_e2e.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvroute.connector.config import ConnectorConfig
from kvroute.connector.disk_tier import unlink_chunk_all_ranks
from kvroute.connector.identity import RankInfo, layout_digest
from kvroute.connector.pd_store import (
    PARAMS_KEY,
    PdWaits,
    on_its_way,
    parse_params,
    prefill_answer,
    wants_remote_decode,
)
from kvroute.connector.planner import Planner
from kvroute.connector.shared_store import SharedStore
from kvroute.connector.worker import WorkerExecutor
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import (
    BPC,
    CHUNK,
    IDENTITY,
    block_data,
    block_hashes,
    make_executor,
    make_paged,
    make_planner,
    step,
)

LAYOUT = layout_digest(IDENTITY)
WAIT_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Replica:
    """One replica of either pool attached to the domain directory ``d``."""

    def __init__(self, d: Path, clock: Clock, *, seed: int) -> None:
        self.paged = make_paged()
        g = torch.Generator().manual_seed(seed)
        for t in self.paged.layers:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        nbytes = self.paged.num_layers * BPC * self.paged.block_bytes()
        self.shared = SharedStore(d, IDENTITY, [RankInfo()], domain="pd")
        self.p: Planner = make_planner(
            num_slots=8,
            disk_enabled=True,
            disk_capacity_bytes=1 << 20,
            payload_bytes=nbytes,
            unlink=lambda k: unlink_chunk_all_ranks(d, [RankInfo()], k),
            shared=self.shared,
        )
        self.ex: WorkerExecutor = make_executor(self.paged, num_slots=8, disk_dir=d)
        shared = self.shared
        self.waits = PdWaits(
            domain="pd",
            layout=LAYOUT,
            chunk_tokens=CHUNK,
            blocks_per_chunk=BPC,
            wait_s=WAIT_S,
            probe=lambda key: shared.probe(key) is not None,
            clock=clock,
        )

    def answer(self, hashes: list[bytes], num_prompt_tokens: int) -> dict:
        """What the connector's ``request_finished`` returns for a prefill leg, through
        JSON as it crosses the router."""
        p, shared = self.p, self.shared
        out = prefill_answer(
            domain="pd",
            layout=LAYOUT,
            chunk_tokens=CHUNK,
            blocks_per_chunk=BPC,
            block_hashes=hashes,
            num_prompt_tokens=num_prompt_tokens,
            on_disk=lambda key: on_its_way(p.disk.get(key), lambda: shared.probe(key) is not None),
        )
        return json.loads(json.dumps(out))

    def close(self) -> None:
        self.ex.close()
        self.shared.close()


def _prompt(seed: int, n_chunks: int, extra: int = 3) -> tuple[list[int], list[bytes]]:
    tokens = [seed * 7919 + i for i in range(n_chunks * CHUNK + extra)]
    return tokens, block_hashes(tokens)


@pytest.fixture
def pair(tmp_path: Path):
    clock = Clock()
    prefill, decode = Replica(tmp_path, clock, seed=1), Replica(tmp_path, clock, seed=2)
    yield prefill, decode, clock
    prefill.close()
    decode.close()


def test_the_decode_waits_for_the_named_chunks_then_loads_the_prefills_kv(pair) -> None:
    prefill, decode, clock = pair
    tokens, hashes = _prompt(1, 3)
    blocks = list(range(3 * BPC + 1))
    # The prefill's step: its stores (and their disk writes) are planned, not yet run,
    # when vLLM finishes the request and the answer leaves: the ordering problem.
    prefill.p.on_scheduled("p", blocks, hashes, tokens, len(tokens))
    params = prefill.answer(hashes, len(tokens))
    got = params[PARAMS_KEY]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert got["keys"] == [hashes[(c + 1) * BPC - 1].hex() for c in range(3)]
    assert got["tokens"] == 3 * CHUNK and got["layout"] == LAYOUT
    # The decode sees the answer before any file landed: it waits (vLLM: None).
    assert decode.waits.should_wait("d", params, hashes)
    clock.t += 1.0
    assert decode.waits.should_wait("d", params, hashes)
    # The prefill's worker runs its plan: copies, then the asynchronous disk writes.
    step(prefill.p, prefill.ex)
    step(prefill.p, prefill.ex)
    assert not decode.waits.should_wait("d", params, hashes)
    # Then the ordinary lookup: every named chunk, from the domain, asynchronously.
    res = decode.p.lookup("d", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == 3 * CHUNK and res.is_async
    assert all(h.tier == Tier.STORAGE for h in res.hits)
    dst = list(range(40, 40 + 3 * BPC + 1))
    decode.p.on_alloc("d", dst, res.num_tokens)
    step(decode.p, decode.ex)
    assert decode.ex.take_finished_loads() == {"d"} and decode.ex.take_load_errors() == set()
    want, got = block_data(prefill.paged, blocks[:-1]), block_data(decode.paged, dst[:-1])
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    s = decode.waits.stats
    assert (s.transfers, s.ready, s.waited, s.timeouts) == (1, 1, 1, 0)
    assert s.wait_s_total == pytest.approx(1.0)
    # Asked again (e.g. after a preemption) it never waits again.
    assert not decode.waits.should_wait("d", params, hashes)
    decode.waits.finished("d")


def test_chunks_that_never_come_are_waited_for_until_the_deadline_then_recomputed(pair) -> None:
    prefill, decode, clock = pair
    tokens, hashes = _prompt(2, 2)
    # Parameters naming this prompt's chunks, which nobody writes.
    prefill.p.on_scheduled("p", list(range(2 * BPC + 1)), hashes, tokens, len(tokens))
    params = prefill.answer(hashes, len(tokens))
    prefill.p.take_plan()  # the worker never runs it
    assert len(params[PARAMS_KEY]["keys"]) == 2
    assert decode.waits.should_wait("d", params, hashes)
    clock.t += WAIT_S - 0.01
    assert decode.waits.should_wait("d", params, hashes)
    clock.t += 0.02
    assert not decode.waits.should_wait("d", params, hashes)
    assert decode.waits.stats.timeouts == 1 and decode.waits.stats.ready == 0
    assert decode.p.lookup("d", hashes, tokens, len(tokens), 0).num_tokens == 0


def test_at_the_deadline_the_chunks_that_landed_are_loaded_and_the_rest_recomputed(pair) -> None:
    prefill, decode, clock = pair
    tokens, hashes = _prompt(3, 2)
    blocks = list(range(2 * BPC + 1))
    prefill.p.on_scheduled("p", blocks, hashes, tokens, len(tokens))
    params = prefill.answer(hashes, len(tokens))
    step(prefill.p, prefill.ex)
    step(prefill.p, prefill.ex)
    # The second chunk's file is gone (an evictor, a lost write).
    unlink_chunk_all_ranks(prefill.shared.layout_dir, [RankInfo()], hashes[2 * BPC - 1])
    assert decode.waits.should_wait("d", params, hashes)
    clock.t += WAIT_S
    assert not decode.waits.should_wait("d", params, hashes)
    res = decode.p.lookup("d", hashes, tokens, len(tokens), 0)
    assert res.num_tokens == CHUNK and res.is_async


def test_the_prefill_names_only_the_chunks_on_their_way_to_the_domain(pair) -> None:
    prefill, _, _ = pair
    tokens, hashes = _prompt(4, 3)
    # Only the first chunk was stored (e.g. RAM full for the others): the list stops there.
    prefill.p.on_scheduled("p", list(range(BPC)), hashes, tokens, CHUNK)
    params = prefill.answer(hashes, len(tokens))
    assert params[PARAMS_KEY]["keys"] == [hashes[BPC - 1].hex()]
    # A prompt of exactly two chunks: the lookup leaves its last token to compute, so
    # the second chunk is never asked for and never named.
    tokens2, hashes2 = _prompt(5, 2, extra=0)
    prefill.p.on_scheduled("q", list(range(10, 10 + 2 * BPC)), hashes2, tokens2, len(tokens2))
    assert len(prefill.answer(hashes2, len(tokens2))[PARAMS_KEY]["keys"]) == 1


def test_a_chunk_written_once_but_gone_from_the_domain_is_not_named(pair) -> None:
    prefill, _, _ = pair
    tokens, hashes = _prompt(9, 2)
    prefill.p.on_scheduled("p", list(range(2 * BPC + 1)), hashes, tokens, len(tokens))
    step(prefill.p, prefill.ex)
    step(prefill.p, prefill.ex)
    assert len(prefill.answer(hashes, len(tokens))[PARAMS_KEY]["keys"]) == 2
    # The evictor removes the first chunk's files; the prefill's index still says READY.
    unlink_chunk_all_ranks(prefill.shared.layout_dir, [RankInfo()], hashes[BPC - 1])
    assert prefill.p.disk.ready(hashes[BPC - 1]) is not None
    assert prefill.answer(hashes, len(tokens))[PARAMS_KEY]["keys"] == []


def test_parameters_of_another_layout_or_prompt_are_not_waited_for(pair) -> None:
    prefill, decode, _ = pair
    tokens, hashes = _prompt(6, 2)
    prefill.p.on_scheduled("p", list(range(2 * BPC + 1)), hashes, tokens, len(tokens))
    params = prefill.answer(hashes, len(tokens))
    other_layout = json.loads(json.dumps(params))
    other_layout[PARAMS_KEY]["layout"] = "0" * 16
    assert not decode.waits.should_wait("a", other_layout, hashes)
    _, other_hashes = _prompt(7, 2)
    assert not decode.waits.should_wait("b", params, other_hashes)
    assert decode.waits.stats.mismatches == 2 and decode.waits.stats.timeouts == 0


def test_other_transports_and_malformed_parameters_are_left_alone(pair) -> None:
    _, decode, _ = pair
    _, hashes = _prompt(8, 1)
    nixl = {"do_remote_prefill": True, "remote_block_ids": [1], "remote_host": "10.0.0.1"}
    assert parse_params(nixl) is None and not decode.waits.should_wait("n", nixl, hashes)
    bad = {"do_remote_prefill": True, PARAMS_KEY: {"v": 1, "keys": ["zz"]}}
    assert parse_params(bad) is None and not decode.waits.should_wait("m", bad, hashes)
    assert not decode.waits.should_wait("x", None, hashes)
    assert decode.waits.stats.transfers == 0
    assert wants_remote_decode({"do_remote_decode": True, "do_remote_prefill": False})
    assert not wants_remote_decode(nixl) and not wants_remote_decode(None)


def test_the_config_needs_a_storage_domain_and_a_sane_deadline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="storage domain"):
        ConnectorConfig.from_extra_config({"pd_via_storage": True})
    with pytest.raises(ValueError, match="pd_wait_s"):
        ConnectorConfig.from_extra_config({"pd_wait_s": -1})
    cfg = ConnectorConfig.from_extra_config(
        {"pd_via_storage": True, "disk_dir": str(tmp_path), "storage_domain": "pd"}
    )
    assert cfg.pd_via_storage and cfg.pd_wait_s == 10.0
