"""Who wrote a chunk file: the parallel layout and the rank within it.

Under tensor or pipeline parallelism every worker holds a different slice of a chunk's
KV (other heads, other layers) with the same shape and the same key. A file therefore
belongs to exactly one rank of exactly one layout, and both are checked on every read:

* the *layout identity* (model, the checkpoint's fingerprint, dtypes, page and chunk
  geometry, PP stage layers, hash seed, TP and PP sizes; ``layout.identity_fields``)
  names the directory ``<disk_dir>/<layout digest>/``, so a directory written with other
  weights or at another parallel layout is never even opened;
* the *rank identity* (layout identity + TP rank/size + PP rank/size) is what a file's
  header carries and what a reader compares, and ``tp<r>-pp<p>`` names the rank's
  sub-directory, so a file renamed or copied into another rank's directory is foreign.

Only the worker knows its rank (the scheduler-side instance has none); the scheduler
knows the sizes and so every rank that must hold a file for a chunk to be served.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankInfo:
    """A worker's place in the TP x PP layout (defaults: a single worker)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"parallel sizes must be >= 1: {self}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank outside its group: {self}")

    @property
    def dir_name(self) -> str:
        """Sub-directory of the layout directory holding this rank's files."""
        return f"tp{self.tp_rank}-pp{self.pp_rank}"

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def as_dict(self) -> dict[str, int]:
        return {
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
        }


def all_ranks(tp_size: int, pp_size: int) -> list[RankInfo]:
    """Every rank of a layout: the files a chunk needs before it may be served."""
    return [
        RankInfo(tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size)
        for p in range(pp_size)
        for t in range(tp_size)
    ]


def layout_identity(fields: dict[str, Any], *, tp_size: int, pp_size: int) -> str:
    """Canonical string of everything that makes chunk files interchangeable between
    processes, the parallel sizes included (``fields`` must be JSON-serializable)."""
    ident = dict(fields, tp=tp_size, pp=pp_size)
    return json.dumps(ident, sort_keys=True)


def layout_digest(identity: str) -> str:
    """Directory name of a layout identity (short, filesystem safe)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def rank_identity(identity: str, rank: RankInfo) -> str:
    """The identity a rank's file headers carry: the layout plus the rank, so equality
    of this one string proves both (a file of another rank or layout never matches)."""
    return json.dumps({"layout": identity, **rank.as_dict()}, sort_keys=True)
