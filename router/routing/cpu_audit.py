"""A replica's answer as proof that its CPU tier lacks what the index holds there.

vLLM's OffloadingConnector empties its CPU tier on a connector reset and publishes nothing
(``reset_prefix_cache(reset_connector=True)``: ``/reset_prefix_cache?reset_external=true``,
``/pause``, ``/sleep``). The router sees the resets it forwards, and the index marks the
device's clear that comes with one (indexer/index/resets.py). One reset leaves no trace at
all: sent to the replica directly while its device could not be reset (``{"success":
false}``: blocks in use), the connector is reset anyway and the device publishes no clear.

What does show it is the next answer the router gets on those chunks. vLLM reports each
request's cached tokens (``usage.prompt_tokens_details.cached_tokens``, with
``--enable-prompt-tokens-details``): the device's hit and the connector's load together
(``PrefillStats.num_cached_tokens``). A request the router sent predicting the device's part
and then a load from CPU, whose cached tokens stop at or before the device's part, proves the
connector did not have the first chunk predicted after it (it loads chunks in order from the
device's end and stops at the first it lacks). The whole run of CPU blocks the router
predicted is dropped from the index's CPU tier of that replica (``PrefixIndex.refute_cpu``):
after a reset nothing of it is left, and a wrong drop costs predictions, never a false hit.
So each stale chunk misleads at most one request per router.

Only when the answer can prove it: a single prompt that read the prefix cache (prompt
logprobs make vLLM skip it), priced from the index alone (a router-local hint may have
predicted more of the device), with nothing but the device and confirmed CPU in the
prediction, and not the decode leg of a P/D split (its cached tokens are the prefill's). The
price of a wrong proof (the device hit shorter than the index said, so the connector loaded
from an earlier block; a load that failed and was recomputed) is the chunks it names, under-
predicted until offloaded again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvroute.indexer.tiers import Tier

if TYPE_CHECKING:
    from kvroute.indexer.index import PrefixIndex
    from kvroute.router.routing.router import Decision

__all__ = ["audit_cpu", "skips_prefix_cache"]

_GPU, _CPU = Tier.GPU.label(), Tier.CPU.label()


def skips_prefix_cache(body: dict[str, Any]) -> bool:
    """Whether vLLM computes this request's prompt without reading the prefix cache:
    ``SamplingParams.skip_reading_prefix_cache`` defaults to true with prompt logprobs
    (completions' ``echo`` with ``logprobs`` asks for them too)."""
    if body.get("skip_reading_prefix_cache") is True or body.get("prompt_logprobs") is not None:
        return True
    return body.get("echo") is True and body.get("logprobs") is not None


def audit_cpu(index: PrefixIndex, decision: Decision, replica: str, delivered: int | None) -> int:
    """Drop the CPU blocks ``delivered`` cached tokens prove the replica lacks; returns how
    many went (0: nothing proved)."""
    if delivered is None or decision.skips_cache or decision.remote_prefill:
        return 0
    if len(decision.batch_sizes) > 1:
        return 0
    view = decision.view(replica)
    if view is None or view.block_size is None or view.hint_tokens > view.match_tokens:
        return 0
    tiers = {t: n for t, n in view.tokens_by_tier.items() if n}
    cpu = tiers.get(_CPU, 0)
    if not cpu or set(tiers) - {_GPU, _CPU}:
        return 0
    gpu = tiers.get(_GPU, 0)
    if delivered > gpu:
        return 0  # something past the device's part was served
    bs = view.block_size
    keys = decision.keys.get(bs)
    if not keys:
        return 0
    return index.refute_cpu(replica, keys[gpu // bs : (gpu + cpu) // bs])
