"""LoRA and extra keys travel with a chunk: planner, file header, start-up scan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvroute.connector.disk_format import (
    file_name,
    header_for_chunk,
    info_from_header,
    read_chunk_header,
    write_chunk_file,
)
from kvroute.connector.extra_keys import decode_extra_keys, encode_extra_keys
from kvroute.connector.keys import ChunkExtras, chunk_info
from kvroute.connector.plan import STORED, Report
from kvroute.indexer.tiers import Tier
from tests.connector.helpers import BLOCK, BPC, CHUNK, IDENTITY, block_hashes, make_planner

KEYS = (("adapter-a", ("img-1", 3), "salt", b"\x00\xffdigest"), None)


def test_extra_keys_survive_json() -> None:
    encoded = json.loads(json.dumps(encode_extra_keys(KEYS)))
    assert decode_extra_keys(encoded) == KEYS
    assert encode_extra_keys(None) is None and decode_extra_keys(None) is None
    with pytest.raises(TypeError):
        encode_extra_keys(({"a set"},))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        decode_extra_keys([{"not": "bytes"}])


def test_the_file_header_keeps_lora_and_extra_keys(tmp_path: Path) -> None:
    tokens = list(range(2 * CHUNK))
    info = chunk_info(
        block_hashes(tokens), tokens, BLOCK, BPC, 1, ChunkExtras(7, "adapter-a", KEYS)
    )
    payload = torch.zeros(2, BPC, 2, BLOCK, 8, dtype=torch.bfloat16)
    header = header_for_chunk(info, identity=IDENTITY, payload_bytes=payload.numel() * 2)
    write_chunk_file(tmp_path, info.key, header, payload)
    back = info_from_header(read_chunk_header(tmp_path / file_name(info.key), IDENTITY))
    assert back == info
    assert back.extras == ChunkExtras(7, "adapter-a", KEYS)


def test_the_planner_describes_new_chunks_with_the_request_extras() -> None:
    p = make_planner(num_slots=8)
    tokens = [5000 + i for i in range(2 * CHUNK + 1)]
    hashes = block_hashes(tokens)
    asked: list[tuple[int, int]] = []

    def extras(b0: int, b1: int) -> ChunkExtras:
        asked.append((b0, b1))
        return ChunkExtras(3, "lora-x", tuple(("lora-x", b) for b in range(b0, b1)))

    p.on_scheduled("a", list(range(2 * BPC)), hashes[:BPC], tokens, CHUNK, extras)
    p.on_scheduled("a", None, hashes, tokens, len(tokens), extras)
    assert asked == [(0, BPC), (BPC, 2 * BPC)]  # once per new chunk, its own blocks
    p.on_reports([Report(STORED, s.key, Tier.CPU) for s in p.take_plan().stores])
    infos = [e.info for e in p.take_events()]
    assert [i.extras for i in infos] == [
        ChunkExtras(3, "lora-x", (("lora-x", 0), ("lora-x", 1))),
        ChunkExtras(3, "lora-x", (("lora-x", 2), ("lora-x", 3))),
    ]
    # the lookup still compares token ids
    other = list(tokens)
    other[0] += 1
    assert p.lookup("b", hashes, other, len(other), 0).num_tokens == 0
    assert p.lookup("c", hashes, tokens, len(tokens), 0).num_tokens == 2 * CHUNK


def test_extras_a_header_cannot_hold_keep_the_chunk_out_of_the_disk_tier() -> None:
    p = make_planner(num_slots=8, disk_enabled=True, disk_capacity_bytes=1 << 20)
    tokens = [6000 + i for i in range(CHUNK + 1)]
    hashes = block_hashes(tokens)
    odd = ChunkExtras(None, None, ((object(),), None))
    p.on_scheduled("a", [0, 1], hashes, tokens, len(tokens), lambda b0, b1: odd)
    (store,) = p.take_plan().stores
    assert store.disk_header is None and len(p.disk) == 0  # RAM only
