"""``KvRoom`` (router/routing/kv_room.py): a request that does not fit a replica's device cache
waits for the requests holding it to end; what others hold comes from the last scrape."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.routing.kv_room import KvRoom, waits_to_price


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _room(clock: Clock, decode: float = 0.01) -> KvRoom:
    return KvRoom(decode_s_per_token=decode, clock=clock)


def test_a_request_that_fits_waits_nothing() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", (), 60, 40, 0.1)  # ends at 0.1 + 40 * 0.01 = 0.5 s
    assert room.wait_s("r0", 100, 160, 0.0, None, 40) == 0.0
    assert room.held_blocks("r0") == 60


def test_one_that_does_not_fit_waits_for_the_first_ends_that_free_enough() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "long", (), 80, 100, 0.0)  # ends at 1.0
    room.add("r0", "short", (), 60, 20, 0.0)  # ends at 0.2
    # 20 free: 30 need the short one's end, 100 need both
    assert room.wait_s("r0", 30, 160, 0.0, None, 40) == pytest.approx(0.2)
    assert room.wait_s("r0", 100, 160, 0.0, None, 40) == pytest.approx(1.0)
    clock.now += 0.5
    room.ended("r0", "short")
    assert room.wait_s("r0", 30, 160, 0.0, None, 40) == 0.0
    assert room.wait_s("r0", 100, 160, 0.0, None, 40) == pytest.approx(0.5)


def test_the_first_byte_rebases_the_end_on_the_output_budget() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", (), 150, 40, 2.0)  # predicted: first token at 2.0, end at 2.4
    assert room.wait_s("r0", 20, 160, 0.0, None, 40) == pytest.approx(2.4)
    clock.now += 0.1
    room.first_byte("r0", "a")  # came early: ends 0.4 s from now
    assert room.wait_s("r0", 20, 160, 0.0, None, 40) == pytest.approx(0.4)


def test_what_the_scrape_saw_beyond_this_routers_requests_is_held_by_others() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", (), 40, 10, 0.0)
    scraped_at = clock.now + 0.01
    clock.now += 0.05
    # the page said 100 blocks in use: 40 ours, 60 someone else's
    assert room.wait_s("r0", 50, 160, 100.0, scraped_at, 10) == 0.0
    assert room.wait_s("r0", 70, 160, 100.0, scraped_at, 10) == pytest.approx(0.05)
    # ours ended since the scrape: its 40 are free, the others' 60 still held
    room.ended("r0", "a")
    assert room.wait_s("r0", 100, 160, 100.0, scraped_at, 10) == 0.0
    # more than ours can free: after the last of ours, one answer of its own budget
    room.add("r0", "b", (), 90, 10, 0.0)  # ends 0.1 s from now
    assert room.wait_s("r0", 100, 160, 100.0, scraped_at, 10) == pytest.approx(0.1)
    assert room.wait_s("r0", 110, 160, 100.0, scraped_at, 10) == pytest.approx(0.1 + 0.1)


def test_requests_sent_after_the_scrape_are_not_counted_twice() -> None:
    clock = Clock()
    room = _room(clock)
    scraped_at = clock.now  # the page saw an empty cache
    clock.now += 0.1
    room.add("r0", "a", (), 100, 10, 0.0)
    # used at the scrape 0, ours now 100: 60 free
    assert room.wait_s("r0", 60, 160, 0.0, scraped_at, 10) == 0.0
    assert room.wait_s("r0", 61, 160, 0.0, scraped_at, 10) > 0


def test_a_request_bigger_than_the_cache_or_needing_nothing_waits_nothing() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", (), 160, 10, 0.0)
    assert room.wait_s("r0", 161, 160, 0.0, None, 10) == 0.0
    assert room.wait_s("r0", 0, 160, 0.0, None, 10) == 0.0


def test_decode_pace_is_learned_from_whole_answers_only() -> None:
    clock = Clock()
    room = KvRoom(decode_s_per_token=0.05, learn_weight=0.5, clock=clock)
    assert room.decode_s_per_token("r0") == 0.05
    room.add("r0", "a", (), 10, 100, 0.0)
    clock.now += 0.2
    room.first_byte("r0", "a")
    clock.now += 1.0  # 100 budgeted tokens in 1 s
    room.ended("r0", "a")
    assert room.decode_s_per_token("r0") == pytest.approx(0.01)
    room.add("r0", "b", (), 10, 100, 0.0)
    room.first_byte("r0", "b")
    clock.now += 3.0
    room.ended("r0", "b", learn=False)  # failed mid-answer: teaches nothing
    assert room.decode_s_per_token("r0") == pytest.approx(0.01)
    room.add("r0", "c", (), 10, 100, 0.0)
    room.first_byte("r0", "c")
    clock.now += 2.0
    room.ended("r0", "c")
    assert room.decode_s_per_token("r0") == pytest.approx(0.015)
    assert room.samples("r0") == 2
    assert room.snapshot("r0")["decode_samples"] == 2
    assert room.held_blocks("r0") == 0


def test_an_entry_never_reported_ended_expires() -> None:
    clock = Clock()
    room = KvRoom(decode_s_per_token=0.01, stale_after_s=5.0, clock=clock)
    room.add("r0", "lost", (), 150, 10, 0.0)  # predicted end 0.1 s from now
    assert room.wait_s("r0", 20, 160, 0.0, None, 10) > 0
    clock.now += 5.2
    assert room.wait_s("r0", 20, 160, 0.0, None, 10) == 0.0
    assert room.held_blocks("r0") == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        KvRoom(decode_s_per_token=0)
    with pytest.raises(ValueError):
        KvRoom(decode_s_per_token=0.01, learn_weight=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 200), st.integers(0, 100), st.floats(0, 3)),
        max_size=12,
    ),
    st.integers(1, 320),
    st.integers(1, 320),
)
def test_the_wait_is_the_earliest_end_after_which_the_request_fits(
    held: list[tuple[int, int, float]], need: int, capacity: int
) -> None:
    """Against a direct reading of the rule: free now, or the earliest predicted end at
    which what has ended by then leaves room; never negative, never before a fit."""
    clock = Clock()
    room = _room(clock)
    ends = []
    for i, (blocks, budget, first) in enumerate(held):
        room.add("r0", i, (), blocks, budget, first)  # no shared prompt blocks here
        ends.append((first + budget * 0.01, blocks))
    wait = room.wait_s("r0", need, capacity, 0.0, None, 10)
    assert wait >= 0.0
    if need > capacity:
        assert wait == 0.0
        return
    used = sum(b for _, b in ends)
    if capacity - used >= need:
        assert wait == 0.0
        return
    freed_by_then = sum(b for end, b in ends if end <= wait + 1e-9)
    if capacity - used + freed_by_then >= need:
        # and nothing earlier would do
        earlier = sum(b for end, b in ends if end < wait - 1e-9)
        assert capacity - used + earlier < need
    else:  # others would have to free it: never here, all of it is ours
        pytest.fail("all held blocks are this router's: their ends must free room")


def test_prompt_blocks_shared_by_requests_are_held_once_and_freed_by_the_last() -> None:
    clock = Clock()
    room = _room(clock)
    system = list(range(100))  # a 100-block prefix both requests share
    room.add("r0", "a", [*system, 1001, 1002], 3, 10, 0.0)  # ends at 0.1
    room.add("r0", "b", [*system, 2001], 3, 50, 0.0)  # ends at 0.5
    assert room.held_blocks("r0") == 100 + 2 + 1 + 3 + 3
    # a third on the same prefix needs only its own blocks and the ones past the shared run
    assert room.need("r0", [*system, 3001, 3002], 2) == 4
    assert room.need("r0", [9999, *system], 2) == 103  # shares no leading run
    # 160 - 109 = 51 free; a's end frees its own 3 and its 2 unshared blocks (56 free), and
    # only b's end frees the shared 100
    assert room.wait_s("r0", 51, 160, 0.0, None, 10) == 0.0
    assert room.wait_s("r0", 56, 160, 0.0, None, 10) == pytest.approx(0.1)
    assert room.wait_s("r0", 57, 160, 0.0, None, 10) == pytest.approx(0.5)
    room.ended("r0", "a")
    assert room.held_blocks("r0") == 100 + 1 + 3
    room.ended("r0", "b")
    assert room.held_blocks("r0") == 0
    assert room.need("r0", system, 0) == 100


def test_a_request_sent_again_elsewhere_holds_nothing_where_it_was() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", [1, 2, 3], 4, 10, 0.0)
    room.add("r1", "a", [1, 2, 3], 4, 10, 0.0)  # r0 failed before its first byte
    assert room.held_blocks("r0") == 0 and room.held_blocks("r1") == 7
    room.ended("r1", "a")
    assert room.held_blocks("r1") == 0
    room.add("r0", "b", [1], 1, 10, 0.0)
    room.forget("r0")
    assert room.held_blocks("r0") == 0 and room.need("r0", [1], 0) == 1


def test_peer_routers_holdings_count_now_not_as_the_scrape_saw_them() -> None:
    """A peer's requests that ended since the scrape hold nothing now: the scrape's usage
    less what every router held then is what no router knows of (constant until the next);
    what the peers hold now is added."""
    clock = Clock()
    room = _room(clock)
    scraped_at = clock.now
    clock.now += 0.2
    # at the scrape: 100 in use, all of them a peer's; the peer's requests ended since
    assert room.wait_s("r0", 100, 160, 100.0, scraped_at, 10, 0, 100) == 0.0
    # without the peers' share the same page reads as 100 held by someone: a wait
    assert room.wait_s("r0", 100, 160, 100.0, scraped_at, 10) > 0
    # a peer holds 70 now, and 30 of the page were no router's: 60 free
    assert room.wait_s("r0", 60, 160, 100.0, scraped_at, 10, 70, 70) == 0.0
    assert room.wait_s("r0", 61, 160, 100.0, scraped_at, 10, 70, 70) > 0


def test_an_end_reported_from_another_replica_frees_the_request_where_it_was() -> None:
    clock = Clock()
    room = _room(clock)
    room.add("r0", "a", [1, 2], 3, 10, 0.0)
    room.ended("r1", "a")  # a gateway's fallback served it: the end names r1
    assert room.held_blocks("r0") == 0


def test_waits_are_priced_only_when_some_replica_has_room() -> None:
    assert waits_to_price({"r0": 0.0, "r1": 0.8}) == {"r0": 0.0, "r1": 0.8}
    assert waits_to_price({"r0": 0.3, "r1": 0.8}) == {}  # every cache full: queue terms
    assert waits_to_price({}) == {}


def test_peers_blocks_free_evenly_over_one_answer_between_this_routers_ends() -> None:
    clock = Clock()
    room = _room(clock, decode=0.01)  # an answer of 10 tokens: 0.1 s
    # a peer holds 100 now (and held them at the scrape): 60 free; 80 need 20 of the 100
    assert room.wait_s("r0", 80, 160, 100.0, clock.now, 10, 100, 100) == pytest.approx(0.02)
    # this router's own request ends at 0.01 s: the peer has freed 10 by then, the request
    # frees its 30, and the peer's 20 more come by 0.02 s
    room.add("r0", "a", (), 30, 1, 0.0)  # ends 0.01 s from now
    assert room.wait_s("r0", 80, 160, 130.0, clock.now, 10, 100, 100) == pytest.approx(0.02)
    assert room.wait_s("r0", 150, 160, 130.0, clock.now, 10, 100, 100) == pytest.approx(0.09)
    # 20 held by no router: never free within the peers' answer, then one more answer
    assert room.wait_s("r0", 160, 160, 150.0, clock.now, 10, 100, 100) == pytest.approx(0.2)


def test_this_routers_frees_are_told_soonest_first_and_sum_to_what_it_holds() -> None:
    """What a peer is told (``frees``): when each request's blocks come free, a shared prompt
    block with the last of its holders; merged to at most ``max_entries`` at the later time."""
    clock = Clock()
    room = _room(clock, decode=0.01)
    room.add("r0", "late", [1, 2, 3], 5, 50, 0.0)  # ends at 0.5
    room.add("r0", "early", [1, 2], 4, 10, 0.0)  # ends at 0.1: blocks 1, 2 still held
    room.add("r0", "mid", [9], 2, 30, 0.0)  # ends at 0.3
    assert room.frees("r0") == [
        (4, pytest.approx(0.1)),
        (3, pytest.approx(0.3)),
        (8, pytest.approx(0.5)),
    ]
    assert sum(n for n, _ in room.frees("r0")) == room.held_blocks("r0") == 15
    assert room.frees("r0", max_entries=2) == [(7, pytest.approx(0.3)), (8, pytest.approx(0.5))]
    assert room.frees("r1") == []


def test_peers_shared_ends_free_their_blocks_when_the_peers_said() -> None:
    """A peer that says when its requests end (``peer_frees``) is taken at its word, as this
    router's own requests are; only holdings without ends are spread over one answer."""
    clock = Clock()
    room = _room(clock, decode=0.01)  # an answer of 10 tokens: 0.1 s
    now = clock.now
    frees = [(now + 0.05, 30), (now + 0.5, 70)]
    # a peer holds 100 (60 free): 80 need the first 30 the peer frees, at 0.05 s
    assert room.wait_s("r0", 80, 160, 100.0, now, 10, 100, 100, frees) == pytest.approx(0.05)
    # 100 need its second end, at 0.5 s, though the even spread would say 0.04 s
    assert room.wait_s("r0", 100, 160, 100.0, now, 10, 100, 100, frees) == pytest.approx(0.5)
    assert room.wait_s("r0", 100, 160, 100.0, now, 10, 100, 100) == pytest.approx(0.04)
    # this router's own end falls between the peer's: 30 free, 30 more at 0.05 s, 30 at 0.2 s
    room.add("r0", "a", (), 30, 20, 0.0)  # ends at 0.2
    assert room.wait_s("r0", 90, 160, 130.0, now, 10, 100, 100, frees) == pytest.approx(0.2)
    assert room.wait_s("r0", 91, 160, 130.0, now, 10, 100, 100, frees) == pytest.approx(0.5)
    # 40 of the peer's 100 have no end told: they free evenly over 0.1 s from now, so 80
    # (50 more than the 30 free) need this router's end at 0.2 s too; never before it
    told = [(now + 0.5, 60)]
    assert room.wait_s("r0", 70, 160, 130.0, now, 10, 100, 100, told) == pytest.approx(0.1)
    assert room.wait_s("r0", 80, 160, 130.0, now, 10, 100, 100, told) == pytest.approx(0.2)


def test_a_request_that_ended_while_the_page_was_read_is_nobodys() -> None:
    """A metrics page shows one moment between its question and its answer. A request that
    ended in between may still be on the page: read at the answer's time alone, its blocks
    were someone else's until the next scrape, and a replica with room looked full (found by
    the end-to-end test, whose second request came 40 ms after the first ended)."""
    clock = Clock()
    room = _room(clock, decode=0.01)
    room.add("r0", "prime", list(range(21)), 1, 2, 0.0)  # 22 blocks
    asked = clock.now + 0.01
    clock.now += 0.02
    room.ended("r0", "prime")
    clock.now += 0.01
    answered = clock.now  # the page still shows the prime's 22 blocks in use
    assert room.wait_s("r0", 34, 40, 22.0, answered, 200, scrape_sent_at=asked) == 0.0
    assert room.wait_s("r0", 34, 40, 22.0, answered, 200) > 0  # read at the answer alone
    # the most held in the window counts, not more: 10 blocks of someone else's stay
    assert room.wait_s("r0", 30, 40, 32.0, answered, 200, scrape_sent_at=asked) == 0.0
    assert room.wait_s("r0", 31, 40, 32.0, answered, 200, scrape_sent_at=asked) > 0
