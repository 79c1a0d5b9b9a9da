"""``BurstHints`` (router/routing/hints.py): what the router just sent where, for ``ttl_s``,
at most ``max_keys``; kept where the garbage collector does not walk it."""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.hints import BurstHints


class _FlatHints:
    """The specification: the layout before (one dict of (key, replica) -> expiry and a deque
    of insertions), whose answers the typed arrays must give."""

    def __init__(self, ttl_s: float, max_keys: int) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._expiry: dict[tuple[int, str], float] = {}
        self._order: deque[tuple[float, int, str]] = deque()

    def __len__(self) -> int:
        return len(self._expiry)

    def record(self, replica: str, keys: Sequence[int], now: float) -> None:
        if self.ttl_s <= 0 or not keys:
            return
        when = now + self.ttl_s
        for key in keys:
            self._expiry[(key, replica)] = when
            self._order.append((when, key, replica))
        while self._order and (self._order[0][0] <= now or len(self._expiry) > self.max_keys):
            at, key, name = self._order.popleft()
            if self._expiry.get((key, name)) == at:
                del self._expiry[(key, name)]

    def match(self, replicas: Sequence[str], keys: Sequence[int], now: float) -> dict[str, int]:
        out = dict.fromkeys(replicas, 0)
        for name in replicas:
            n = 0
            for key in keys:
                if self._expiry.get((key, name), 0.0) <= now:
                    break
                n += 1
            out[name] = n
        return out

    def forget(self, replica: str) -> None:
        for pair in [p for p in self._expiry if p[1] == replica]:
            del self._expiry[pair]


_KEYS = st.lists(st.sampled_from([1, 2, 3, 4, 5, 2**64 - 1]), min_size=0, max_size=6)


@settings(max_examples=400, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "match", "forget", "tick"]),
            st.sampled_from(["a", "b", "c"]),
            _KEYS,
            st.floats(0.0, 3.0),
        ),
        max_size=50,
    ),
    max_keys=st.sampled_from([3, 8, 1000]),
)
def test_the_typed_arrays_answer_as_the_flat_dict(
    ops: list[tuple[str, str, list[int], float]], max_keys: int
) -> None:
    """Differential: records, expiry, the cap (oldest first), re-recorded keys (a later
    expiry wins), forgotten replicas and their stale FIFO entries, against the spec."""
    now = 100.0
    ours, spec = BurstHints(2.0, max_keys), _FlatHints(2.0, max_keys)
    for op, replica, keys, amount in ops:
        if op == "tick":
            now += amount
        elif op == "record":
            ours.record(replica, keys, now)
            spec.record(replica, keys, now)
        elif op == "forget":
            ours.forget(replica)
            spec.forget(replica)
        names = ["a", "b", "c"]
        assert ours.match(names, keys, now) == spec.match(names, keys, now)
        assert len(ours) == len(spec)


def test_a_long_fifo_is_compacted_and_nothing_is_left_for_the_collector() -> None:
    """Hints far past the compaction threshold expire in order, the arrays shrink back, and
    the garbage collector has nothing to walk: the per-replica dicts are untracked and the
    arrays hold no objects (a full collection walked every hint of the dict of tuples and
    the deque before: 6.5 ms at the default cap)."""
    hints = BurstHints(ttl_s=1.0, max_keys=1_000_000)
    for i in range(100):
        hints.record(f"r{i % 4}", list(range(i * 100, i * 100 + 100)), now=10.0 + i * 0.01)
    assert len(hints) == 10_000
    assert hints.match(["r0", "r1"], list(range(0, 100)), now=10.5) == {"r0": 100, "r1": 0}
    gc.collect()
    assert not any(gc.is_tracked(held) for held in hints._expiry.values())
    for part in (hints._when, hints._keys, hints._who):  # a collection visits no element
        assert gc.get_referents(part) in ([], [type(part)])
    hints.record("r0", [1], now=20.0)  # everything before has expired
    assert len(hints) == 1 and len(hints._when) == 1 and hints._head == 0
