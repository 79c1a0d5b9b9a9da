"""The routing benchmark's policy variants (bench/policy_variants.py)."""

from __future__ import annotations

import pytest

from kvroute.bench.policy_variants import PolicyVariant

TRUE = {"prefill_s_per_token": 1e-4, "load_s_per_token_cpu": 1e-5, "load_s_per_token_storage": 4e-5}


def test_a_plain_policy_is_itself_with_the_true_rates_learned() -> None:
    v = PolicyVariant.parse("kvroute")
    assert (v.policy, v.prior_scale, v.learn) == ("kvroute", 1.0, True)
    assert v.cost(TRUE) == {**TRUE, "learn_rates": True}


def test_scaled_priors_learned_or_fixed() -> None:
    high = PolicyVariant.parse("kvroute~x10")
    assert (high.policy, high.prior_scale, high.learn) == ("kvroute", 10.0, True)
    assert high.cost(TRUE)["prefill_s_per_token"] == pytest.approx(1e-3)
    low = PolicyVariant.parse("kvroute~fixed-x0.1")
    assert (low.prior_scale, low.learn) == (0.1, False)
    assert low.cost(TRUE) == pytest.approx(
        {**{k: v / 10 for k, v in TRUE.items()}, "learn_rates": False}
    )


@pytest.mark.parametrize(
    "spec", ["kvroute~10", "kvroute~xten", "kvroute~x0", "kvroute~x-1", "kvroute~xnan"]
)
def test_a_malformed_variant_is_refused_clearly(spec: str) -> None:
    with pytest.raises(ValueError, match="policy variant"):
        PolicyVariant.parse(spec)
