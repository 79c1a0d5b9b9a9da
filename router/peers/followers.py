"""Following peer routers' load: one long-lived stream per listed peer.

``PeerLoad.follow`` holds a ``GET /peer/load`` open and applies the sums each time its peer
answers; this keeps exactly one such task per peer in the current list, starts the ones for
new peers, stops those for peers no longer listed (and forgets what they reported), and
restarts a task that ended by a bug rather than by being stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from kvroute.router.peers.load import PeerLoad

__all__ = ["PeerFollowers"]

log = logging.getLogger(__name__)


class PeerFollowers:
    def __init__(self, peer_load: PeerLoad, apply: Callable[[], None]) -> None:
        self.peer_load = peer_load
        self._apply = apply  # sets every replica's share from the peers' sums
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def follow(self, client: httpx.AsyncClient, urls: list[str]) -> None:
        """Follow exactly the peers at ``urls``."""
        await self.stop([u for u in self._tasks if u not in urls])
        for url in urls:
            old = self._tasks.get(url)
            if old is not None and old.done():  # ended by a bug, not by us: start it again
                if not old.cancelled() and old.exception() is not None:
                    log.error("peer load: following %s failed: %r", url, old.exception())
                old = None
            if old is None:
                self._tasks[url] = asyncio.create_task(
                    self.peer_load.follow(client, url, self._apply),
                    name=f"kvroute-peer-load {url}",
                )

    async def stop(self, urls: list[str] | None = None) -> None:
        """Stop following ``urls`` (every peer when None) and forget their reports."""
        for url in list(self._tasks) if urls is None else urls:
            task = self._tasks.pop(url)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self.peer_load.forget(url)
