"""The routing decision's knobs: the kvroute cost model's (``CostSettings``) and the
prefill/decode decider's (``DisaggSettings``). Fields of ``RouterSettings``
(router/config.py, which re-exports both); docs/router.md says what each term models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.router.config_error import ConfigError

__all__ = ["CostSettings", "DisaggSettings"]


@dataclass(slots=True)
class CostSettings:
    """Knobs of the default (kvroute) cost: estimated seconds to first token per replica.

    est_ttft = queue_delay + prefill_s_per_token * uncached
               + load_s_per_token_cpu * cpu_tokens + load_s_per_token_storage * storage_tokens
    queue_delay = q * pending * (1 + pending / queue_knee)
                  + waiting_s_per_request * waiting + kv_wait (or kv_pressure_s * pressure)
    kv_wait is how long until the request's blocks are free in the replica's device cache
    (``kv_room``, router/routing/kv_room.py), where the replica's metrics say its size;
    the pressure term stands in for it where they do not. q is learned per replica from
    streamed first bytes (``learn_queue_delay``), starting
    from and relaxing back to ``queue_s_per_request``; the three rates likewise
    (``learn_rates``, router/routing/calibration.py), from the configured ones. See
    docs/router.md for what each term models and how to set it."""

    prefill_s_per_token: float = 1e-4
    load_s_per_token_cpu: float = 2e-5
    load_s_per_token_storage: float = 5e-5
    queue_s_per_request: float = 0.02
    # Learn seconds per pending request from each replica's streamed first bytes
    # (router/routing/queue_model.py); queue_s_per_request is then the prior.
    learn_queue_delay: bool = True
    queue_learn_weight: float = 0.03
    queue_learn_half_life_s: float = 30.0
    queue_s_per_request_max: float = 10.0
    # Learn the prefill and load rates per replica from answered requests (calibration.py);
    # the configured rates are then the priors.
    learn_rates: bool = True
    rates_half_life_s: float = 300.0
    rates_prior_samples: float = 0.5
    queue_knee: float = 16.0
    waiting_s_per_request: float = 0.05
    kv_pressure_s: float = 0.5
    kv_pressure_start: float = 0.9
    # Price the wait for room in a replica's device cache (router/routing/kv_room.py): its
    # size from vLLM's cache-config gauge, the blocks this router's requests hold there and
    # when they should end, at seconds per output token learned from answers (this prior
    # first). A request without max_tokens is budgeted kv_default_output_tokens.
    kv_room: bool = True
    decode_s_per_token: float = 0.03
    kv_default_output_tokens: int = 256
    # Rank by est_ttft + weight * (this request's prefill + loads) * pending requests there:
    # the delay it adds to the requests it joins (0: rank by its own est_ttft alone).
    delay_to_others_weight: float = 1.0
    tie_epsilon_s: float = 1e-3
    # Bounded-load affinity: a prefix goes back to the replica it was first placed on (its
    # home) while that costs at most (1 + home_slack) x the cheapest replica doing the same
    # work, so prefixes evicted everywhere return home and the caches split the working set
    # instead of each holding a random part of it (0: always the cheapest).
    home_slack: float = 0.5
    # A new prefix goes to the first replica of its rendezvous order, among those within the
    # same bound, whose blocks stored lately (from the event feeds, decayed with this
    # half-life, about a session's length) are at most (1 + placement_slack) x their mean:
    # what every router sees alike, so several routers agree (router/routing/placement.py).
    placement_half_life_s: float = 30.0
    placement_slack: float = 0.0
    # Blocks sent to a replica to compute count toward its stored rate until its feed
    # announces them, for at most this long (a failed or retried request stores nothing).
    placement_unstored_max_age_s: float = 10.0
    # How much of a match held only in tiers whose publisher never announces removals
    # (LMCache, llm-d's FS backend) we believe: those entries are aged out by a timer, not by
    # the publisher, and may be gone before they expire.
    unconfirmed_weight: float = 0.5
    # How much of a replica's match we believe, by the freshness of its event feed.
    freshness_weight: dict[str, float] = field(
        default_factory=lambda: {
            "live": 1.0,
            "syncing": 0.8,
            # Rebuilding entries were all stored after the clear and their removals are seen:
            # the index may lack blocks, never hold false ones. Believe what it has.
            "rebuilding": 1.0,
            "stale": 0.25,
            "connecting": 0.0,
            # Cleared when throttled; nothing is held, and a hint left from before is not
            # believed either.
            "throttled": 0.0,
        }
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.unconfirmed_weight <= 1.0:
            raise ConfigError("cost.unconfirmed_weight must be in [0, 1]")
        for name in (
            "prefill_s_per_token",
            "load_s_per_token_cpu",
            "load_s_per_token_storage",
            "queue_s_per_request",
            "waiting_s_per_request",
            "kv_pressure_s",
            "delay_to_others_weight",
            "tie_epsilon_s",
            "home_slack",
            "placement_slack",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"cost.{name} must be >= 0")
        if self.queue_knee <= 0:
            raise ConfigError("cost.queue_knee must be > 0")
        if self.decode_s_per_token <= 0:
            raise ConfigError("cost.decode_s_per_token must be > 0")
        if self.kv_default_output_tokens < 0:
            raise ConfigError("cost.kv_default_output_tokens must be >= 0")
        if not 0.0 < self.queue_learn_weight <= 1.0:
            raise ConfigError("cost.queue_learn_weight must be in (0, 1]")
        if self.placement_half_life_s <= 0:
            raise ConfigError("cost.placement_half_life_s must be > 0")
        if self.placement_unstored_max_age_s <= 0:
            raise ConfigError("cost.placement_unstored_max_age_s must be > 0")
        if self.rates_half_life_s <= 0 or self.rates_prior_samples <= 0:
            raise ConfigError("cost.rates_half_life_s and cost.rates_prior_samples must be > 0")
        if self.queue_learn_half_life_s <= 0:
            raise ConfigError("cost.queue_learn_half_life_s must be > 0")
        if self.queue_s_per_request_max < self.queue_s_per_request:
            raise ConfigError("cost.queue_s_per_request_max must be >= queue_s_per_request")


@dataclass(slots=True)
class DisaggSettings:
    """Prefill/decode disaggregation (router/routing/disagg.py; docs/router.md, "P/D").

    ``mode``: ``auto`` (the decider: decode replica first, the prefill leg only where it
    pays), ``always`` (every eligible request split, as smg and vllm-router do), ``never``
    (aggregated on the decode pool). The prefill leg is skipped when what the decode replica
    must compute is small (at most ``skip_tokens``, or ``skip_fraction`` of the prompt: a
    returning user whose history it holds), or when the cost model prices the request whole
    on the decode replica or, with ``whole_on_prefill``, on a prefill replica (the stall of
    the decodes running there at ``decode_stall_weight`` TTFT-seconds per second per decode)
    no dearer than prefill elsewhere plus the pull (``transfer_s_per_token`` per token
    pulled, ``split_overhead_s`` per request). A prefill replica in the decode replica's
    zone is preferred while it costs at most ``1 + zone_slack`` times the cheapest;
    ``prefill_attempts`` prefill replicas are tried before the request is served
    decode-only, each given ``prefill_timeout_s`` to answer."""

    mode: str = "auto"
    skip_tokens: int = 256
    skip_fraction: float = 0.1
    transfer_s_per_token: float = 1e-5
    split_overhead_s: float = 0.005
    zone_slack: float = 0.25
    prefill_attempts: int = 2
    prefill_timeout_s: float = 60.0
    decode_stall_weight: float = 1.0
    whole_on_prefill: bool = True

    def __post_init__(self) -> None:
        if self.prefill_timeout_s <= 0 or self.prefill_attempts < 1:
            raise ConfigError("pd prefill_timeout_s must be > 0 and prefill_attempts >= 1")
        if self.mode not in ("auto", "always", "never"):
            raise ConfigError(f"pd mode must be auto, always or never, got {self.mode!r}")
        if self.skip_tokens < 0 or not 0.0 <= self.skip_fraction <= 1.0:
            raise ConfigError("pd skip_tokens must be >= 0 and skip_fraction in [0, 1]")
        names = ("transfer_s_per_token", "split_overhead_s", "zone_slack", "decode_stall_weight")
        for name in names:
            if getattr(self, name) < 0:
                raise ConfigError(f"pd {name} must be >= 0")
