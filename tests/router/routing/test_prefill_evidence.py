"""The replicas' own prefill counters as calibration samples (router/routing/prefill_evidence.py):
the differences between scrapes, their parsing from a vLLM-shaped /metrics page, and the rates
a router learns from them alone (non-streamed traffic gives it no first byte)."""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.config import CostSettings
from kvroute.router.fleet.replicas import parse_vllm_metrics, parse_vllm_metrics_by_engine
from kvroute.router.routing.prefill_evidence import PrefillEvidence
from tests.router.sim_fleet import make_fleet, prefill_only
from tests.waiting import wait_until


def _page(prefill_s: float, prefills: int, computed: int, host: int, disk: int) -> str:
    """A /metrics page as vLLM 0.32 writes these series (names and labels from
    vllm/v1/metrics/loggers.py: ``source`` values of PromptTokenStats.ALL_SOURCES and of
    CacheHitSource), for two engines of one server."""
    lines = []
    for engine, share in (("0", 0.75), ("1", 0.25)):
        labels = f'engine="{engine}",model_name="m"'
        lines += [
            f"vllm:request_prefill_time_seconds_sum{{{labels}}} {prefill_s * share}",
            f"vllm:request_prefill_time_seconds_count{{{labels}}} {prefills * share}",
            f'vllm:request_prefill_time_seconds_bucket{{{labels},le="+Inf"}} {prefills * share}',
            f'vllm:prompt_tokens_by_source_total{{{labels},source="local_compute"}} '
            f"{computed * share}",
            f'vllm:prompt_tokens_by_source_total{{{labels},source="local_cache_hit"}} 999',
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="device"}} 999',
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="host"}} {host * share}',
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="disk"}} {disk * share}',
            f'vllm:prompt_tokens_cached_by_source_total{{{labels},source="p2p"}} 999',
        ]
    return "\n".join(["# HELP ignored", *lines, "vllm:num_requests_running 3"])


def test_the_counters_are_parsed_per_engine_and_summed() -> None:
    page = _page(8.0, 40, 4000, 2000, 400)
    whole = parse_vllm_metrics(page)
    assert whole["prefill_s"] == 8.0 and whole["prefills"] == 40
    assert (whole["computed_tokens"], whole["host_tokens"], whole["disk_tokens"]) == (
        4000,
        2000,
        400,
    )
    assert whole["running"] == 3  # the gauges beside them, as before
    by_engine = parse_vllm_metrics_by_engine(page)
    assert by_engine["0"]["prefills"] == 30 and by_engine["1"]["host_tokens"] == 500


def test_a_sample_is_the_mean_of_the_requests_between_two_scrapes() -> None:
    evidence = PrefillEvidence(min_prefills=4, weight_per_request=0.5)
    scrape = parse_vllm_metrics
    assert evidence.sample("r0", scrape(_page(1.0, 2, 100, 0, 0))) is None  # the baseline
    # Three more prefills: too few, the baseline stays for the next scrape to add to.
    assert evidence.sample("r0", scrape(_page(2.5, 5, 400, 30, 0))) is None
    sample = evidence.sample("r0", scrape(_page(5.0, 10, 1100, 130, 50)))
    assert sample is not None
    assert sample.seconds == pytest.approx(0.5)  # 4.0 s over 8 prefills
    assert (sample.uncached, sample.cpu, sample.storage) == pytest.approx((125, 16.25, 6.25))
    assert sample.weight == pytest.approx(4.0)  # 8 requests at half an answer's weight
    assert evidence.samples == 1


def test_a_restarted_replica_starts_over_and_one_without_the_counters_gives_nothing() -> None:
    evidence = PrefillEvidence(min_prefills=1)
    scrape = parse_vllm_metrics
    evidence.sample("r0", scrape(_page(9.0, 90, 9000, 0, 0)))
    assert evidence.sample("r0", scrape(_page(0.2, 1, 100, 0, 0))) is None  # went backwards
    assert evidence.restarts == 1
    sample = evidence.sample("r0", scrape(_page(0.6, 3, 300, 0, 0)))
    assert sample is not None and sample.seconds == pytest.approx(0.2)
    assert evidence.sample("old", parse_vllm_metrics("vllm:num_requests_running 1")) is None
    assert evidence.sample("old", parse_vllm_metrics("vllm:num_requests_running 1")) is None
    evidence.forget("r0")
    assert evidence.sample("r0", scrape(_page(0.9, 4, 400, 0, 0))) is None  # a new baseline


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0, 10), st.integers(0, 6), st.integers(0, 900), st.integers(0, 300)),
        min_size=1,
        max_size=12,
    )
)
def test_the_samples_account_for_every_request_once(
    steps: list[tuple[float, int, int, int]],
) -> None:
    """Whatever the scrapes' spacing, the samples' requests (weight / weight_per_request) and
    their seconds add up to the counters' totals at the last sample taken, and fewer than
    ``min_prefills`` requests wait for the next one."""
    evidence = PrefillEvidence(min_prefills=3, weight_per_request=1.0)
    totals = [0.0, 0, 0, 0]
    evidence.sample("r", parse_vllm_metrics(_page(0.0, 0, 0, 0, 0)))
    requests = seconds = 0.0
    at_last = (0.0, 0)
    for dt, n, computed, host in steps:
        totals = [totals[0] + dt, totals[1] + n, totals[2] + computed, totals[3] + host]
        sample = evidence.sample("r", parse_vllm_metrics(_page(*totals, 0)))
        if sample is not None:
            requests += sample.weight
            seconds += sample.seconds * sample.weight
            at_last = (totals[0], totals[1])
    assert requests == pytest.approx(at_last[1]) and seconds == pytest.approx(at_last[0])
    assert 0 <= totals[1] - at_last[1] < 3


def test_a_router_learns_the_prefill_rate_from_non_streamed_answers(local_tokenizer) -> None:
    """The replicas (the simulator, whose /metrics has vLLM's prefill-time histogram and
    per-source counters) prefill at 2e-4 s per uncached token; the router's prior is 10x too
    low. Non-streamed requests only: no first byte, so no sample from the answers. The rate
    every replica is priced with still ends within 35% of the truth, from the counters."""
    latency = prefill_only(2e-4)
    with make_fleet(
        local_tokenizer, latency=latency, cost=CostSettings(prefill_s_per_token=2e-5)
    ) as fleet:
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0)
        for i in range(24):
            words = " ".join(f"n{i % 6}-{k}" for k in range(40 + 30 * (i % 6)))
            client.completions.create(model="tiny", prompt=words, max_tokens=2)

        def rates() -> dict[str, dict]:
            stats = httpx.get(f"{fleet.url}/index/stats").json()
            return {n: e["cost_rates"] for n, e in stats["replicas"].items()}

        # Health checks scrape every 0.2 s; a sample needs 4 new prefills on a replica.
        wait_until(lambda: all(r["samples"] > 0 for r in rates().values()), timeout_s=30)
        taken = fleet.service.router.prefill_evidence.samples
        assert taken >= 2
        assert httpx.get(f"{fleet.url}/index/stats").json()["cost_rates_from_counters"] >= taken
        for name, r in rates().items():
            assert 0.65 < r["prefill_s_per_token"] / 2e-4 < 1.35, (name, r)
