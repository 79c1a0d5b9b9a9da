"""The subscriber package's shape: its public names, ``FeedHealth``, and imports without cycles."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import zmq

import kvroute.indexer.subscriber as subscriber
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.subscriber import EventSubscriber, FeedHealth

# Each module imports only those before it (indexer/subscriber/README.md).
ORDER = ["types", "budget", "recovery", "replica_feed", "sockets", "manager"]


def test_public_names_are_the_packages() -> None:
    """What the router, the benches and the tests import from the package, each the object
    of the one module that defines it."""
    imported_elsewhere = {
        "EventSource",
        "EventSubscriber",
        "FeedHealth",
        "FeedStats",
        "Freshness",
        "ReplicaFeed",
        "ReplicaSnapshot",
        "WarmOutcome",
        "moot_prefix",
    }
    assert imported_elsewhere <= set(subscriber.__all__)
    modules = [importlib.import_module(f"kvroute.indexer.subscriber.{m}") for m in ORDER]
    for name in subscriber.__all__:
        homes = [m for m in modules if name in getattr(m, "__all__", ())]
        assert len(homes) == 1, (name, homes)
        assert getattr(subscriber, name) is getattr(homes[0], name)


def test_event_subscriber_is_feed_health() -> None:
    with EventSubscriber(InMemoryPrefixIndex(), context=zmq.Context()) as events:
        assert isinstance(events, FeedHealth)
        health: FeedHealth = events
        assert health.all_feed_stats() == {}
        assert health.freshness("nobody")[0] is subscriber.Freshness.STALE


def test_modules_import_only_those_before_them() -> None:
    folder = Path(subscriber.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted([*ORDER, "__init__"])
    for i, name in enumerate(ORDER):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        }
        own = {m.rsplit(".", 1)[1] for m in imported if m.startswith("kvroute.indexer.subscriber.")}
        assert "kvroute.indexer.subscriber" not in imported, name
        assert own <= set(ORDER[:i]), (name, own - set(ORDER[:i]))
