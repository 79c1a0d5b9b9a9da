"""The index and the event feeds that fill it, built from the router's settings: what every
front door that decides (``kvroute serve``'s service, Ray Serve's request router) reads."""

from __future__ import annotations

from kvroute.indexer import native_core
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.subscriber import EventSubscriber
from kvroute.router.config import RouterSettings

__all__ = ["index_and_feeds"]


def index_and_feeds(settings: RouterSettings) -> tuple[InMemoryPrefixIndex, EventSubscriber]:
    """A new in-memory index with its limits, and a subscriber applying feeds to it. Warns
    once, here at the router's start, when the native index core is missing."""
    native_core.warn_if_python()
    index = InMemoryPrefixIndex(
        max_entries=settings.index_max_entries,
        unconfirmed_ttl_s=settings.unconfirmed_ttl_s,
        unconfirmed_max_blocks=settings.unconfirmed_max_blocks,
    )
    subscriber = EventSubscriber(
        index,
        replay_timeout_s=settings.replay_timeout_s,
        stale_clear_after_s=settings.stale_clear_after_s,
        max_bytes_per_s=settings.event_max_mib_per_s * 2**20,
    )
    return index, subscriber
