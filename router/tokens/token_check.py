"""The local tokenizer, checked against the replicas on live traffic, per model.

A startup self-check on two samples misses what only real traffic shows (a tool-use
template path, a content-part shape, a replica restarted with another ``--chat-template``).
So every ``every``-th request of a model is also tokenized by a replica
(render endpoint or ``/tokenize``) in a background task, never on the request's path, at most
one check in flight. A difference switches that model to remote tokenization at once (one
error log with the first differing position and the ids around it); the model keeps being
sampled while remote, and ``clean_to_return`` clean checks in a row switch it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvroute.router.errors import RouterError
from kvroute.router.tokens.remote_tokens import RemoteTokenizer
from kvroute.router.tokens.requests import ParsedRequest
from kvroute.router.tokens.tokenization import LocalTokenizer, first_difference

__all__ = ["LiveCheck", "ModelCheck", "mismatch_detail"]

log = logging.getLogger(__name__)

# ids shown on each side of the first difference
_CONTEXT = 4


@dataclass(slots=True)
class ModelCheck:
    """One model's tokenization mode and check history."""

    mode: str = "local"  # "local" | "remote"
    requests: int = 0
    checks: int = 0
    clean: int = 0
    mismatches: int = 0
    errors: int = 0
    skipped_busy: int = 0
    clean_streak: int = 0
    switches_to_remote: int = 0
    last_check_at: float | None = None
    last_mismatch: dict[str, Any] | None = None
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "requests": self.requests,
            "checks": self.checks,
            "clean": self.clean,
            "mismatches": self.mismatches,
            "errors": self.errors,
            "skipped_busy": self.skipped_busy,
            "clean_streak": self.clean_streak,
            "switches_to_remote": self.switches_to_remote,
            "last_check_at": self.last_check_at,
            "last_mismatch": self.last_mismatch,
            "last_error": self.last_error,
        }


def mismatch_detail(ours: list[int], theirs: list[int], at: int, source: str) -> dict[str, Any]:
    lo = max(0, at - _CONTEXT)
    return {
        "at": time.time(),
        "first_difference": at,
        "router_tokens": len(ours),
        "replica_tokens": len(theirs),
        "window_start": lo,
        "router_ids": ours[lo : at + _CONTEXT + 1],
        "replica_ids": theirs[lo : at + _CONTEXT + 1],
        "replica_source": source,
    }


class LiveCheck:
    def __init__(
        self,
        every: int,
        clean_to_return: int = 3,
        *,
        on_check: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_check(model, outcome)``: outcome ``clean``, ``mismatch`` or ``error``."""
        self.every = max(0, every)
        self.clean_to_return = max(1, clean_to_return)
        self.on_check = on_check
        self.models: dict[str, ModelCheck] = {}
        self._task: asyncio.Task[None] | None = None

    def state(self, model: str) -> ModelCheck:
        st = self.models.get(model)
        if st is None:
            st = self.models[model] = ModelCheck()
        return st

    def mode(self, model: str) -> str:
        st = self.models.get(model)
        return st.mode if st is not None else "local"

    def observe(
        self, model: str, req: ParsedRequest, local: LocalTokenizer, remote: RemoteTokenizer
    ) -> None:
        """Count a request of ``model``; start a background check when it is sampled."""
        st = self.state(model)
        st.requests += 1
        if not self.every or st.requests % self.every:
            return
        if self._task is not None and not self._task.done():
            st.skipped_busy += 1
            return
        self._task = asyncio.get_running_loop().create_task(
            self._check(model, req, local, remote), name=f"kvroute-token-check-{model}"
        )

    async def run_check(
        self, model: str, req: ParsedRequest, local: LocalTokenizer, remote: RemoteTokenizer
    ) -> bool | None:
        """One check now (tests, and the background task): True clean, False mismatch,
        None when the replica could not be asked."""
        st = self.state(model)
        try:
            ours = await local.encode(req)
            theirs = await remote.fetch(req)
        except (RouterError, OSError) as exc:
            st.errors += 1
            st.last_error = str(getattr(exc, "message", exc))
            self._count(model, "error")
            log.debug("tokenizer check for %s could not run: %s", model, st.last_error)
            return None
        st.checks += 1
        st.last_check_at = time.time()
        at = first_difference(ours, theirs.tokens)
        if at is None:
            self._clean(model, st)
            return True
        self._mismatch(model, st, mismatch_detail(ours, theirs.tokens, at, theirs.source))
        return False

    async def _check(
        self, model: str, req: ParsedRequest, local: LocalTokenizer, remote: RemoteTokenizer
    ) -> None:
        try:
            await self.run_check(model, req, local, remote)
        except Exception:  # a check must never take the router down
            log.exception("tokenizer check for %s failed", model)

    def _count(self, model: str, outcome: str) -> None:
        if self.on_check is not None:
            self.on_check(model, outcome)

    def _clean(self, model: str, st: ModelCheck) -> None:
        st.clean += 1
        st.clean_streak += 1
        self._count(model, "clean")
        if st.mode == "remote" and st.clean_streak >= self.clean_to_return:
            st.mode = "local"
            log.warning(
                "tokenizer for %s matches the replicas again (%d clean checks in a row): "
                "back to local tokenization",
                model,
                st.clean_streak,
            )

    def _mismatch(self, model: str, st: ModelCheck, detail: dict[str, Any]) -> None:
        st.mismatches += 1
        st.clean_streak = 0
        st.last_mismatch = detail
        self._count(model, "mismatch")
        if st.mode == "remote":
            log.debug("tokenizer for %s still differs from the replicas: %s", model, detail)
            return
        st.mode = "remote"
        st.switches_to_remote += 1
        log.error(
            "tokenizer MISMATCH for model %s on live traffic: the router's ids differ from "
            "the replica's (%s) at position %d (router %d ids, replica %d); router ids from "
            "%d: %s, replica ids: %s. Switching %s to remote tokenization until %d clean "
            "checks in a row.",
            model,
            detail["replica_source"],
            detail["first_difference"],
            detail["router_tokens"],
            detail["replica_tokens"],
            detail["window_start"],
            detail["router_ids"],
            detail["replica_ids"],
            model,
            self.clean_to_return,
        )

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def stats(self) -> dict[str, Any]:
        return {name: st.to_dict() for name, st in sorted(self.models.items())}
