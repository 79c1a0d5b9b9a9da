"""The index package's shape (indexer/index/README.md): its public names, imports in layers
without cycles, every method of the backend in one module, and a read path that writes nothing."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import kvroute.indexer.index as index_pkg
from kvroute.indexer.index import InMemoryPrefixIndex, PrefixIndex, domain_key
from kvroute.indexer.index.state import IndexStore, _Held, _ReplicaState
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import BlockStored, Event
from tests.indexer.builders import BS, DOC, DOCS, OTHER, ehash, lmcache_chunk, operation, stored

BOTTOM = ["api", "state"]
MIXINS = [
    "confirmed",
    "native_runs",
    "chunks",
    "hybrid",
    "unconfirmed",
    "domains",
    "drafts",
    "resets",
    "losses",
    "capacity",
    "lookup",
]
# built on the store's layout only, for the mixins (lookups' plans)
SUPPORT = ["plans"]
MODULES = [*BOTTOM, *SUPPORT, *MIXINS, "memory"]


def test_public_names_are_the_packages() -> None:
    """What the router, the subscriber, the stats, the benches and the tests import from the
    package, each the object of the one module that defines it."""
    imported_elsewhere = {
        "DOMAIN_PREFIX",
        "EAGLE_METHODS",
        "ApplyResult",
        "DomainSummary",
        "InMemoryPrefixIndex",
        "IndexFigures",
        "PrefixIndex",
        "PrefixMatch",
        "ReplicaIndexSummary",
        "domain_key",
        "drops_block",
        "split_domain_key",
    }
    assert imported_elsewhere == set(index_pkg.__all__)
    modules = [importlib.import_module(f"kvroute.indexer.index.{m}") for m in MODULES]
    for name in index_pkg.__all__:
        homes = [m for m in modules if name in getattr(m, "__all__", ())]
        assert len(homes) == 1, (name, homes)
        assert getattr(index_pkg, name) is getattr(homes[0], name)
    # indexer/snapshot.py copies the store's layout from state.py, not through the package.
    for name in ("_MAX_CHUNK_BLOCKS", "_SLOT", "_W", "_Held", "_LossWindow", "_ReplicaState"):
        assert not hasattr(index_pkg, name), name


def test_modules_import_in_layers() -> None:
    """api and state import nothing of the package, plans only state, a mixin only those,
    memory the mixins; none imports the package's ``__init__``."""
    folder = Path(index_pkg.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted([*MODULES, "__init__"])
    allowed = {m: set() for m in BOTTOM} | {m: {"state"} for m in SUPPORT}
    allowed |= {m: set(BOTTOM) | set(SUPPORT) for m in MIXINS}
    allowed["memory"] = set(BOTTOM) | set(SUPPORT) | set(MIXINS)
    for name in MODULES:
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module is not None
        }
        own = {m.rsplit(".", 1)[1] for m in imported if m.startswith("kvroute.indexer.index.")}
        assert "kvroute.indexer.index" not in imported, name
        assert own <= allowed[name], (name, own - allowed[name])


def test_every_method_is_defined_once_and_none_is_abstract() -> None:
    """Two concerns defining one name would leave the composition's order to pick one; the
    mixins come before ``PrefixIndex``, whose abstract methods would hide theirs otherwise."""
    assert not InMemoryPrefixIndex.__abstractmethods__
    ours = [
        c
        for c in InMemoryPrefixIndex.__mro__
        if c is InMemoryPrefixIndex or IndexStore in c.__mro__
    ]
    homes: dict[str, list[str]] = {}
    for cls in ours:
        for name in vars(cls):
            if not name.startswith("__") or name == "__init__":
                homes.setdefault(name, []).append(cls.__name__)
    assert {n: h for n, h in homes.items() if len(h) > 1} == {}
    for name in vars(PrefixIndex):
        if not name.startswith("__") and name != "_abc_impl":
            assert name in homes, name


def _tables(index: InMemoryPrefixIndex) -> dict[str, Any]:
    """Everything the index holds, in order (a dict's order is age), as plain values."""

    def plain(v: Any) -> Any:
        if isinstance(v, _ReplicaState):
            return {s: plain(getattr(v, s)) for s in _ReplicaState.__slots__}
        if isinstance(v, _Held):
            return (v.cls, v.keys, v.expires)
        if isinstance(v, dict) or type(v).__name__ in ("U64Map", "MaskMap"):  # native tables
            return [(plain(k), plain(x)) for k, x in v.items()]
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        if isinstance(v, set | frozenset):
            return sorted(v)
        return v

    # ``_plans``: lookups' cache of how they group the replicas (plans.py), theirs to write
    skipped = ("_lock", "_clock", "_plans")
    return {k: plain(v) for k, v in vars(index).items() if k not in skipped}


@settings(max_examples=60, deadline=None)
@given(st.lists(operation(), max_size=30))
def test_reads_write_nothing(ops: list[tuple[str, Event]]) -> None:
    """Lookups, ``block_tiers`` and the figures leave every table as it was, whatever the index
    holds (confirmed and unconfirmed classes, a storage domain, a hybrid group)."""
    index = InMemoryPrefixIndex()
    index.attach("r1", "d")
    for replica, event in ops:
        index.apply(replica, [event])
    extra: list[Event] = [
        stored(DOCS[1], 0, 2),
        BlockStored([ehash(tuple(DOCS[1][:BS]))], None, DOCS[1][:BS], BS, group_idx=1),
        lmcache_chunk(DOC, 0, 2 * BS, 4242, None),
    ]
    index.apply("r2", extra)
    before = _tables(index)
    for tokens in (*DOCS, DOC, OTHER):
        index.lookup(RequestKeys(tokens))
        index.lookup(tokens, lora_name="a", replicas=["r0", "r2", domain_key("d"), "nobody"])
        for replica in ("r0", "r1", "r2", domain_key("d")):
            index.block_tiers(replica, tokens)
    index.summary()
    index.stats()
    index.domains()
    index.tier_histogram()
    index.estimated_bytes()
    assert _tables(index) == before
