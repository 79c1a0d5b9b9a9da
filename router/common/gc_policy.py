"""The router process's garbage-collector policy: what ``kvroute serve`` sets at startup
(router/service.py, ``gc_freeze``), and what the benches that measure its work set too.

- Freeze: startup leaves millions of long-lived objects (transformers, the tokenizer); a full
  collection scanning them would stall every request for hundreds of milliseconds. They leave
  the collector's generations.
- The youngest generation is collected after 20,000 net allocations of tracked objects, not
  Python's 700. A lookup at a thousand replicas allocates about 3,000 (a ``PrefixMatch`` and
  its dicts per replica), so at 700 it ran three collections over its own live results each
  time: 100 of a chat lookup's 375 us, and most of its p99 (docs/benchmarks.md). At 20,000
  most such objects die before a collection runs. The older generations keep Python's ratios,
  so cycles are still found, only later.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "apply", "restore"]

YOUNG_THRESHOLD = 20_000


def apply() -> tuple[int, int, int]:
    """Collect, freeze what is left, raise the youngest generation's threshold; returns the
    thresholds before, for ``restore``."""
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, before[1], before[2])
    return before


def restore(before: tuple[int, int, int]) -> None:
    """Undo ``apply`` (a bench run inside a longer-lived process)."""
    gc.set_threshold(*before)
    gc.unfreeze()
