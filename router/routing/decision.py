"""``Decision``: one routing decision, from the views the router built to what the replica
that answered reported; and ``home_affinity``, what a request's home is remembered by.

Split from router.py (which re-exports both): the decision is what the request path, the
P/D driver, the dashboard's log and the calibration read, the router what builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvroute.router.fleet.replicas import Replica
    from kvroute.router.routing.policies import ReplicaView

__all__ = ["Decision", "home_affinity"]


def home_affinity(keys: Sequence[int], held_blocks: Sequence[int], fallback: bytes) -> bytes:
    """What a request's home is remembered by, and its second choices hashed on
    (``RouteContext.affinity``): the key of its first block past the prefix that a majority
    of the replicas hold (``held_blocks``: each replica's cached blocks of this prompt). A
    system prompt every replica holds is skipped, so users sharing it get different homes;
    the key stays the same as a conversation grows and after its history is evicted
    everywhere, so it finds the same home. A prompt shorter than one block uses
    ``fallback``."""
    if not keys:
        return fallback
    held = sorted(held_blocks)
    common = held[(len(held) - 1) // 2] if held else 0
    return keys[min(common, len(keys) - 1)].to_bytes(8, "little", signed=False)


@dataclass(slots=True)
class Decision:
    policy: str
    reason: str
    ranked: list[Replica]
    views: list[ReplicaView]
    prompt_tokens: int | None
    lora_name: str | None = None
    keys: dict[int, list[int]] = field(default_factory=dict)
    approx_keys: list[int] = field(default_factory=list)
    affinity: bytes = b""
    home: str | None = None
    # A batch (several prompts, one request, one replica): each prompt's length, its
    # predicted cached tokens per replica, and the keys of the prompts after the first.
    batch_sizes: list[int] = field(default_factory=list)
    batch_predicted: dict[str, list[int]] = field(default_factory=dict)
    batch_keys: dict[int, list[list[int]]] = field(default_factory=dict)
    # What the replica that answered reported it served from cache (the dashboard's log).
    delivered_by: str | None = None
    delivered_cached_tokens: int | None = None
    # When the chosen replica's first byte came (streamed answers): a calibration sample
    # once the answer reports what it served from cache.
    first_byte_s: float | None = None
    # Its KV came from a prefill replica (a P/D split): its first byte timed the pull, not
    # the replica's own work, and teaches the rates nothing.
    remote_prefill: bool = False
    # vLLM computes the prompt without reading the prefix cache (prompt logprobs)
    skips_cache: bool = False
    # The one prompt's token ids (None for a batch or without a tokenizer): what the
    # decode leg of a split request is given when the prefill leg reports none.
    tokens: list[int] | None = None
    # The output tokens it may generate, all its sequences together (max_tokens x n, or the
    # configured budget): the device blocks it will hold beside its prompt's (kv_room.py).
    output_budget: int = 0

    def view(self, name: str) -> ReplicaView | None:
        return next((v for v in self.views if v.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "reason": self.reason,
            "chosen": self.ranked[0].name if self.ranked else None,
            "ranked": [r.name for r in self.ranked],
            "prompt_tokens": self.prompt_tokens,
            "lora_name": self.lora_name,
            "home": self.home,
            "replicas": [v.to_dict() for v in self.views],
        }
