"""Connector configuration, parsed from ``kv_connector_extra_config``.

Kept as a frozen dataclass so the scheduler-side and worker-side instances (separate
objects, possibly separate processes) derive the same numbers from the same dict.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

GIB = 1 << 30

DISK_POLICIES = ("write_through", "demote")
CUDA_BLOCK_KERNELS = ("auto", "triton", "per_layer")
_DOMAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of the kvroute connector.

    ``chunk_tokens`` must be a whole number of vLLM blocks: a chunk is the unit of
    storage, lookup and events, and it is keyed by the hash of its last block.
    """

    chunk_tokens: int = 256
    cpu_gib: float = 1.0
    disk_dir: str | None = None
    disk_gib: float = 8.0
    # "write_through": every chunk stored in RAM is also written to disk (a restarted
    # replica finds its cache); "demote": a chunk goes to disk only when RAM evicts it.
    disk_policy: str = "write_through"
    disk_fsync: bool = False
    # Pending disk writes above this many bytes are dropped (never block the forward).
    disk_write_queue_mib: int = 256
    # After a full disk (ENOSPC or byte cap hit), retry writes after this many seconds.
    disk_full_retry_s: float = 30.0
    # Opt-in to use a disk tier although block hashes are not reproducible across
    # processes (random NONE_HASH seed): the directory is then private and wiped at start.
    allow_nondeterministic_hash_seed: bool = False
    pin_memory: bool = True
    # Touch the RAM pool at start so first stores do not pay page faults.
    prefault_cpu_pool: bool = True
    # Concurrent chunk reads of the disk tier (queue depth for the device).
    disk_read_threads: int = 2
    # Concurrent chunk file writes (one writer thread each).
    disk_write_threads: int = 2
    # Name of the storage domain when ``disk_dir`` is shared by several replicas: every
    # replica then finds every chunk any of them wrote, live; an external evictor
    # (``kvroute storage gc``) bounds the directory. None: a private directory.
    storage_domain: str | None = None
    # An operator's name for the checkpoint, used in the layout identity instead of the
    # weight files' names, sizes and modification times (``fingerprint.py``): for
    # replicas that load copies of one checkpoint with different file times. Must
    # change whenever the weights change. None: the files' stats.
    weights_id: str | None = None
    # How a CUDA worker moves a chunk's blocks between the KV cache and its staging
    # buffer: "auto" (one Triton launch for all layers where the layout allows, else one
    # kernel per layer), "triton" (fail at start if it cannot), "per_layer".
    cuda_block_kernel: str = "auto"
    # P/D through the storage domain (connector/pd_store.py): a prefill leg's answer
    # names the chunks it wrote; a decode leg waits for them at most ``pd_wait_s``
    # seconds (from its first look), then loads what is there and recomputes the rest.
    pd_via_storage: bool = False
    pd_wait_s: float = 10.0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Build from the connector's extra config; unknown keys are rejected so a typo
        does not silently fall back to a default."""
        extra = dict(extra or {})
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"unknown kvroute connector config keys: {unknown}")
        cfg = cls(**extra)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        if self.cpu_gib < 0 or self.disk_gib < 0:
            raise ValueError("cpu_gib and disk_gib must be >= 0")
        if self.disk_policy not in DISK_POLICIES:
            raise ValueError(f"disk_policy must be one of {DISK_POLICIES}")
        if self.disk_read_threads < 1 or self.disk_write_threads < 1:
            raise ValueError("disk_read_threads and disk_write_threads must be >= 1")
        if self.cuda_block_kernel not in CUDA_BLOCK_KERNELS:
            raise ValueError(f"cuda_block_kernel must be one of {CUDA_BLOCK_KERNELS}")
        self._validate_pd()
        if self.weights_id is not None and not str(self.weights_id).strip():
            raise ValueError("weights_id must be a non-empty string (or unset)")
        if self.storage_domain is not None:
            if not self.disk_dir:
                raise ValueError("storage_domain needs disk_dir (the shared directory)")
            if not _DOMAIN_NAME.fullmatch(str(self.storage_domain)):
                raise ValueError(
                    f"storage_domain {self.storage_domain!r}: use 1-128 characters of "
                    "[A-Za-z0-9._-]"
                )
            if self.allow_nondeterministic_hash_seed:
                raise ValueError(
                    "storage_domain cannot be combined with allow_nondeterministic_hash_seed "
                    "(chunk keys would differ in every replica)"
                )

    def _validate_pd(self) -> None:
        if self.pd_wait_s < 0:
            raise ValueError("pd_wait_s must be >= 0")
        if self.pd_via_storage and self.storage_domain is None:
            raise ValueError(
                "pd_via_storage needs a storage domain (disk_dir and storage_domain) that "
                "both pools share"
            )

    def blocks_per_chunk(self, block_size: int) -> int:
        if self.chunk_tokens % block_size:
            raise ValueError(
                f"chunk_tokens={self.chunk_tokens} is not a multiple of the vLLM block "
                f"size {block_size}"
            )
        return self.chunk_tokens // block_size

    @property
    def cpu_bytes(self) -> int:
        return int(self.cpu_gib * GIB)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_gib * GIB)

    @property
    def disk_path(self) -> Path | None:
        return Path(os.path.expanduser(self.disk_dir)) if self.disk_dir else None
