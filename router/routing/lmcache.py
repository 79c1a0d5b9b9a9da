"""LMCache's controller as the source of what LMCache holds, where its events cannot be had.

LMCache's KV events are approximate (no LoRA, salt or image keys; never a removal) and on
its tensor path lost whole (vLLM cannot encode a ``torch.device`` medium). Its controller
(``lmcache.v1.api_server``) answers ``POST /lookup {"tokens": [...]}`` with
``{"event_id": ..., "layout_info": {instance_id: [location, token_count]}}``: per LMCache
instance, how many of the prompt's leading tokens it holds, by LMCache's own chunking and
hashes, now.

With ``--lmcache-controller URL``, the router asks it once per routed prompt for the replicas
that name their instance (``lmcache_instance=ID``), within ``lmcache_lookup_timeout_s``; the
answer replaces what the index believes of those replicas' LMCache tier (its unconfirmed CPU
tokens): a replica is predicted to serve ``max(its device prefix and confirmed tiers, the
controller's count)``, capped at the prompt's last token, the excess counted as CPU. A slow or
failed answer changes nothing (counted in ``failures``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

__all__ = ["LMCacheController"]


@dataclass(slots=True)
class LMCacheController:
    url: str
    timeout_s: float = 0.05
    lookups: int = 0
    failures: int = 0
    last_error: str | None = None
    last_latency_s: float | None = None
    _client: httpx.AsyncClient | None = None

    async def lookup(self, tokens: Sequence[int]) -> dict[str, int] | None:
        """Per LMCache instance, the leading tokens of ``tokens`` it holds; None when the
        controller did not answer in time or answered something else."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self.lookups += 1
        started = time.monotonic()
        try:
            resp = await self._client.post(
                self.url.rstrip("/") + "/lookup", json={"tokens": list(tokens)}
            )
            resp.raise_for_status()
            info = resp.json()["layout_info"]
            out = {}
            for instance, (_, count) in info.items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                    raise ValueError(f"token count {count!r}")
                out[str(instance)] = count
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        self.last_latency_s = time.monotonic() - started
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
