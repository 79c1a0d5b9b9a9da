"""The router process's collector policy (router/common/gc_policy.py)."""

from __future__ import annotations

import gc

from kvroute.router.common import gc_policy


def test_apply_freezes_raises_the_young_threshold_and_restore_undoes_it() -> None:
    before = gc.get_threshold()
    kept = [[i] for i in range(10)]
    saved = gc_policy.apply()
    try:
        assert saved == before
        assert gc.get_threshold() == (gc_policy.YOUNG_THRESHOLD, before[1], before[2])
        assert gc.get_freeze_count() >= len(kept)  # what lived at startup left the generations
    finally:
        gc_policy.restore(saved)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
