"""Describe a request's blocks the way vLLM's device events do (vLLM adapter side).

vLLM's block pool publishes, with each ``BlockStored``, the request's LoRA adapter
(``lora_id``, ``lora_name``) and per-block extra keys computed by
``generate_block_hash_extra_keys`` and converted by ``to_event_extra_keys``. The
connector calls the very same functions when it describes a chunk, so a tier event
says exactly what the device event said for the same blocks. The planner stays free
of vLLM imports: it receives the ``ExtrasSource`` built here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from kvroute.connector.extra_keys import BlockExtraKeys
from kvroute.connector.keys import ChunkExtras, ExtrasSource

if TYPE_CHECKING:
    from vllm.v1.request import Request


def request_extras(request: Request, block_size: int) -> ExtrasSource:
    """``(first_block, end_block) -> ChunkExtras`` for ``request``'s blocks."""
    lora = request.lora_request
    lora_id = lora.adapter_id if lora else None
    lora_name = lora.name if lora else None

    def extras(first_block: int, end_block: int) -> ChunkExtras:
        per_block: list[BlockExtraKeys] = []
        # Starting at item 0 is always valid: items that end before a block are
        # skipped (as the block pool does from the first block it caches).
        mm_idx = 0
        for b in range(first_block, end_block):
            keys, mm_idx = generate_block_hash_extra_keys(
                request, b * block_size, (b + 1) * block_size, mm_idx
            )
            per_block.append(keys)
        published = to_event_extra_keys(per_block)
        return ChunkExtras(
            lora_id=lora_id,
            lora_name=lora_name,
            extra_keys=tuple(published) if published is not None else None,
        )

    return extras
