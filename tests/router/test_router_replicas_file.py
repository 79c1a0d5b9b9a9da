"""Replicas from a watched YAML file: added and removed while the router runs."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import yaml
from kvroute.bench.publisher import EventPublisher
from kvroute.router.app import create_app
from kvroute.router.config import RouterSettings
from router_fake_vllm import FakeVLLM
from router_servers import ServerThread, wait_until


def _write(path: Path, entries: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"replicas": entries}))
    tmp.replace(path)  # atomic, like a ConfigMap swap


def test_yaml_replicas_added_and_removed_without_restart(local_tokenizer, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        pub = EventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", bind=True)
        stack.callback(pub.close)
        fakes = [
            FakeVLLM(f"f{i}", local_tokenizer.tok, publisher=pub if i else None) for i in range(2)
        ]
        servers = [ServerThread(f.app).start() for f in fakes]
        for s in servers:
            stack.callback(s.stop)
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
                    "events": pub.endpoint,
                    "replay": pub.replay_endpoint,
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
                    "events": pub.endpoint,
                    "replay": pub.replay_endpoint,
                }
            ],
        )
        wait_until(lambda: set(stats()["replicas"]) == {"b"})
        assert stats()["replicas_file"]["last_error"] is None
        for i in range(3):
            resp = httpx.post(
                f"{router.url}/v1/completions", json={"model": "tiny", "prompt": f"hello {i}"}
            )
            assert resp.json()["served_by"] == "f1"
