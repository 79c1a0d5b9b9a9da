"""The routers' own credential (``--peer-key-file``, ``$KVROUTE_PEER_KEY``) and the streamed
snapshot import (``--peer-snapshot-max-mib``), over real HTTP on 127.0.0.1 in front of
simulated vLLM replicas with real ZMQ publishers.

With a peer key, ``/index/snapshot`` and ``/peer/load`` take it and no client key (a client
must not read the whole index), and the peer key opens nothing else (it is not a client's);
a router with the key warm-starts from its peer, one without it replays."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvroute.indexer.snapshot import SnapshotError
from kvroute.router.app import create_app
from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.config import ConfigError, RouterSettings
from kvroute.router.peers.snapshot import SnapshotReader, decode_snapshot
from kvroute.router.peers.warm_start import WarmStartError, fetch_snapshot
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.peers.test_warm_start import _entries, _settled, _traffic
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import make_fleet

KEY = "sk-client-key"
PEER = "peer-shared-secret-1"


def _get(url: str, path: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}{path}", headers=headers, timeout=5)


def _start(url: str) -> dict[str, Any]:
    return _get(url, "/index/stats", KEY).json()["start"]


def test_peer_paths_take_the_peer_key_only_and_a_peer_warm_starts_with_it(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=2, api_keys=[KEY], peer_key=PEER) as fleet:
        _traffic(fleet, 4, api_key=KEY)
        want = _settled(fleet, key=KEY)
        for path in ("/index/snapshot", "/peer/load"):
            assert _get(fleet.url, path, KEY).status_code == 401, path
            assert _get(fleet.url, path, None).status_code == 401, path
            assert _get(fleet.url, path, PEER).status_code == 200, path
        body = _get(fleet.url, "/index/snapshot", PEER).content
        assert {r.name for r in decode_snapshot(body)} == set(want)
        # The peer key is no client key.
        assert _get(fleet.url, "/v1/models", PEER).status_code == 401
        assert _get(fleet.url, "/index/stats", PEER).status_code == 401
        assert _get(fleet.url, "/v1/models", KEY).status_code == 200

        same = fleet.settings.replace(peers=[fleet.url])  # the same keys, the peer key too
        with ServerThread(create_app(same, tokenizer=local_tokenizer)) as second:
            wait_until(lambda: _start(second.url)["replicas_pending"] == 0)
            start = _start(second.url)
            assert (start["mode"], start["error"]) == ("peer_snapshot", None)
            assert _entries(second.url, KEY) == want
        # A router with the clients' key but not the peer key is refused: it replays.
        stranger = fleet.settings.replace(peers=[fleet.url], peer_key=None)
        with ServerThread(create_app(stranger, tokenizer=local_tokenizer)) as third:
            start = _start(third.url)
            assert start["mode"] == "replay" and "answered 401" in start["error"]
            wait_until(lambda: _entries(third.url, KEY) == want)


def test_a_peer_key_alone_guards_only_the_peer_paths(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, peer_key=PEER) as fleet:
        assert _get(fleet.url, "/v1/models", None).status_code == 200
        assert _get(fleet.url, "/peer/load", None).status_code == 401
        assert _get(fleet.url, "/peer/load", PEER).status_code == 200


def test_the_peer_key_is_checked_and_read_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="peer key must differ"):
        RouterSettings(api_keys=[KEY], peer_key=KEY)
    with pytest.raises(ConfigError, match="peer key is empty"):
        RouterSettings(peer_key=" ")
    assert RouterSettings(api_keys=[KEY]).peer_credential == KEY  # as before: the client key
    assert RouterSettings(api_keys=[KEY], peer_key=PEER).peer_credential == PEER
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--replica", "http://127.0.0.1:9"]
    monkeypatch.delenv("KVROUTE_PEER_KEY", raising=False)
    assert settings_from_args(parser.parse_args(base)).peer_key is None
    monkeypatch.setenv("KVROUTE_PEER_KEY", "from-the-environment")
    assert settings_from_args(parser.parse_args(base)).peer_key == "from-the-environment"
    (tmp_path / "peer").write_text("from-a-file\n")
    args = parser.parse_args([*base, "--peer-key-file", str(tmp_path / "peer")])
    assert settings_from_args(args).peer_key == "from-a-file"  # the file wins
    args = parser.parse_args([*base, "--peer-snapshot-max-mib", "64"])
    assert settings_from_args(args).peer_snapshot_max_mib == 64


def test_the_snapshot_is_read_as_it_streams(local_tokenizer: LocalTokenizer) -> None:
    """Fed in pieces of any size (a byte at a time here), the reader gives what the whole
    body gives, holding no more than the frame in progress; past its bound it refuses."""
    with make_fleet(local_tokenizer, n=2) as fleet:
        _traffic(fleet, 4, api_key="unused")
        _settled(fleet, key=None)
        body = _get(fleet.url, "/index/snapshot", None).content
    whole = decode_snapshot(body)
    reader = SnapshotReader()
    largest = 0
    for i in range(len(body)):
        reader.feed(body[i : i + 1])
        largest = max(largest, len(reader._pending))
    assert reader.finish() == whole and whole
    frames, pos = [], 0
    while pos < len(body):
        size = int.from_bytes(body[pos : pos + 4], "big")
        frames.append(size)
        pos += 4 + size
    assert len(frames) == len(whole) + 2  # the header, each replica, the end
    assert largest <= max(frames) + 3 < len(body)  # one frame in progress, never the body
    bounded = SnapshotReader(max_bytes=len(body) - 1)
    with pytest.raises(SnapshotError, match=f"over {len(body) - 1} bytes"):
        bounded.feed(body)


def test_a_snapshot_over_the_bound_is_refused_as_it_streams(
    local_tokenizer: LocalTokenizer,
) -> None:
    """Warm start's fetch over real HTTP (``fetch_snapshot``, what ``--peer-snapshot-max-mib``
    bounds): a bound of the body's size less one is refused while the body streams in, with
    the reason; the body's own size is accepted whole."""
    with make_fleet(local_tokenizer, n=2) as fleet:
        _traffic(fleet, 4, api_key="unused")
        _settled(fleet, key=None)
        size = len(_get(fleet.url, "/index/snapshot", None).content)

        async def fetch(max_bytes: int) -> dict[str, Any]:
            async with httpx.AsyncClient(trust_env=False) as client:
                return await fetch_snapshot(
                    client, fleet.url, api_key=None, timeout_s=10, max_bytes=max_bytes
                )

        assert set(asyncio.run(fetch(size))) == {"r0", "r1"}
        with pytest.raises(WarmStartError, match=f"over {size - 1} bytes"):
            asyncio.run(fetch(size - 1))
