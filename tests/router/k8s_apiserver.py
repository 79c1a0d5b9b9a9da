"""A stand-in for kube-apiserver: pods and InferencePools over the real list/watch protocol.

No Kubernetes API server can run in the test environment, so this small HTTP server (a
thread on 127.0.0.1) speaks the parts of the protocol the router's discovery uses, as the
real server does:

* ``GET /api/v1/namespaces/NS/pods?labelSelector=k=v,...``: a PodList whose
  ``metadata.resourceVersion`` is the store's current version;
* ``...&watch=true&resourceVersion=N&allowWatchBookmarks=true&timeoutSeconds=T``: chunked,
  newline-delimited watch events (ADDED / MODIFIED / DELETED / BOOKMARK) after version N; a
  version older than the retained history gets one ERROR event holding a Status with code
  410 (Expired), as the real server answers a watch; an object that stops matching the
  selector is sent as DELETED; ``timeoutSeconds`` ends the stream cleanly; no
  resourceVersion (or "0") starts with a synthetic ADDED per object;
* ``GET /apis/GROUP/VERSION/namespaces/NS/inferencepools/NAME``: a stored InferencePool.

Test controls: ``add_pod``, ``update_pod``, ``delete_pod(silent=True)`` (the event never
reaches the watchers: a silently stale watch), ``compact`` (drop history: the next resume
gets 410), ``break_watches`` (close every open stream without a final chunk),
``end_watches`` (end them cleanly, as their timeoutSeconds would).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["FakeApiServer", "make_pod"]


def make_pod(
    name: str,
    ip: str | None,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    uid: str | None = None,
    http_port_name: int | None = None,
) -> dict[str, Any]:
    """A Pod as the API serves it (only the fields discovery reads, plus kind/apiVersion)."""
    containers: list[dict[str, Any]] = [{"name": "vllm", "image": "vllm"}]
    if http_port_name is not None:
        containers[0]["ports"] = [{"name": "http", "containerPort": http_port_name}]
    status: dict[str, Any] = {
        "phase": "Running" if ready else "Pending",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip:
        status["podIP"] = ip
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid or f"uid-{name}-{time.monotonic_ns()}",
            "labels": dict(labels or {"app": "vllm"}),
            "annotations": dict(annotations or {}),
        },
        "spec": {"containers": containers},
        "status": status,
    }


def _matches(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _parse_selector(raw: str) -> dict[str, str]:
    out = {}
    for term in filter(None, raw.split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        out[key] = value
    return out


class FakeApiServer:
    """The store and the HTTP server. ``url`` once started; ``kubeconfig(path)`` writes a
    kubeconfig pointing at it."""

    def __init__(self, namespace: str = "default", bookmark_interval_s: float = 0.5) -> None:
        self.namespace = namespace
        self.bookmark_interval_s = bookmark_interval_s
        self._cond = threading.Condition()
        self._rv = 100
        self._pods: dict[str, dict[str, Any]] = {}
        self._pools: dict[tuple[str, str], dict[str, Any]] = {}  # (group/version, name)
        # (rv, type, old object, new object): what watchers replay after their version
        self._history: list[tuple[int, str, dict[str, Any] | None, dict[str, Any]]] = []
        self._oldest = self._rv  # a watch from before this is 410
        self._generation = 0  # bumped by break_watches
        self._endings = 0  # bumped by end_watches
        self.requests: list[str] = []
        self.patches: list[tuple[str, dict[str, Any]]] = []  # (pod, merge patch), in order
        self.watch_410s = 0
        self._live: dict[int, tuple[int, int]] = {}  # open stream -> (generation, endings)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.break_watches()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FakeApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig (JSON is YAML) for this server, with a bearer token as a cluster's."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "test-token"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": self.namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))
        return path

    # --- store -------------------------------------------------------------------------------

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._rv)
        return obj

    def _record(
        self, kind: str, old: dict[str, Any] | None, new: dict[str, Any], silent: bool
    ) -> None:
        if not silent:
            self._history.append((self._rv, kind, old, new))
        self._cond.notify_all()

    def add_pod(self, pod: dict[str, Any]) -> None:
        with self._cond:
            name = pod["metadata"]["name"]
            old = self._pods.get(name)
            new = self._pods[name] = self._bump(pod)
            self._record("MODIFIED" if old else "ADDED", old, new, False)

    update_pod = add_pod

    def delete_pod(self, name: str, *, silent: bool = False) -> None:
        with self._cond:
            old = self._pods.pop(name)
            gone = self._bump(old)
            self._record("DELETED", old, gone, silent)

    def pods(self) -> dict[str, dict[str, Any]]:
        with self._cond:
            return copy.deepcopy(self._pods)

    def set_pool(self, group_version: str, name: str, pool: dict[str, Any]) -> None:
        with self._cond:
            self._pools[(group_version, name)] = self._bump(pool)

    def compact(self) -> None:
        """Forget the history: a watch resuming from any earlier version gets 410."""
        with self._cond:
            self._rv += 1
            self._history.clear()
            self._oldest = self._rv
            self._cond.notify_all()

    def break_watches(self) -> None:
        """Drop every open watch stream mid-way (no terminating chunk)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    @property
    def live_watches(self) -> int:
        """Streams open now that the next ``break_watches``/``end_watches`` would reach: a
        test waits for one before breaking, or it would break nothing."""
        with self._cond:
            now = (self._generation, self._endings)
            return sum(1 for marks in self._live.values() if marks == now)

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as its timeoutSeconds would."""
        with self._cond:
            self._endings += 1
            self._cond.notify_all()

    # --- HTTP --------------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._json(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "message": message,
                        "reason": reason,
                        "code": code,
                    },
                )

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                api.requests.append(self.path)
                segments = parts.path.strip("/").split("/")
                if segments[:3] == ["api", "v1", "namespaces"] and segments[4:] == ["pods"]:
                    if query.get("watch") in ("true", "1"):
                        api._watch(self, query)
                    else:
                        api._list(self, query)
                    return
                if segments[0] == "apis" and len(segments) == 7 and segments[5] == "inferencepools":
                    group_version = f"{segments[1]}/{segments[2]}"
                    with api._cond:
                        pool = api._pools.get((group_version, segments[6]))
                    if pool is None:
                        self._status(404, "NotFound", f"inferencepools {segments[6]!r} not found")
                    else:
                        self._json(200, pool)
                    return
                self._status(404, "NotFound", f"the server could not find {parts.path}")

            def do_PATCH(self) -> None:
                """A JSON merge patch of one pod's metadata (labels, annotations): what the
                router's deletion costs write. Recorded in ``api.patches``; a MODIFIED event
                follows, as from a real API server."""
                parts = urlsplit(self.path)
                segments = parts.path.strip("/").split("/")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                api.requests.append(f"PATCH {self.path}")
                kind = self.headers.get("Content-Type", "")
                if not (
                    segments[:3] == ["api", "v1", "namespaces"]
                    and len(segments) == 6
                    and segments[4] == "pods"
                ):
                    self._status(404, "NotFound", f"the server could not find {parts.path}")
                    return
                if kind != "application/merge-patch+json":
                    self._status(415, "UnsupportedMediaType", f"only merge patches, not {kind}")
                    return
                if set(body) - {"metadata"} or set(body.get("metadata", {})) - {
                    "labels",
                    "annotations",
                }:
                    self._status(422, "Invalid", f"the stand-in patches labels/annotations: {body}")
                    return
                name = segments[5]
                with api._cond:
                    pod = api._pods.get(name)
                    if pod is None:
                        self._status(404, "NotFound", f"pods {name!r} not found")
                        return
                    new = copy.deepcopy(pod)
                    for field, values in body["metadata"].items():
                        target = new["metadata"].setdefault(field, {})
                        for key, value in values.items():
                            if value is None:
                                target.pop(key, None)
                            else:
                                target[key] = value
                    new = api._pods[name] = api._bump(new)
                    api.patches.append((name, body))
                    api._record("MODIFIED", pod, new, False)
                self._json(200, new)

        return Handler

    def _list(self, handler: Any, query: dict[str, str]) -> None:
        selector = _parse_selector(query.get("labelSelector", ""))
        with self._cond:
            items = [copy.deepcopy(p) for p in self._pods.values() if _matches(p, selector)]
            rv = str(self._rv)
        handler._json(
            200,
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": rv},
                "items": items,
            },
        )

    def _watch(self, handler: Any, query: dict[str, str]) -> None:
        selector = _parse_selector(query.get("labelSelector", ""))
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds") or 1800)
        raw_rv = query.get("resourceVersion") or "0"
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event: dict[str, Any]) -> None:
            line = json.dumps(event).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            handler.wfile.flush()

        def end() -> None:
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()

        try:
            with self._cond:
                generation, endings = self._generation, self._endings
                if raw_rv == "0":
                    since = self._rv
                    initial = [
                        copy.deepcopy(p) for p in self._pods.values() if _matches(p, selector)
                    ]
                else:
                    since = int(raw_rv)
                    initial = []
                    if since < self._oldest:
                        self.watch_410s += 1
                        expired = {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "metadata": {},
                            "status": "Failure",
                            "message": f"too old resource version: {since} ({self._oldest})",
                            "reason": "Expired",
                            "code": 410,
                        }
                        send({"type": "ERROR", "object": expired})
                        end()
                        return
                self._live[id(handler)] = (generation, endings)
            for obj in initial:
                send({"type": "ADDED", "object": obj})
            deadline = time.monotonic() + timeout
            last_bookmark = time.monotonic()
            while True:
                with self._cond:
                    pending = [h for h in self._history if h[0] > since]
                    if not pending:
                        self._cond.wait(timeout=0.1)
                        pending = [h for h in self._history if h[0] > since]
                    broken = self._generation != generation
                    ended = self._endings != endings
                    current = self._rv
                if broken:
                    handler.close_connection = True
                    return  # no terminating chunk: the client sees a broken stream
                for rv, kind, old, new in pending:
                    since = rv
                    was, now = old is not None and _matches(old, selector), _matches(new, selector)
                    if kind == "DELETED":
                        if was:
                            send({"type": "DELETED", "object": new})
                    elif now:
                        send({"type": "MODIFIED" if was else "ADDED", "object": new})
                    elif was:
                        send({"type": "DELETED", "object": new})
                if ended or time.monotonic() >= deadline:
                    end()
                    return
                if bookmarks and time.monotonic() - last_bookmark >= self.bookmark_interval_s:
                    last_bookmark = time.monotonic()
                    since = max(since, current)
                    send(
                        {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": "Pod",
                                "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(since)},
                            },
                        }
                    )
        except (BrokenPipeError, ConnectionResetError, OSError):
            handler.close_connection = True
        finally:
            with self._cond:
                self._live.pop(id(handler), None)
