"""Chunk file format: round trip and crash safety (every bad file is a miss)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvroute.connector import disk_format
from kvroute.connector.disk_format import (
    ChunkFileError,
    DiskFullError,
    file_name,
    header_for_chunk,
    read_chunk_file,
    read_chunk_header,
    write_chunk_file,
)
from kvroute.connector.disk_scan import scan_directory
from kvroute.connector.disk_tier import DiskWriter, chunk_path, unlink_chunk
from kvroute.connector.keys import chunk_info
from tests.connector.helpers import BLOCK, BPC, IDENTITY, block_hashes


def _chunk(seed: int = 0):
    tokens = list(range(seed, seed + 3 * BLOCK * BPC))
    hashes = block_hashes(tokens)
    info = chunk_info(hashes, tokens, BLOCK, BPC, 1)
    payload = torch.randn(2, BPC, 2, BLOCK, 8, generator=torch.Generator().manual_seed(seed))
    payload = payload.to(torch.bfloat16)
    header = header_for_chunk(info, identity=IDENTITY, payload_bytes=payload.numel() * 2)
    return info, header, payload


def test_round_trip_is_exact(tmp_path: Path) -> None:
    info, header, payload = _chunk()
    size = write_chunk_file(tmp_path, info.key, header, payload)
    path = tmp_path / file_name(info.key)
    assert path.stat().st_size == size
    cf = read_chunk_file(path, IDENTITY, key=info.key)
    assert cf.payload.dtype == torch.bfloat16
    assert torch.equal(cf.payload, payload)
    assert cf.header["token_ids"] == list(info.token_ids)
    assert cf.header["parent_hash"] == info.parent_hash.hex()
    # no temp file left behind
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_file_cut_short_is_rejected(tmp_path: Path) -> None:
    info, header, payload = _chunk()
    write_chunk_file(tmp_path, info.key, header, payload)
    path = tmp_path / file_name(info.key)
    data = path.read_bytes()
    for cut in (5, disk_format.PREFIX_SIZE + 3, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(ChunkFileError):
            read_chunk_file(path, IDENTITY)


def test_wrong_payload_checksum_is_rejected(tmp_path: Path) -> None:
    info, header, payload = _chunk()
    write_chunk_file(tmp_path, info.key, header, payload)
    path = tmp_path / file_name(info.key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip payload bits, size unchanged
    path.write_bytes(bytes(data))
    read_chunk_header(path, IDENTITY)  # header alone still fine
    with pytest.raises(ChunkFileError, match="checksum"):
        read_chunk_file(path, IDENTITY)


def test_corrupt_header_and_foreign_identity_are_rejected(tmp_path: Path) -> None:
    info, header, payload = _chunk()
    write_chunk_file(tmp_path, info.key, header, payload)
    path = tmp_path / file_name(info.key)
    with pytest.raises(ChunkFileError, match="foreign"):
        read_chunk_file(path, '{"model":"other"}')
    data = bytearray(path.read_bytes())
    data[disk_format.PREFIX_SIZE + 4] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChunkFileError, match="header checksum"):
        read_chunk_header(path, IDENTITY)


def test_renamed_file_is_rejected(tmp_path: Path) -> None:
    info, header, payload = _chunk()
    write_chunk_file(tmp_path, info.key, header, payload)
    other = tmp_path / file_name(b"\x01" * 32)
    os.rename(tmp_path / file_name(info.key), other)
    with pytest.raises(ChunkFileError, match="name"):
        read_chunk_file(other, IDENTITY)


def test_enospc_during_write_raises_disk_full_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real full filesystem (tiny tmpfs) needs root/mount; we inject ENOSPC at the single
    # point where the format writes bytes, after the temp file was created.
    calls = {"n": 0}

    def failing_write(f, data) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # header written, payload hits a full disk
            raise OSError(errno.ENOSPC, "No space left on device")
        f.write(data)

    monkeypatch.setattr(disk_format, "_write_all", failing_write)
    info, header, payload = _chunk()
    with pytest.raises(DiskFullError):
        write_chunk_file(tmp_path, info.key, header, payload)
    assert list(tmp_path.iterdir()) == []


def test_writer_reports_disk_full_at_byte_cap(tmp_path: Path) -> None:
    info0, h0, p0 = _chunk(0)
    info1, h1, p1 = _chunk(100)
    one_file = write_chunk_file(tmp_path / "..", info0.key, h0, p0)  # measure a file
    os.unlink(tmp_path / ".." / file_name(info0.key))
    # Room for one file (the writer reserves the header bound, not the exact size).
    w = DiskWriter(tmp_path, byte_cap=disk_format.max_file_size(h0, p0.numel() * 2) + one_file // 2)
    assert w.submit(info0.key, h0, p0)
    assert w.submit(info1.key, h1, p1)
    assert w.flush(10)
    res = {r.key: r for r in w.take_results()}
    w.close()
    assert res[info0.key].ok
    assert not res[info1.key].ok and res[info1.key].error == "disk_full"
    assert not (tmp_path / file_name(info1.key)).exists()


def test_scan_serves_good_files_and_removes_bad_ones(tmp_path: Path) -> None:
    good, h, p = _chunk(0)
    write_chunk_file(tmp_path, good.key, h, p)
    cut, h2, p2 = _chunk(50)
    write_chunk_file(tmp_path, cut.key, h2, p2)
    cut_path = tmp_path / file_name(cut.key)
    cut_path.write_bytes(cut_path.read_bytes()[:-100])
    foreign, h3, p3 = _chunk(70)
    h3 = dict(h3, identity="someone else")
    write_chunk_file(tmp_path, foreign.key, h3, p3)
    stale_tmp = tmp_path / (".x.kvc" + disk_format.TMP_MARK + "1-abcd")
    stale_tmp.write_bytes(b"partial")
    os.utime(stale_tmp, (0, 0))
    fresh_tmp = tmp_path / (".y.kvc" + disk_format.TMP_MARK + "1-abcd")
    fresh_tmp.write_bytes(b"being written by a live replica")

    found = scan_directory(tmp_path, IDENTITY)
    assert [info.key for info, _ in found] == [good.key]
    assert found[0][0] == good
    names = {x.name for x in tmp_path.iterdir()}
    assert names == {file_name(good.key), fresh_tmp.name}


def test_unlink_accepts_the_str_directory_the_metadata_carries(tmp_path: Path) -> None:
    """Regression: the scheduler's eviction callback passed a str and crashed the engine."""
    key = b"\x01" * 32
    path = chunk_path(str(tmp_path), key)
    path.write_bytes(b"x")
    unlink_chunk(str(tmp_path), key)
    assert not path.exists()
    unlink_chunk(str(tmp_path), key)  # already gone: not an error
