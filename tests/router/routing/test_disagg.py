"""The P/D decider (router/routing/disagg.py) on hand-made decisions: when the prefill leg
is skipped and why, how the prefill pool is ranked (cost, zone), and which requests never
split. The two-leg driver over simulated replicas is tests/router/serving/test_disagg.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvroute.indexer.tiers import Tier
from kvroute.router.config import CostSettings, DisaggSettings, ReplicaConfig
from kvroute.router.fleet.replicas import Replica
from kvroute.router.routing.disagg import Disaggregation, PdPlan, decode_only_reason, pools
from kvroute.router.routing.policies import ReplicaView
from kvroute.router.routing.prefill_backlog import PrefillBacklog
from kvroute.router.routing.router import Decision
from kvroute.router.tokens.requests import ParsedRequest

_GPU = Tier.GPU.label()


def _replica(name: str, role: str, zone: str | None = None, pending: float = 0.0) -> Replica:
    r = Replica(ReplicaConfig(url=f"http://{name}:8000", name=name, role=role, zone=zone))
    r.healthy = True
    r.running = pending
    return r


def _decision(prompt: int, replicas: list[tuple[Replica, int]]) -> Decision:
    """A decision over ``replicas`` (each with its cached tokens), in the given order."""
    views = []
    for r, cached in replicas:
        view = ReplicaView(name=r.name, pending=r.pending, running=r.running)
        view.match_tokens = view.predicted_cached_tokens = cached
        view.tokens_by_tier = {_GPU: cached} if cached else {}
        views.append(view)
    return Decision("kvroute", "prefix", [r for r, _ in replicas], views, prompt)


def _request(**body: Any) -> ParsedRequest:
    return ParsedRequest(kind="completion", body={"prompt": "x", **body}, model="m", stream=False)


def _plan(
    disagg: Disaggregation,
    decode: Decision,
    prefill: list[tuple[Replica, int]],
    req: ParsedRequest | None = None,
) -> tuple[PdPlan, list[int]]:
    calls: list[int] = []

    async def rank(pool: list[Replica]) -> Decision:
        calls.append(len(pool))
        return _decision(decode.prompt_tokens or 0, prefill)

    plan = asyncio.run(disagg.decide(decode, req or _request(), [r for r, _ in prefill], rank))
    return plan, calls


def _backlog() -> PrefillBacklog:
    """A backlog whose clock stands still: the work sent is all there when the decider asks
    (a real clock drains it by however long the test took to get there)."""
    return PrefillBacklog(clock=lambda: 1000.0)


def _disagg(backlog: PrefillBacklog | None = None, **kw: Any) -> Disaggregation:
    backlog = _backlog() if backlog is None else backlog
    return Disaggregation(DisaggSettings(**kw), CostSettings(learn_queue_delay=False), backlog)


def _sent(backlog: PrefillBacklog, replica: Replica, *works: float) -> None:
    """This router sent ``replica`` prefills of these works (seconds), not yet done."""
    for i, work in enumerate(works):
        backlog.add(replica.name, (replica.name, i), work)
    replica.running += len(works)


# The cost model's default prefill rate (1e-4 s/token): a 4,000-token prompt is 0.4 s.
WORK_4000 = 0.4
# The decider choosing between decode only and a split, as before whole_on_prefill.
TWO_WAY: dict[str, Any] = {"whole_on_prefill": False}
# The third choice on: the whole request on a prefill replica.
THREE_WAY: dict[str, Any] = {"whole_on_prefill": True}


def test_running_decodes_are_no_queue_for_a_new_prompt_on_a_decode_replica() -> None:
    """vLLM's scheduler runs a new prompt at once beside the running decodes: decode-only
    costs the prompt's work and the stall it gives them, never a queue of them."""
    disagg = _disagg(skip_tokens=64, decode_stall_weight=0.0)
    d = _replica("d0", "decode", pending=4)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert plan.decode_only_s == pytest.approx(WORK_4000)
    assert (plan.decoding, plan.decode_stall_s) == (4.0, 0.0)
    assert (plan.split, plan.reason) == (False, "cheaper_on_decode")


def test_the_stall_of_each_decoding_request_is_priced_at_the_configured_weight() -> None:
    """The trade made explicit: the same request splits when a second of stall to each of
    the 2 decodes costs a second of TTFT, and stays on decode when it costs a tenth."""
    for weight, split in ((1.0, True), (0.1, False)):
        backlog = _backlog()
        p = _replica("p0", "prefill")
        _sent(backlog, p, 0.6)
        disagg = _disagg(backlog, skip_tokens=64, decode_stall_weight=weight, **TWO_WAY)
        d = _replica("d0", "decode", pending=2)
        plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(p, 0)])
        assert plan.decode_stall_s == pytest.approx(weight * WORK_4000 * 2)
        assert plan.decode_only_s == pytest.approx(WORK_4000 * (1 + 2 * weight))
        assert plan.split_s == pytest.approx(0.6 + WORK_4000 + 4000 * 1e-5 + 0.005, rel=1e-3)
        assert plan.split is split


def test_a_decode_replicas_own_prefills_are_its_wait() -> None:
    backlog = _backlog()
    d = _replica("d0", "decode")
    _sent(backlog, d, 1.0)  # a long prompt computing there: nothing decoding yet
    disagg = _disagg(backlog, skip_tokens=64, **TWO_WAY)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert plan.decoding == 0.0
    assert plan.decode_only_s == pytest.approx(1.0 + WORK_4000, rel=1e-3)
    # The decode leg waits only for what is left of it after the prefill leg and the pull.
    assert plan.split_s == pytest.approx(1.0 + 0.005, rel=1e-3)
    assert plan.split


def test_the_prefill_replica_with_less_work_ahead_wins_not_the_one_with_fewer_requests() -> None:
    """One long prompt ahead (0.75 s) waits longer than three short ones (30 ms): the wait
    is the work ahead, and the prefills ahead are not slowed by this one (no delay to
    others priced on a prefill replica)."""
    backlog = _backlog()
    long_ahead, short_ahead = _replica("p0", "prefill"), _replica("p1", "prefill")
    _sent(backlog, long_ahead, 0.75)
    _sent(backlog, short_ahead, 0.01, 0.01, 0.01)
    disagg = _disagg(backlog, skip_tokens=64, **TWO_WAY)
    d = _replica("d0", "decode", pending=6)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(long_ahead, 0), (short_ahead, 0)])
    assert [r.name for r in plan.prefill] == ["p1", "p0"]
    assert plan.split_s == pytest.approx(0.03 + WORK_4000 + 4000 * 1e-5 + 0.005, rel=1e-2)


def test_a_short_uncached_part_stays_on_decode_without_asking_the_prefill_pool() -> None:
    disagg = _disagg(skip_tokens=256)
    d = _replica("d0", "decode")
    plan, calls = _plan(disagg, _decision(200, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert (plan.split, plan.reason, plan.uncached_on_decode, calls) == (
        False,
        "small_uncached",
        200,
        [],
    )
    assert disagg.counters.decisions["small_uncached"] == 1


def test_a_returning_user_whose_history_decode_holds_skips_the_prefill() -> None:
    disagg = _disagg(skip_tokens=64, skip_fraction=0.1)
    d = _replica("d0", "decode", pending=8)  # even a busy decode replica: 300 of 4000 tokens
    plan, _ = _plan(disagg, _decision(4000, [(d, 3700)]), [(_replica("p0", "prefill"), 0)])
    assert (plan.split, plan.reason, plan.uncached_on_decode) == (False, "small_fraction", 300)


def test_a_long_new_prompt_on_a_busy_decode_replica_splits_to_the_cheapest_prefill() -> None:
    disagg = _disagg(skip_tokens=64, **TWO_WAY)
    d = _replica("d0", "decode", pending=6)
    busy, idle = _replica("p0", "prefill", pending=12), _replica("p1", "prefill")
    plan, calls = _plan(disagg, _decision(4000, [(d, 0)]), [(busy, 0), (idle, 0)])
    assert plan.split and plan.reason == "split"
    assert [r.name for r in plan.prefill] == ["p1", "p0"]
    assert plan.split_s is not None and plan.decode_only_s is not None
    assert plan.split_s < plan.decode_only_s
    assert calls == [2]
    shown = plan.to_dict()
    assert (shown["decode"], shown["prefill"], shown["split"]) == ("d0", "p1", True)
    assert {v["name"] for v in shown["prefill_replicas"]} == {"p0", "p1"}


def test_a_prefill_replica_holding_the_prefix_is_cheaper_than_an_idle_one() -> None:
    disagg = _disagg(skip_tokens=64)
    d = _replica("d0", "decode", pending=6)
    holder, other = _replica("p0", "prefill", pending=1), _replica("p1", "prefill")
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(other, 0), (holder, 3000)])
    assert plan.prefill[0].name == "p0"


def test_an_idle_decode_replica_or_a_loaded_prefill_pool_recomputes_on_decode() -> None:
    disagg = _disagg(skip_tokens=64)
    idle = _replica("d0", "decode")
    plan, _ = _plan(disagg, _decision(4000, [(idle, 0)]), [(_replica("p0", "prefill"), 0)])
    assert (plan.split, plan.reason, plan.prefill) == (False, "cheaper_on_decode", [])
    busy_decode = _replica("d1", "decode", pending=4)
    swamped = _replica("p0", "prefill", pending=60)
    plan, _ = _plan(disagg, _decision(4000, [(busy_decode, 0)]), [(swamped, 0)])
    assert (plan.split, plan.reason) == (False, "cheaper_on_decode")


def test_a_prefill_replica_in_the_decode_replicas_zone_is_preferred_within_the_slack() -> None:
    disagg = _disagg(skip_tokens=64, zone_slack=0.25, **TWO_WAY)
    d = _replica("d0", "decode", zone="z1", pending=6)
    far, near = _replica("p0", "prefill", zone="z2"), _replica("p1", "prefill", zone="z1")
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(far, 0), (near, 0)])
    assert [r.name for r in plan.prefill] == ["p1", "p0"]
    loaded_near = _replica("p1", "prefill", zone="z1", pending=30)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(far, 0), (loaded_near, 0)])
    assert plan.prefill[0].name == "p0"


@pytest.mark.parametrize(
    "body",
    [{"n": 2}, {"echo": True}, {"prompt_logprobs": 1}, {"kv_transfer_params": {"x": 1}}],
)
def test_requests_vllm_cannot_split_stay_on_one_replica(body: dict[str, Any]) -> None:
    assert decode_only_reason(_request(**body)) == "single_replica_request"
    disagg = _disagg(mode="always")
    d = _replica("d0", "decode", pending=6)
    plan, calls = _plan(
        disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)], _request(**body)
    )
    assert (plan.split, plan.reason, calls) == (False, "single_replica_request", [])


def test_a_batch_of_prompts_is_one_replicas_work() -> None:
    req = ParsedRequest(kind="completion", body={}, model="m", stream=False, batch=["a", "b"])
    assert decode_only_reason(req) == "single_replica_request"
    assert decode_only_reason(_request(n=1, echo=False)) is None


def test_modes_always_and_never() -> None:
    d = _replica("d0", "decode")
    p = _replica("p0", "prefill")
    plan, _ = _plan(_disagg(mode="always"), _decision(100, [(d, 90)]), [(p, 0)])
    assert (plan.split, plan.reason, [r.name for r in plan.prefill]) == (
        True,
        "split_always",
        ["p0"],
    )
    plan, calls = _plan(_disagg(mode="never"), _decision(4000, [(d, 0)]), [(p, 0)])
    assert (plan.split, plan.reason, calls) == (False, "mode_never", [])


def test_without_a_prefill_pool_or_token_ids() -> None:
    disagg = _disagg()
    d = _replica("d0", "decode", pending=6)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [])
    assert plan.reason == "no_prefill_pool"
    plan, _ = _plan(disagg, _decision(None, [(d, 0)]), [(_replica("p0", "prefill"), 0)])  # type: ignore[arg-type]
    assert (plan.split, plan.reason) == (True, "split_unmeasured")


def test_record_false_leaves_the_counters_alone() -> None:
    disagg = _disagg()
    d = _replica("d0", "decode")

    async def rank(pool: list[Replica]) -> Decision:
        return _decision(100, [(r, 0) for r in pool])

    asyncio.run(disagg.decide(_decision(100, [(d, 0)]), _request(), [], rank, record=False))
    assert sum(disagg.counters.decisions.values()) == 0
    stats = disagg.counters.to_dict()
    assert stats["bypass_rate"] is None and stats["split"] == 0


def test_pools_keep_whole_requests_off_the_prefill_pool_unless_nothing_else_is_left() -> None:
    p, d, a = _replica("p", "prefill"), _replica("d", "decode"), _replica("a", "both")
    assert pools([p, d, a]) == ([d, a], [p])
    assert pools([p]) == ([p], [])


def test_the_choice_is_not_made_by_the_noise_of_learned_rates() -> None:
    """Both idle: decode-only is cheaper by the pull and the split's overhead, though the
    decode replica's learned rate came out 40% above the prefill replica's borrowed one
    (the same hardware: the work is priced at the configured rate on both)."""
    disagg = _disagg(skip_tokens=64)
    decode = _decision(4000, [(_replica("d0", "decode"), 0)])
    decode.views[0].prefill_s_per_token = 1.4e-4
    plan, _ = _plan(disagg, decode, [(_replica("p0", "prefill"), 0)])
    assert plan.decode_only_s == pytest.approx(WORK_4000)
    assert (plan.split, plan.reason) == (False, "cheaper_on_decode")


def test_a_decode_leg_on_its_way_is_delayed_by_a_prompt_computed_before_it_lands() -> None:
    """A split request's decode leg is not in the decode replica's pending while its
    prefill leg runs; a long prompt put there meanwhile delays the leg's first token by
    what is left of the prompt's work when it lands, priced one for one. A leg due after
    the prompt is done is not delayed."""
    backlog = _backlog()
    d = _replica("d0", "decode")
    disagg = _disagg(backlog, skip_tokens=64, **TWO_WAY)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert (plan.split, plan.incoming_legs) == (False, 0)
    backlog.expect("d0", "late", 1.0)  # its prefill answers in 1 s: the prompt is done
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert (plan.split, plan.incoming_legs) == (False, 1)
    assert plan.decode_only_s == pytest.approx(WORK_4000)
    backlog.expect("d0", "due", 0.1)  # lands 0.1 s in: waits the remaining 0.3 s
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(_replica("p0", "prefill"), 0)])
    assert plan.incoming_legs == 2
    assert plan.decode_only_s == pytest.approx(WORK_4000 + 0.3, abs=1e-3)
    assert plan.split
    backlog.arrived("d0", "due")
    backlog.arrived("d0", "late")
    assert backlog.incoming("d0") == []


def test_decodes_that_ended_since_the_last_scrape_are_not_stalled() -> None:
    """The gauges said 4 running; this router saw 3 of them end since: 1 decode is left to
    stall (Replica.pending_fresh), not 4."""
    disagg = _disagg(skip_tokens=64)
    d = _replica("d0", "decode", pending=4)
    d.ended_since_scrape = 3
    decode = _decision(4000, [(d, 0)])
    decode.views[0].pending_now = d.pending_fresh
    plan, _ = _plan(disagg, decode, [(_replica("p0", "prefill"), 0)])
    assert plan.decoding == 1.0
    assert plan.decode_stall_s == pytest.approx(WORK_4000)


def _serving_whole(backlog: PrefillBacklog, replica: Replica, n: int) -> None:
    """This router sent ``replica`` ``n`` whole requests, each past its prefill (reported
    done), now decoding there."""
    first = backlog.decoding(replica.name)
    for i in range(first, first + n):
        key = (replica.name, "whole", i)
        backlog.add(replica.name, key, 0.1)
        backlog.serving(replica.name, key)
        backlog.done(replica.name, key)
    replica.running += n


def test_a_long_prompt_is_served_whole_on_an_idle_prefill_replica() -> None:
    """The decode replica has 6 decodes to stall (0.4 s each: 2.8 s decode only); a split
    costs the idle prefill replica's 0.4 s plus the pull and the second leg; the same
    replica serving the whole request costs 0.4 s, and vLLM serves it as an ordinary
    request: the cheapest of the three."""
    disagg = _disagg(skip_tokens=64, **THREE_WAY)
    d = _replica("d0", "decode", pending=6)
    p = _replica("p0", "prefill")
    plan, calls = _plan(disagg, _decision(4000, [(d, 0)]), [(p, 0)])
    assert (plan.split, plan.on_prefill, plan.reason) == (False, True, "whole_on_prefill")
    assert [r.name for r in plan.prefill] == ["p0"] and calls == [1]
    assert plan.on_prefill_s == pytest.approx(WORK_4000)
    assert plan.decode_only_s == pytest.approx(WORK_4000 * 7)
    assert plan.split_s == pytest.approx(WORK_4000 + 4000 * 1e-5 + 0.005)
    assert disagg.counters.decisions["whole_on_prefill"] == 1
    stats = disagg.counters.to_dict()
    assert (stats["on_prefill"], stats["split"], stats["bypassed"]) == (1, 0, 0)
    shown = plan.to_dict()
    assert (shown["on_prefill"], shown["reason"], shown["prefill"]) == (
        True,
        "whole_on_prefill",
        "p0",
    )
    assert shown["on_prefill_s"] == pytest.approx(WORK_4000)


def test_the_choice_off_or_mode_always_never_serves_whole_on_prefill() -> None:
    d = _replica("d0", "decode", pending=6)
    p = _replica("p0", "prefill")
    plan, _ = _plan(_disagg(skip_tokens=64, **TWO_WAY), _decision(4000, [(d, 0)]), [(p, 0)])
    assert (plan.split, plan.on_prefill, plan.reason, plan.on_prefill_s) == (
        True,
        False,
        "split",
        None,
    )
    plan, _ = _plan(_disagg(mode="always", **THREE_WAY), _decision(4000, [(d, 0)]), [(p, 0)])
    assert (plan.split, plan.on_prefill, plan.reason) == (True, False, "split_always")


def test_an_idle_decode_replica_still_computes_the_prompt_itself() -> None:
    """Decode only and whole on an idle prefill replica cost the same 0.4 s: the tie stays
    on the decode replica, where the conversation's KV lives."""
    disagg = _disagg(skip_tokens=64, **THREE_WAY)
    plan, _ = _plan(
        disagg, _decision(4000, [(_replica("d0", "decode"), 0)]), [(_replica("p0", "prefill"), 0)]
    )
    assert plan.on_prefill_s == pytest.approx(plan.decode_only_s)
    assert (plan.split, plan.on_prefill, plan.reason) == (False, False, "cheaper_on_decode")


def test_whole_requests_decoding_on_a_prefill_replica_are_stalled_by_each_prefill_there() -> None:
    """p0 decodes 3 whole requests and has no prefill queued; p1 has 0.5 s of prefill
    queued. A prefill on p0 (a split's leg or a whole request) stalls its 3 decodes: 0.4 s
    + 3 x 0.4 s = 1.6 s, dearer than p1's 0.5 + 0.4 s. Its decodes are no queue either:
    its gauges' 3 requests are not priced as a peer router's prefills."""
    backlog = _backlog()
    p0, p1 = _replica("p0", "prefill"), _replica("p1", "prefill")
    _serving_whole(backlog, p0, 3)
    _sent(backlog, p1, 0.5)
    assert (backlog.decoding("p0"), backlog.decoding("p1")) == (3, 0)
    disagg = _disagg(backlog, skip_tokens=64, **THREE_WAY)
    d = _replica("d0", "decode", pending=6)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(p0, 0), (p1, 0)])
    assert [r.name for r in plan.prefill] == ["p1"]
    assert plan.reason == "whole_on_prefill"
    assert plan.on_prefill_s == pytest.approx(0.5 + WORK_4000, rel=1e-2)
    assert plan.decoding_on_prefill == {"p0": 3}
    # Only p0 left: both of its choices carry the stall of its 3 decodes.
    plan, _ = _plan(
        _disagg(backlog, skip_tokens=64, **THREE_WAY), _decision(4000, [(d, 0)]), [(p0, 0)]
    )
    assert plan.on_prefill_s == pytest.approx(WORK_4000 * 4)
    assert plan.split_s == pytest.approx(WORK_4000 * 4 + 4000 * 1e-5 + 0.005)
    # d0's 6 decodes cost 2.8 s decode only: p0 still wins, at 1.6 s.
    assert plan.reason == "whole_on_prefill"
    # With 6 decoding on p0, decode only (2.8 s) is cheaper than p0's 0.4 + 2.4 s.
    _serving_whole(backlog, p0, 3)
    plan, _ = _plan(
        _disagg(backlog, skip_tokens=64, **THREE_WAY), _decision(4000, [(d, 0)]), [(p0, 0)]
    )
    assert (plan.reason, plan.decoding_on_prefill) == ("cheaper_on_decode", {"p0": 6})
    backlog.ended("p0", ("p0", "whole", 0))
    assert backlog.decoding("p0") == 5


def test_a_split_leg_on_a_prefill_replica_decoding_whole_requests_prices_their_stall() -> None:
    """With the third choice off the split to p0 still carries the stall of the 2 whole
    requests decoding there (the old split estimate priced a prefill replica as never
    decoding): 0.4 + 2 x 0.4 s, then the pull and the second leg."""
    backlog = _backlog()
    p0 = _replica("p0", "prefill")
    _serving_whole(backlog, p0, 2)
    disagg = _disagg(backlog, skip_tokens=64, **TWO_WAY)
    d = _replica("d0", "decode", pending=6)
    plan, _ = _plan(disagg, _decision(4000, [(d, 0)]), [(p0, 0)])
    assert plan.split_s == pytest.approx(WORK_4000 * 3 + 4000 * 1e-5 + 0.005)
    assert plan.split and plan.reason == "split"


def test_a_small_prompt_behind_a_queued_prefill_goes_whole_to_an_idle_prefill_replica() -> None:
    """200 uncached tokens are too few to split (skip_tokens), but not to move: the decode
    replica has a 1 s prompt queued ahead (0.02 + 1 s decode only), the prefill replica
    none (0.02 s whole there). Never split, whichever is cheaper; with no queue on the
    decode replica the prefill pool is not even asked."""
    backlog = _backlog()
    d = _replica("d0", "decode")
    _sent(backlog, d, 1.0)
    p = _replica("p0", "prefill")
    plan, calls = _plan(
        _disagg(backlog, skip_tokens=256, **THREE_WAY), _decision(200, [(d, 0)]), [(p, 0)]
    )
    assert (plan.split, plan.on_prefill, plan.reason, calls) == (
        False,
        True,
        "whole_on_prefill",
        [1],
    )
    assert plan.on_prefill_s == pytest.approx(0.02)
    # The prefill replica's queue is longer: decode only, for the same reason as before.
    busy = _backlog()
    _sent(busy, d, 1.0)
    _sent(busy, p, 2.0)
    plan, _ = _plan(_disagg(busy, skip_tokens=256, **THREE_WAY), _decision(200, [(d, 0)]), [(p, 0)])
    assert (plan.split, plan.on_prefill, plan.reason, plan.prefill) == (
        False,
        False,
        "small_uncached",
        [],
    )
    # The third choice off: decode only, the prefill pool not asked.
    plan, calls = _plan(
        _disagg(backlog, skip_tokens=256, **TWO_WAY), _decision(200, [(d, 0)]), [(p, 0)]
    )
    assert (plan.reason, calls) == ("small_uncached", [])


def test_a_caller_that_cannot_send_it_there_is_not_offered_whole_on_prefill() -> None:
    """The endpoint picker's destination is its decode pick (router/epp/disagg.py): the
    request the proxy would serve whole on the prefill replica is split there instead."""
    disagg = _disagg(skip_tokens=64, **THREE_WAY)
    d = _replica("d0", "decode", pending=6)
    p = _replica("p0", "prefill")

    async def rank(pool: list[Replica]) -> Decision:
        return _decision(4000, [(p, 0)])

    plan = asyncio.run(disagg.decide(_decision(4000, [(d, 0)]), _request(), [p], rank))
    assert plan.reason == "whole_on_prefill"
    plan = asyncio.run(
        disagg.decide(_decision(4000, [(d, 0)]), _request(), [p], rank, on_prefill=False)
    )
    assert (plan.split, plan.on_prefill, plan.reason, plan.on_prefill_s) == (
        True,
        False,
        "split",
        None,
    )
