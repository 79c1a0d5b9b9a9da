"""What the index's match says a request will find cached on a replica, per tier.

``predicted_cached_tokens`` caps a match as vLLM serves it (the last prompt token is always
computed); ``match_tiers`` names a match's tokens by tier, confirmed tiers by name and the
tiers of publishers that never announce removals as ``<TIER>_UNCONFIRMED``, the keys of
``ReplicaView.tokens_by_tier`` that the cost model and the calibration read.
"""

from __future__ import annotations

from kvroute.indexer.index import PrefixMatch
from kvroute.indexer.tiers import Tier

__all__ = ["TIER_DROP_ORDER", "TIER_LABELS", "match_tiers", "predicted_cached_tokens"]

# Each tier, fastest first, with its keys in ReplicaView.tokens_by_tier (confirmed,
# unconfirmed), looked up once.
TIER_LABELS = tuple((t, t.label(), t.label(confirmed=False)) for t in sorted(Tier))
# Which tiers' tokens a match loses first when capped (the tail of a match sits in the
# slowest tier it reaches).
TIER_DROP_ORDER = tuple(
    label
    for _, confirmed, unconfirmed in reversed(TIER_LABELS)
    for label in (unconfirmed, confirmed)
)


def predicted_cached_tokens(match_tokens: int, prompt_len: int, block_size: int) -> int:
    """vLLM recomputes the last prompt token even on a full hit, so at most the whole blocks
    (or prefix-match units, ``block_size`` being the unit then) before it are served."""
    if prompt_len <= 0 or block_size <= 0:
        return 0
    return min(match_tokens, ((prompt_len - 1) // block_size) * block_size)


_CONFIRMED_LABELS = {tier: label for tier, label, _ in TIER_LABELS}


def match_tiers(match: PrefixMatch) -> dict[str, int]:
    """A match's tokens per tier name: confirmed tiers by name, and the tiers of publishers
    that never announce removals as ``<TIER>_UNCONFIRMED``."""
    by_tier = match.blocks_by_tier
    if len(by_tier) == 1 and not match.unconfirmed_by_tier and not match.partial_tokens:
        # One confirmed tier, no partial block (most replicas of a large fleet): the same
        # answer as the loops below, without them (a decision asks it of every replica).
        ((tier, blocks),) = by_tier.items()
        label = _CONFIRMED_LABELS.get(tier)
        if label is not None:
            tokens = blocks * match.block_size
            return {label: tokens} if tokens else {}
    tiers: dict[str, int] = {}
    for tier, label, _ in TIER_LABELS:
        n = match.tokens_in(tier)
        if n:
            tiers[label] = n
    for tier, _, label in TIER_LABELS:
        n = match.unconfirmed_tokens_in(tier)
        if n:
            tiers[label] = n
    return tiers
