"""``match_tiers``: a match's tokens per tier name. Its one-tier shortcut (what most replicas of
a large fleet are asked) must give what the general rule gives, for any match."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.indexer.index import PrefixMatch
from kvroute.indexer.wire import Medium
from kvroute.router.routing.match_tiers import TIER_LABELS as _TIER_LABELS
from kvroute.router.routing.match_tiers import match_tiers

_tiers = st.sampled_from(list(Medium))
_counts = st.dictionaries(_tiers, st.integers(0, 50), max_size=3)


def _general(match: PrefixMatch) -> dict[str, int]:
    """The rule written out: every confirmed tier's tokens (the partial block's tokens on
    the device), then every unconfirmed tier's, whichever are not zero."""
    out: dict[str, int] = {}
    for tier, label, _ in _TIER_LABELS:
        if n := match.tokens_in(tier):
            out[label] = n
    for tier, _, label in _TIER_LABELS:
        if n := match.unconfirmed_tokens_in(tier):
            out[label] = n
    return out


@settings(max_examples=300, deadline=None)
@given(_counts, _counts, st.sampled_from([0, 1, 16]), st.integers(0, 15))
def test_the_shortcut_gives_the_general_rule(
    confirmed: dict[Medium, int], unconfirmed: dict[Medium, int], block_size: int, partial: int
) -> None:
    blocks = sum(confirmed.values()) + sum(unconfirmed.values())
    match = PrefixMatch("r", block_size, blocks, confirmed, unconfirmed, partial)
    assert match_tiers(match) == _general(match)


def test_a_device_only_match_is_its_tokens_on_the_device() -> None:
    assert match_tiers(PrefixMatch("r", 16, 4, {Medium.GPU: 4})) == {"GPU": 64}
    assert match_tiers(PrefixMatch("r", 16, 0, {Medium.GPU: 0})) == {}
    assert match_tiers(PrefixMatch("r", 16, 2, {Medium.CPU: 2}, {}, 5)) == {"CPU": 32, "GPU": 5}
