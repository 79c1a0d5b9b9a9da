"""The default cost policy and the comparison policies, on synthetic replica views."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvroute.router.config import CostSettings, RouterSettings
from kvroute.router.routing.policies import (
    POLICIES,
    ApproxPrefixPolicy,
    KvroutePolicy,
    LeastLoadedPolicy,
    ReplicaView,
    RoundRobinPolicy,
    RouteContext,
    SessionPolicy,
    make_policy,
)
from kvroute.router.routing.router import home_affinity, predicted_cached_tokens


def _ctx(*views: ReplicaView, prompt: int = 4000, session: str | None = None) -> RouteContext:
    return RouteContext(list(views), prompt, b"affinity", session)


def _gpu(name: str, tokens: int, **kw: object) -> ReplicaView:
    return ReplicaView(
        name,
        match_tokens=tokens,
        tokens_by_tier={"GPU": tokens} if tokens else {},
        predicted_cached_tokens=tokens,
        freshness="live",
        **kw,
    )


def test_predicted_cached_tokens_follows_vllm_last_token_rule() -> None:
    assert predicted_cached_tokens(64, 64, 16) == 48  # full hit recomputes the last token
    assert predicted_cached_tokens(64, 65, 16) == 64
    assert predicted_cached_tokens(32, 100, 16) == 32
    assert predicted_cached_tokens(16, 1, 16) == 0
    assert predicted_cached_tokens(0, 0, 16) == 0


def test_prefix_wins_when_load_is_equal() -> None:
    ranking = KvroutePolicy(CostSettings()).rank(_ctx(_gpu("a", 0), _gpu("b", 3200)))
    assert [v.name for v in ranking.views] == ["b", "a"] and ranking.reason == "prefix"
    assert ranking.estimates["b"].est_ttft_s == pytest.approx(1e-4 * 800)


def test_rank_returns_its_estimates_and_leaves_the_views_alone() -> None:
    """The policy's costs come back in the ranking; the router records them on its views."""
    views = [_gpu("a", 0, pending=2), _gpu("b", 3200)]
    ranking = KvroutePolicy(CostSettings()).rank(_ctx(*views))
    assert [v.name for v in ranking.views] == ["b", "a"]
    assert all(v.cost_s is None and v.est_ttft_s is None for v in views)
    for view in ranking.views:
        estimate = ranking.estimates[view.name]
        assert estimate.est_ttft_s == estimate.queue_s + estimate.compute_s + estimate.load_s
        assert estimate.cost_s == estimate.est_ttft_s + estimate.delay_to_others_s
        view.record(estimate)
        assert (view.est_ttft_s, view.cost_s, view.delay_to_others_s) == (
            estimate.est_ttft_s,
            estimate.cost_s,
            estimate.delay_to_others_s,
        )
        assert (view.queue_s, view.compute_s, view.load_s) == (
            estimate.queue_s,
            estimate.compute_s,
            estimate.load_s,
        )
    # A policy that does not estimate returns no estimates.
    assert LeastLoadedPolicy().rank(_ctx(*views)).estimates == {}


def test_tiers_cost_more_than_gpu_less_than_recompute() -> None:
    policy = KvroutePolicy(CostSettings())
    views = [
        ReplicaView("gpu", match_tokens=3200, tokens_by_tier={"GPU": 3200}, freshness="live"),
        ReplicaView("cpu", match_tokens=3200, tokens_by_tier={"CPU": 3200}, freshness="live"),
        ReplicaView("disk", match_tokens=3200, tokens_by_tier={"STORAGE": 3200}, freshness="live"),
        ReplicaView("none", freshness="live"),
    ]
    ranking = policy.rank(_ctx(*views))
    assert [v.name for v in ranking.views] == ["gpu", "cpu", "disk", "none"]
    assert ranking.estimates["cpu"].load_s == pytest.approx(2e-5 * 3200)


def test_stale_matches_are_discounted() -> None:
    policy = KvroutePolicy(CostSettings())
    stale = _gpu("stale", 3200)
    stale.freshness = "stale"
    live = _gpu("live", 2000)
    # 3200 * 0.25 believed < 2000: the live replica's shorter match wins.
    assert policy.rank(_ctx(stale, live)).first.name == "live"
    connecting = _gpu("connecting", 3200)
    connecting.freshness = "connecting"
    estimates = policy.rank(_ctx(connecting, _gpu("idle", 0))).estimates
    assert estimates["connecting"].est_ttft_s == estimates["idle"].est_ttft_s  # a tie


def test_a_rebuilding_feed_is_believed_in_full() -> None:
    """A router that joined a replica whose history is older than the replay buffer stays
    ``rebuilding``: its entries are all from live events (possibly too few, never false).
    Discounting them made a late-joining router scatter returning users (benchmarks.md)."""
    policy = KvroutePolicy(CostSettings())
    rebuilding = _gpu("rebuilding", 3200)
    rebuilding.freshness = "rebuilding"
    estimates = policy.rank(_ctx(rebuilding, _gpu("live", 3200))).estimates
    assert estimates["rebuilding"].est_ttft_s == estimates["live"].est_ttft_s
    ranking = policy.rank(_ctx(rebuilding, _gpu("live", 2000)))
    assert ranking.first.name == "rebuilding" and ranking.reason == "prefix"


def test_hot_prefix_spills_before_the_queue_outweighs_the_saving() -> None:
    """Send a stream of requests sharing one prefix; every routed request adds to its
    replica's in-flight count. The holder must take more than its share, but not all."""
    policy = KvroutePolicy(CostSettings())
    pending = Counter[str]()
    for _ in range(200):
        views = [_gpu("hot", 3600, pending=pending["hot"])]
        # The others catch up through hints once a sibling lands there; model that too.
        views += [_gpu(n, 3600 if pending[n] else 0, pending=pending[n]) for n in ("b", "c", "d")]
        pending[policy.rank(_ctx(*views)).first.name] += 1
    assert pending["hot"] < 200 * 0.5
    assert all(pending[n] > 0 for n in ("b", "c", "d"))
    # And with a skewed load the queue term dominates: no pile-up on the only holder.
    ranking = policy.rank(_ctx(_gpu("hot", 3600, pending=40), _gpu("cold", 0, pending=0)))
    assert ranking.first.name == "cold" and ranking.reason == "spill"


def test_queue_term_is_superlinear() -> None:
    policy = KvroutePolicy(CostSettings())
    q = [policy.queue_delay(ReplicaView("x", pending=n)) for n in (1, 2, 4, 8, 16, 32)]
    steps = [b - a for a, b in itertools.pairwise(q)]
    assert all(b > 2 * a for a, b in itertools.pairwise(steps))


def test_waiting_and_kv_pressure_add_delay() -> None:
    policy = KvroutePolicy(CostSettings())
    base = policy.queue_delay(ReplicaView("x", pending=2))
    assert policy.queue_delay(ReplicaView("x", pending=2, waiting=2)) > base
    assert policy.queue_delay(ReplicaView("x", pending=2, kv_usage=0.99)) > base


def test_a_new_prefix_is_placed_by_bounded_load_rendezvous() -> None:
    """A new prefix (no home, no cache anywhere) goes to the first replica of its rendezvous
    order among the near-equals whose stored_rate is within (1 + placement_slack) x their
    mean; one over the load bound is never chosen, whatever its rate; a cached prefix is
    never given up for a quieter replica."""
    policy = KvroutePolicy(CostSettings(queue_s_per_request=0.1))
    # cost = 0.4 s prefill, plus 0.1 s and 0.4 s (the prefill it delays) per pending request.
    # b: 0.9 s vs a: 0.4 s is over the bound (0.6 s): a, though it stored far more lately.
    busy, quiet = _gpu("a", 0, pending=0, stored_rate=50.0), _gpu("b", 0, pending=1)
    ranking = policy.rank(_ctx(busy, quiet))
    assert ranking.first.name == "a" and ranking.reason == "load"
    roomy = KvroutePolicy(CostSettings(queue_s_per_request=0.1, home_slack=2.0))
    for i in range(16):  # both near-equals: every prefix avoids the one far above the mean
        ctx = RouteContext([busy, quiet], 4000, f"p{i}".encode())
        assert roomy.rank(ctx).first.name == "b"
    ranking = roomy.rank(_ctx(_gpu("a", 3600, stored_rate=90.0), _gpu("b", 0)))
    assert ranking.first.name == "a" and ranking.reason == "prefix"


def test_learned_rates_noise_does_not_undo_the_home_order_but_a_cache_hit_counts() -> None:
    """Two replicas of one kind whose learned prefill rates differ by a few percent (the
    noise of a few samples): a prefix's home is still honoured, and a new prefix is placed
    by the same rule as with equal rates, not onto the one that happens to look cheaper. A
    cached prefix on a fast replica (learned at a fifth of the prior) is still never given
    up for a home that holds nothing."""
    policy = KvroutePolicy(CostSettings())
    noisy = {"a": 0.96e-4, "b": 1.0e-4}

    def view(name: str, tokens: int = 0, rate: float | None = None) -> ReplicaView:
        return _gpu(name, tokens, prefill_s_per_token=noisy[name] if rate is None else rate)

    for home in ("a", "b"):
        ctx = RouteContext([view("a"), view("b")], 4000, b"affinity", home=home)
        assert policy.rank(ctx).first.name == home
    equal = KvroutePolicy(CostSettings())
    picks = Counter()
    for i in range(64):
        affinity = f"new-{i}".encode()
        same = [_gpu("a", 0), _gpu("b", 0)]
        want = equal.rank(RouteContext(same, 4000, affinity)).first.name
        got = policy.rank(RouteContext([view("a"), view("b")], 4000, affinity)).first.name
        assert got == want
        picks[got] += 1
    assert min(picks.values()) > 0  # spread over both, as with equal rates
    fast = {"a": 0.2e-4, "b": 0.2e-4}
    ctx = RouteContext(
        [view("a", 800, fast["a"]), view("b", 0, fast["b"])], 4000, b"affinity", home="b"
    )
    ranking = policy.rank(ctx)
    assert ranking.first.name == "a" and ranking.reason == "prefix"


def test_two_policies_with_the_same_view_place_alike_and_spread_by_hash() -> None:
    """Two independent policy objects (two routers) given the same views put every new
    prefix on the same replica, whatever order the candidates come in; with equal rates the
    prefixes spread over every replica (rendezvous), not all onto the cheapest."""
    names = ("a", "b", "c", "d")
    rates = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 2.5}

    def views(order: tuple[str, ...]) -> list[ReplicaView]:
        return [_gpu(n, 0, stored_rate=rates[n]) for n in order]

    one, two = KvroutePolicy(CostSettings()), KvroutePolicy(CostSettings())
    picks = []
    for i in range(200):
        affinity = f"user-{i}".encode()
        first = one.rank(RouteContext(views(names), 4000, affinity)).first.name
        for order in itertools.permutations(names):
            assert two.rank(RouteContext(views(order), 4000, affinity)).first.name == first
        picks.append(first)
    # Mean 2.125: a and d are over it and take nothing; b and c share all.
    counts = Counter(picks)
    assert set(counts) == {"b", "c"} and min(counts.values()) > 60, counts
    equal = Counter(
        one.rank(RouteContext([_gpu(n, 0) for n in names], 4000, f"g{i}".encode())).first.name
        for i in range(400)
    )
    assert set(equal) == set(names) and min(equal.values()) > 60, equal


def test_placing_prefixes_as_their_blocks_arrive_balances_the_homes() -> None:
    """The feedback the routers see: each new prefix's blocks land on the replica it went to
    (its stored_rate grows), so 32 prefix groups on 8 replicas end within one of 4 each;
    rendezvous alone would spread them like balls into bins."""
    policy = KvroutePolicy(CostSettings())
    names = [f"r{i}" for i in range(8)]
    stored = dict.fromkeys(names, 0.0)
    homes: Counter[str] = Counter()
    for g in range(32):
        views = [_gpu(n, 0, stored_rate=stored[n]) for n in names]
        chosen = policy.rank(RouteContext(views, 4000, f"group-{g}".encode())).first.name
        homes[chosen] += 1
        stored[chosen] += 250.0  # a 4,000-token prefix: 250 blocks of 16
    assert max(homes.values()) - min(homes.values()) <= 1, homes


def test_a_replica_leaving_moves_only_its_new_prefixes() -> None:
    """Removing a replica from the candidates changes the placement of only the prefixes
    that had been placed on it (rendezvous), at equal rates and loads."""
    policy = KvroutePolicy(CostSettings())
    names = [f"r{i}" for i in range(6)]

    def place(present: list[str]) -> dict[int, str]:
        return {
            i: policy.rank(
                RouteContext([_gpu(n, 0) for n in present], 4000, f"p{i}".encode())
            ).first.name
            for i in range(300)
        }

    before, after = place(names), place([n for n in names if n != "r2"])
    moved = {i for i in before if before[i] != after[i]}
    assert moved == {i for i, n in before.items() if n == "r2"} and moved


def _pick(
    policy: KvroutePolicy, pending: dict[str, int], home: str | None, cached: str | None = None
) -> tuple[str, str]:
    views = [_gpu(n, 3600 if n == cached else 0, pending=p) for n, p in pending.items()]
    ranking = policy.rank(RouteContext(views, 4000, b"doc-7", None, home))
    return ranking.first.name, ranking.reason


def test_an_evicted_prefix_goes_home_within_the_load_bound() -> None:
    """A prefix no replica holds any more goes back to its home unless the home costs more
    than (1 + home_slack) x the cheapest; then to the first near-equal of its consistent-hash
    order, the same one each time."""
    policy = KvroutePolicy(CostSettings(queue_s_per_request=0.1))
    # cost = 0.4 s prefill, plus 0.1 s and 0.4 s (the prefill it delays) per pending request.
    assert _pick(policy, {"a": 2, "b": 2, "c": 2, "d": 2}, "c") == ("c", "home")
    assert _pick(policy, {"a": 2, "b": 2, "c": 3, "d": 2}, "c") == ("c", "home")  # 2.0 vs 1.5 s
    second, reason = _pick(policy, {"a": 2, "b": 2, "c": 6, "d": 2}, "c")  # 4.1 s: too busy
    assert second != "c" and reason == "home"
    assert _pick(policy, {"a": 2, "b": 2, "c": 7, "d": 2}, "c")[0] == second
    # An idle replica makes the bound tight: 0.9 s vs 0.4 s is over it.
    assert _pick(policy, {"a": 0, "b": 1, "c": 1, "d": 1}, "c") == ("a", "home")
    # home_slack 0: the cheapest, home or not.
    cheapest = KvroutePolicy(CostSettings(queue_s_per_request=0.1, home_slack=0.0))
    assert _pick(cheapest, {"a": 2, "b": 2, "c": 3, "d": 2}, "c")[0] != "c"


def test_a_home_never_costs_a_cache_hit() -> None:
    """Near-equals do as little work as the cheapest: a cold home within the load bound does
    not take a request from the replica holding its prefix."""
    policy = KvroutePolicy(CostSettings(queue_s_per_request=0.1, home_slack=10.0))
    assert _pick(policy, {"a": 1, "b": 1, "c": 1}, "c", cached="a") == ("a", "prefix")
    assert _pick(policy, {"a": 3, "b": 1, "c": 1}, "c", cached="a") == ("a", "prefix")


def test_a_jammed_holder_spills_to_the_same_replica() -> None:
    """A hot prefix whose only holder (its home) is jammed spills to one stable replica,
    which then holds it too, rather than to whichever is least loaded at that moment."""
    policy = KvroutePolicy(CostSettings(queue_s_per_request=0.1))
    names = ("b", "c", "d", "e", "f")
    spills = set()
    for loads in itertools.product((2, 3), repeat=5):
        pending = {"a": 30} | dict(zip(names, loads, strict=True))
        chosen, reason = _pick(policy, pending, "a", cached="a")
        assert reason == "spill"
        spills.add(chosen)
    assert len(spills) == 1  # one more request there is within the load bound


def test_home_affinity_skips_what_most_replicas_hold() -> None:
    keys = list(range(100, 110))
    fallback = b"first tokens"
    # A system prompt of 4 blocks on every replica, a user's history on one: the key is the
    # first block after the system prompt, however far the history has grown or been evicted.
    turn1 = home_affinity(keys[:6], [4, 4, 4, 4], fallback)
    turn5 = home_affinity(keys, [9, 4, 4, 4], fallback)
    evicted = home_affinity(keys, [4, 4, 4, 0], fallback)
    assert turn1 == turn5 == evicted == (104).to_bytes(8, "little")
    # Nothing common: the first block. Everything common: the last full block.
    assert home_affinity(keys, [0, 0, 3, 9], fallback) == (100).to_bytes(8, "little")
    assert home_affinity(keys, [10, 10, 10], fallback) == (109).to_bytes(8, "little")
    # A majority, not any one replica: one replica's long match does not move the key.
    assert home_affinity(keys, [9, 9, 2, 2, 2], fallback) == (102).to_bytes(8, "little")
    # Shorter than a block, or no views: the fallback / the first block.
    assert home_affinity([], [3], fallback) == fallback
    assert home_affinity(keys, [], fallback) == (100).to_bytes(8, "little")


def test_hint_counts_as_gpu_blocks() -> None:
    policy = KvroutePolicy(CostSettings())
    hinted = ReplicaView("h", hint_tokens=3200, predicted_cached_tokens=3200, pending=1)
    ranking = policy.rank(_ctx(hinted, ReplicaView("idle")))
    assert ranking.first.name == "h" and ranking.reason == "hint"


def test_round_robin_least_loaded_session() -> None:
    rr = RoundRobinPolicy()
    views = [ReplicaView("a"), ReplicaView("b"), ReplicaView("c")]
    firsts = [rr.rank(_ctx(*views)).first.name for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    ll = LeastLoadedPolicy()
    assert ll.rank(_ctx(ReplicaView("a", pending=5), ReplicaView("b", pending=2))).first.name == "b"
    sp = SessionPolicy()
    chosen = {sp.rank(_ctx(*views, session="user-1")).first.name for _ in range(5)}
    assert len(chosen) == 1
    spread = {sp.rank(_ctx(*views, session=f"user-{i}")).first.name for i in range(50)}
    assert spread == {"a", "b", "c"}
    assert sp.rank(_ctx(*views)).reason == "session_new"


def test_approx_prefix_policy() -> None:
    ap = ApproxPrefixPolicy(match_threshold=0.5, balance_abs=32, balance_rel=1.5)
    ranking = ap.rank(_ctx(ReplicaView("a", approx_tokens=3000), ReplicaView("b"), prompt=4000))
    assert ranking.first.name == "a" and ranking.reason == "approx_match"
    ranking = ap.rank(
        _ctx(
            ReplicaView("a", approx_tokens=1000, pending=3),
            ReplicaView("b", pending=1),
            prompt=4000,
        )
    )
    assert ranking.first.name == "b" and ranking.reason == "approx_load"
    ranking = ap.rank(
        _ctx(
            ReplicaView("a", approx_tokens=4000, pending=100),
            ReplicaView("b", pending=10),
            prompt=4000,
        )
    )
    assert ranking.first.name == "b" and ranking.reason == "approx_balance"


def test_make_policy_names() -> None:
    settings = RouterSettings()
    assert list(POLICIES) == ["round_robin", "least_loaded", "session", "approx_prefix", "kvroute"]
    for name, cls in POLICIES.items():
        policy = make_policy(name, settings)
        assert type(policy) is cls and policy.name == name
    with pytest.raises(ValueError):
        make_policy("random", settings)


def test_make_policy_configures_from_the_settings() -> None:
    settings = RouterSettings(cost=CostSettings(home_slack=0.5), approx_match_threshold=0.9)
    kvroute = make_policy("kvroute", settings)
    assert isinstance(kvroute, KvroutePolicy) and kvroute.cost is settings.cost
    approx = make_policy("approx_prefix", settings)
    assert isinstance(approx, ApproxPrefixPolicy) and approx.match_threshold == 0.9


def test_capability_flags_say_what_the_router_gathers() -> None:
    """What each policy reads decides what the router gathers for it (tokens, homes, its
    own routing history); nothing outside the policies compares their names."""
    flags = {
        name: (cls.needs_tokens, cls.uses_homes, cls.uses_routing_history)
        for name, cls in POLICIES.items()
    }
    assert flags == {
        "round_robin": (False, False, False),
        "least_loaded": (False, False, False),
        "session": (False, False, False),
        "approx_prefix": (True, False, True),
        "kvroute": (True, True, False),
    }


def test_learned_queue_delay_replaces_the_constant() -> None:
    policy = KvroutePolicy(CostSettings(queue_s_per_request=0.02, home_slack=0.0))
    fixed = policy.queue_delay(ReplicaView("x", pending=4))
    learned = policy.queue_delay(ReplicaView("x", pending=4, queue_s_per_request=0.5))
    assert learned == pytest.approx(fixed * 25)
    # A slow replica (learned) loses a request with no cache advantage to a fast one.
    ranking = policy.rank(
        _ctx(_gpu("slow", 0, pending=2, queue_s_per_request=0.5), _gpu("fast", 0, pending=3))
    )
    assert ranking.first.name == "fast"


def test_a_spill_is_charged_for_the_queue_it_joins() -> None:
    """A returning user's history on a replica with a somewhat longer queue: by its own
    TTFT alone the request would leave and recompute 4,000 tokens where three requests wait,
    slowing each of them by that prefill; counted, the holder keeps it. A queue far longer
    than the recompute still spills."""
    q = 0.3  # learned: each pending request costs 0.3 s here
    holder = _gpu("holder", 3900, pending=5, queue_s_per_request=q)
    other = _gpu("other", 0, pending=3, queue_s_per_request=q)
    own_only = KvroutePolicy(CostSettings(delay_to_others_weight=0.0))
    assert own_only.rank(_ctx(holder, other)).first.name == "other"
    counted = KvroutePolicy(CostSettings())
    ranking = counted.rank(_ctx(holder, other))
    assert ranking.first.name == "holder" and ranking.reason == "prefix"
    assert ranking.estimates["other"].delay_to_others_s == pytest.approx(1e-4 * 4000 * 3)
    assert ranking.estimates["holder"].delay_to_others_s == pytest.approx(1e-4 * 100 * 5)
    jammed = _gpu("holder", 3900, pending=16, queue_s_per_request=q)
    idle = _gpu("other", 0, pending=0, queue_s_per_request=q)
    ranking = counted.rank(_ctx(jammed, idle))
    assert ranking.first.name == "other" and ranking.reason == "spill"


def test_the_wait_for_device_room_is_priced_in_place_of_kv_pressure() -> None:
    """A holder whose device cache has no room for the request (kv_room.py) loses it to an
    idle replica once the wait outweighs recomputing; a short wait keeps it home; a known
    wait replaces the usage-based pressure term."""
    policy = KvroutePolicy(CostSettings())  # prefill 1e-4 s per token: 4000 tokens 0.4 s
    full = policy.queue_delay(ReplicaView("x", pending=1, kv_usage=0.99))
    assert policy.queue_delay(ReplicaView("x", pending=1, kv_usage=0.99, kv_wait_s=0.0)) < full
    assert policy.queue_delay(
        ReplicaView("x", pending=1, kv_usage=0.2, kv_wait_s=0.7)
    ) == pytest.approx(policy.queue_delay(ReplicaView("x", pending=1)) + 0.7)
    holder = _gpu("holder", 3200, pending=1, kv_wait_s=0.9)
    idle = _gpu("idle", 0, kv_wait_s=0.0)
    ranking = policy.rank(_ctx(holder, idle))
    assert ranking.views[0].name == "idle" and ranking.reason == "spill"
    holder = _gpu("holder", 3200, pending=1, kv_wait_s=0.05)
    assert policy.rank(_ctx(holder, idle)).views[0].name == "holder"
