"""The global prefix index: block key -> which replicas hold it, and in which tiers.

``PrefixIndex`` is the small interface the subscriber writes to and the router reads from;
``InMemoryPrefixIndex`` is its in-process backend. The index knows nothing of sockets or
sequence numbers: it applies decoded events of one replica in the order it is given them, and
answers lookups. Metrics and freshness live outside it (indexer/stats.py, indexer/subscriber).

What an event means depends on who published it, and the rules are vLLM's (0.32/0.33), read
from its block pool and offloading connector (docs/indexer.md restates them). Each module of
this package states the rules it keeps (README.md maps them): keys, reference counts and
partial blocks in confirmed.py, tier-only stores in chunks.py, hybrid models in hybrid.py,
unconfirmed media in unconfirmed.py, EAGLE's dropped block in drafts.py, device resets in
memory.py, and the store's layout in
state.py.

This module is the package's API: the names below. indexer/snapshot.py, which copies a
replica's state whole, reads the store's layout from state.py.
"""

from kvroute.indexer.index.api import (
    DOMAIN_PREFIX,
    EAGLE_METHODS,
    ApplyResult,
    DomainSummary,
    IndexFigures,
    PrefixIndex,
    PrefixMatch,
    ReplicaIndexSummary,
    domain_key,
    drops_block,
    split_domain_key,
)
from kvroute.indexer.index.memory import InMemoryPrefixIndex

__all__ = [
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
]
