"""The cache tiers, one vocabulary for the indexer, the router and the connector.

``Tier`` is an ``IntEnum`` because both things about a tier are used: its value is its rank,
fastest first (the prefix index uses it as the tier's bit offset, and sorting tiers sorts
them by speed), and its ``name`` is vLLM's wire medium string (``"GPU"``, ``"CPU"``,
``"STORAGE"``), which is what KV events carry and what ``/index/stats``, the dashboard and the
decision log show. Those strings are vLLM's and never change; outside the wire codec, code
writes ``Tier.CPU`` and turns a tier into text with ``.name`` or ``label()`` only where text
is the output (``str()`` and f-strings of an ``IntEnum`` give its number).

The connector's two offload tiers are the same tiers: its RAM is ``Tier.CPU`` and its disk is
``Tier.STORAGE``, the media its events announce.

This module imports nothing beyond the standard library: the connector, which runs inside
vLLM, imports it.
"""

from __future__ import annotations

import enum

__all__ = ["UNCONFIRMED_SUFFIX", "Tier"]

# What a tier's name gets for blocks held only by a publisher that never announces removals
# (LMCache, llm-d's FS backend): "CPU_UNCONFIRMED" in stats and decision logs.
UNCONFIRMED_SUFFIX = "_UNCONFIRMED"


class Tier(enum.IntEnum):
    """A cache tier, ordered from fastest to slowest; ``name`` is its wire medium."""

    GPU = 0
    CPU = 1
    STORAGE = 2

    def label(self, *, confirmed: bool = True) -> str:
        """The tier's text key in JSON: its name, suffixed for unconfirmed blocks."""
        return self.name if confirmed else self.name + UNCONFIRMED_SUFFIX
