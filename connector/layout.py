"""What the connector reads from vLLM's configuration about where it runs.

Pure (no vLLM import at module level): the functions read the attributes of vLLM's
config objects, so unit tests pass plain stand-ins.

* **Pipeline stages of different sizes.** vLLM builds the scheduler's KV cache config
  from PP stage 0 (``generate_scheduler_kv_cache_config`` copies ``kv_cache_configs[0]``)
  while each worker gets its own stage's layers. With 61 layers at PP=4 the stages hold
  15/15/16/15 layers, so a RAM pool sized from one's own layers would give the 16-layer
  stage fewer slots than the scheduler hands out. Every process therefore sizes the
  pool from the LARGEST stage (``stage_layer_counts``, ``pool_slots``): one slot count
  everywhere, each worker's slot holding its own stage's layers.
* **Decode context parallelism** (DCP > 1) makes vLLM hash prefixes in units of
  ``block_size x DCP`` tokens (``resolve_kv_cache_block_sizes``) and shards each such
  block's tokens over the DCP ranks; the connector's chunks are counted in
  ``block_size`` blocks, so it refuses to start (``check_dcp``).
* **Data parallelism.** Each DP engine has its own scheduler and workers; they must not
  share a private directory (one would delete files the other indexes).
  ``dp_index`` is the engine's DP rank (vLLM resets ``data_parallel_rank`` to 0 for
  the independent engines of a dense model and keeps the rank in
  ``data_parallel_index``); ``private_layout_dir`` gives ranks above 0 a directory of
  their own. A storage domain stays shared by all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvroute.connector.cpu_tier import num_slots_for
from kvroute.connector.disk_tier import tier_directory
from kvroute.connector.fingerprint import WeightsFingerprint, weights_fingerprint

logger = logging.getLogger(__name__)


class LayoutError(ValueError):
    """A parallel layout the connector cannot serve, with the fix in the message."""


# ---------------------------------------------------------------- pipeline stages
def stage_layer_counts(model_config: Any, tp_size: int, pp_size: int) -> list[int]:
    """KV (attention) layers of each PP stage, as vLLM splits the model: vLLM's
    ``get_num_layers_by_block_type`` for a worker of each stage (it follows
    ``VLLM_PP_LAYER_PARTITION`` and vLLM's default uneven split)."""
    counts = []
    for stage in range(pp_size):
        pc = SimpleNamespace(
            rank=stage * tp_size, tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
        )
        counts.append(int(model_config.get_num_layers_by_block_type(pc, "attention")))
    return counts


def check_stage_layers(counts: list[int], stage: int, own_layers: int) -> None:
    """This process's KV layers must be what the stage split says for its stage (the
    scheduler holds stage 0's), else the pool sizes cannot be derived: refuse."""
    if counts[stage] != own_layers:
        raise LayoutError(
            f"kvroute: PP stage {stage} has {own_layers} KV layers but the model's layer "
            f"split gives {counts} over {len(counts)} stages, so the RAM pools of the "
            "stages cannot be sized alike. Run with --pipeline-parallel-size 1, or set "
            "VLLM_PP_LAYER_PARTITION to a split of the model's KV layers."
        )


def pool_slots(cpu_bytes: int, counts: list[int], blocks_per_chunk: int, page_bytes: int) -> int:
    """RAM slots of every worker's pool: ``cpu_bytes`` over the chunk bytes of the
    largest stage, so all stages (and the scheduler's planner) have the same slots and
    no pool exceeds ``cpu_bytes``."""
    return num_slots_for(cpu_bytes, max(counts) * blocks_per_chunk * page_bytes)


def stage_layers(vllm_config: Any, own_layers: int, tp_size: int, pp_size: int) -> list[int]:
    """Each stage's KV layers; with one stage, this process's own (nothing to derive)."""
    if pp_size == 1:
        return [own_layers]
    try:
        return stage_layer_counts(vllm_config.model_config, tp_size, pp_size)
    except Exception as exc:  # any failure: the split is unknown
        raise LayoutError(
            f"kvroute: cannot tell the KV layers of each of the {pp_size} PP stages "
            f"({type(exc).__name__}: {exc}), so the RAM pools cannot be sized alike. Run "
            "with --pipeline-parallel-size 1, or set VLLM_PP_LAYER_PARTITION."
        ) from exc


# ---------------------------------------------------------------- decode context parallel
def check_dcp(parallel_config: Any, block_size: int) -> None:
    """Refuse DCP > 1: vLLM then hashes ``block_size x DCP`` tokens per block and each
    DCP rank holds every DCP-th token of a block; the connector's chunks, keys and
    copies are counted in ``block_size`` blocks and would not line up."""
    dcp = int(getattr(parallel_config, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        raise LayoutError(
            f"kvroute: decode context parallelism (--decode-context-parallel-size {dcp}) is "
            f"not supported: vLLM hashes prefixes in blocks of block_size x DCP = "
            f"{block_size * dcp} tokens and shards each block's tokens over the DCP ranks, "
            "which the connector's chunks do not follow. Run with "
            "--decode-context-parallel-size 1, or without the kvroute connector."
        )


# ---------------------------------------------------------------- data parallel
def dp_index(parallel_config: Any) -> int:
    """This engine's DP rank. vLLM runs each DP rank of a dense model as an independent
    engine with ``data_parallel_rank`` reset to 0; ``data_parallel_index`` keeps the
    rank (and equals ``data_parallel_rank`` otherwise)."""
    idx = getattr(parallel_config, "data_parallel_index", None)
    if idx is None:
        idx = getattr(parallel_config, "data_parallel_rank", 0)
    return int(idx or 0)


def private_layout_dir(layout_dir: Path, dp: int) -> Path:
    """The private directory of DP rank ``dp`` in a layout directory: the layout
    directory itself for rank 0 (as without DP), ``dp<r>`` inside it for the others.
    Only ``tp<r>-pp<p>`` rank directories and files are a rank-0 engine's, so it never
    looks into another rank's ``dp<r>``."""
    if dp == 0:
        return Path(layout_dir)
    d = Path(layout_dir) / f"dp{dp}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def engine_layout_dir(base: Path, digest: str, *, dp: int, shared: bool) -> Path:
    """Where one engine's chunk files of a layout live: ``<base>/<digest>`` for a
    storage domain (every replica and DP rank shares it) and for DP rank 0,
    ``<base>/<digest>/dp<r>`` for the private directory of DP rank r > 0."""
    layout = tier_directory(base, digest)
    return layout if shared else private_layout_dir(layout, dp)


# ---------------------------------------------------------------- weights fingerprint
def model_settings(vllm_config: Any) -> dict[str, Any]:
    """What changes the KV for the same model files (see ``fingerprint``)."""
    mc = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    hf_config = getattr(mc, "hf_config", None)
    return {
        "quantization": _opt_str(getattr(mc, "quantization", None)),
        "quantization_config": getattr(mc, "quantization_config", None),
        "hf_overrides": getattr(mc, "hf_overrides", None),
        "hf_config_path": _opt_str(getattr(mc, "hf_config_path", None)),
        "model_weights": _opt_str(getattr(mc, "model_weights", None)) or None,
        "load_format": _opt_str(getattr(load, "load_format", None)),
        "commit": getattr(hf_config, "_commit_hash", None),
    }


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def local_model_dir(vllm_config: Any) -> tuple[Path | None, bool]:
    """The model's files on this host and whether they are a hub cache snapshot: the
    model path when it exists, else the snapshot vLLM downloaded the hub id into
    (looked up in the cache only, never downloaded), else None."""
    mc = vllm_config.model_config
    model = str(mc.model)
    if os.path.exists(model):
        return Path(model), False
    load = getattr(vllm_config, "load_config", None)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            repo_id=model,
            revision=getattr(mc, "revision", None),
            cache_dir=getattr(load, "download_dir", None),
            local_files_only=True,
        )
    except Exception as exc:  # not in the cache, not a hub id, no hub lib
        logger.info("kvroute: no local files for model %s (%s)", model, type(exc).__name__)
        return None, False
    return Path(path), True


def resolved_config(vllm_config: Any) -> Any:
    """The model config vLLM resolved (stands in for files that cannot be found)."""
    return vllm_config.model_config.hf_config.to_json_string()


def checkpoint_fingerprint(
    vllm_config: Any, weights_id: str | None = None
) -> tuple[WeightsFingerprint, Path | None]:
    """The fingerprint of the checkpoint vLLM loaded, and the files it read."""
    model_dir, hub = local_model_dir(vllm_config)
    fp = weights_fingerprint(
        model_dir,
        settings=model_settings(vllm_config),
        weights_id=weights_id,
        hub=hub,
        fallback=lambda: resolved_config(vllm_config),
    )
    return fp, model_dir


def identity_fields(
    vllm_config: Any,
    *,
    weights: str,
    num_layers: int,
    stage_layers: list[int],
    page_bytes: int,
    chunk_tokens: int,
    hash_seed: str,
) -> dict[str, Any]:
    """The layout identity's fields besides the parallel sizes (``identity.py``)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    return {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        # The checkpoint and the settings that change its KV (``fingerprint``).
        "weights": weights,
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "num_layers": num_layers,
        # Which layers each PP stage holds: a stage's files hold its layers only.
        "stage_layers": list(stage_layers),
        "page_bytes": page_bytes,
        "block_size": cc.block_size,
        "chunk_tokens": chunk_tokens,
        "hash_algo": str(cc.prefix_caching_hash_algo),
        "hash_seed": hash_seed,
    }
