"""The simulated engine's timing: what each kind of work costs, in simulated seconds.

Defaults describe one replica of an 8B model in bf16 on one H100-class GPU (KV of about
128 KiB per token): prefill at about 16k tokens/s, loading cached KV over PCIe from host
memory about 12x faster than recomputing it, from local NVMe about 2.5x faster, and a decode
step of 12 ms plus 0.1 ms per running sequence. They are order-of-magnitude figures; what the
routing benchmark compares is policies under the same model, not absolute numbers.

``time_scale`` maps simulated time to wall time: wall = simulated * time_scale. A scale of
0.05 runs a 10-minute trace in 30 s; clients divide their wall-clock measurements by it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LatencyModel"]


@dataclass(frozen=True, slots=True)
class LatencyModel:
    prefill_s_per_token: float = 6e-5
    load_cpu_s_per_token: float = 5e-6
    load_storage_s_per_token: float = 2.5e-5
    decode_s_per_step: float = 0.012
    decode_s_per_seq: float = 1e-4
    time_scale: float = 1.0
    # A decode replica pulling a prefill replica's KV (P/D, bench/sim/disagg.py): NIXL over
    # RDMA, a little slower than a load from local host memory.
    transfer_s_per_token: float = 1e-5
    # How the engine shares itself among requests (bench/sim/scheduler.py). 0: processor
    # sharing (concurrent prefills progress together, decoding never waits for them). > 0:
    # vLLM's step scheduler with this token budget (``--max-num-batched-tokens``; vLLM's
    # default for an API server on an H100 is 8192): prefills run in order, each step costs
    # a decode step plus its prefill tokens, running decodes wait for the step's prefill
    # chunk, and a NIXL pull does not occupy the engine. A float for the fleet's argv.
    max_num_batched_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_s_per_token",
            "load_cpu_s_per_token",
            "load_storage_s_per_token",
            "decode_s_per_step",
            "decode_s_per_seq",
            "transfer_s_per_token",
            "max_num_batched_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")

    def prefill_work(
        self, uncached: int, from_cpu: int, from_storage: int, pulled: int = 0
    ) -> float:
        """Engine-seconds of a request's prefill if it ran alone (concurrent ones share)."""
        return (
            uncached * self.prefill_s_per_token
            + from_cpu * self.load_cpu_s_per_token
            + from_storage * self.load_storage_s_per_token
            + pulled * self.transfer_s_per_token
        )

    @property
    def step_budget(self) -> int:
        """vLLM's per-step token budget (0: the processor-sharing model)."""
        return int(self.max_num_batched_tokens)

    def decode_step(self, running: int) -> float:
        """Simulated seconds per output token with ``running`` sequences in the batch."""
        return self.decode_s_per_step + self.decode_s_per_seq * running
