"""Replicas from a watched YAML file: added and removed while the router runs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import yaml

from kvroute.router.app import create_app
from kvroute.router.config import RouterSettings
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_replica import SimServer


def _write(path: Path, entries: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"replicas": entries}))
    tmp.replace(path)  # atomic, like a ConfigMap swap


def test_yaml_replicas_added_and_removed_without_restart(local_tokenizer, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(SimServer(f"f{i}", local_tokenizer.name)) for i in range(2)]
        path = tmp_path / "replicas.yaml"
        _write(path, [{"url": servers[0].url, "name": "a"}])
        settings = RouterSettings(
            replicas_file=str(path),
            watch_interval_s=0.1,
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
        )
        router = ServerThread(create_app(settings, tokenizer=local_tokenizer)).start()
        stack.callback(router.stop)
        stats = lambda: httpx.get(f"{router.url}/index/stats").json()  # noqa: E731
        wait_until(lambda: httpx.get(f"{router.url}/health").status_code == 200)
        assert set(stats()["replicas"]) == {"a"}

        _write(
            path,
            [
                {"url": servers[0].url, "name": "a"},
                {
                    "url": servers[1].url,
                    "name": "b",
                    "events": servers[1].events,
                    "replay": servers[1].replay,
                },
            ],
        )
        wait_until(lambda: stats()["replicas"].get("b", {}).get("health", {}).get("healthy"))
        assert stats()["replicas"]["b"]["freshness"] in ("connecting", "live", "syncing")

        # A broken edit is reported and ignored: the fleet keeps its last good list.
        path.write_text("replicas: [ {url: not-a-url} ]")
        wait_until(lambda: stats()["replicas_file"]["last_error"] is not None)
        assert set(stats()["replicas"]) == {"a", "b"}

        _write(
            path,
            [
                {
                    "url": servers[1].url,
                    "name": "b",
                    "events": servers[1].events,
                    "replay": servers[1].replay,
                }
            ],
        )
        wait_until(lambda: set(stats()["replicas"]) == {"b"})
        assert stats()["replicas_file"]["last_error"] is None
        for i in range(3):
            resp = httpx.post(
                f"{router.url}/v1/completions", json={"model": "tiny", "prompt": f"hello {i}"}
            )
            assert resp.headers["x-kvroute-replica"] == "b"
        assert {s.body.get("prompt") for s in servers[1].seen} >= {f"hello {i}" for i in range(3)}


def test_an_empty_file_read_mid_save_keeps_the_fleet_and_replicas_empty_list_clears_it(
    tmp_path: Path,
) -> None:
    """An editor's save truncates the file, then writes it: a poll in between reads an empty
    file, which must not remove every replica (it did, once, in CI). ``replicas: []`` does."""
    from kvroute.router.fleet.discovery.file import ReplicasFileWatcher

    path = tmp_path / "replicas.yaml"
    _write(path, [{"url": "http://127.0.0.1:9001", "name": "a"}])
    applied: list[list[str]] = []
    watcher = ReplicasFileWatcher(path, lambda rs: applied.append([r.key for r in rs]))
    watcher.load_now()
    assert applied == [["a"]]
    path.write_text("")  # truncated, not written yet
    assert watcher.poll() is False
    assert applied == [["a"]] and "empty" in (watcher.last_error or "")
    path.write_text("  \n")
    assert watcher.poll() is False and applied == [["a"]]
    _write(path, [])  # {"replicas": []}: every replica removed, on purpose
    assert watcher.poll() is True and applied[-1] == [] and watcher.last_error is None
