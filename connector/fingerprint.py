"""A cheap fingerprint of what determines a model's KV, for the layout identity.

The layout identity (``identity.py``) names the directory chunk files live in and is
stamped into every file header, so files written under one identity are never read
under another. Model path and revision alone do not tell two checkpoints apart: a model
directory overwritten with new weights, a quantization switched on or a rope override
changed keep both, and the KV they compute differs. The fingerprint adds:

* the settings that change the KV for the same files: ``quantization`` and its config,
  ``hf_overrides`` (a callable by its qualified name: its effect on the config is not
  visible here), the load format (``dummy`` weights are random), and for a hub model
  the commit vLLM resolved;
* the checkpoint itself, read from the model directory (a local path, or the hub
  cache's snapshot directory vLLM downloaded into): every small text file that
  configures the model (``*.json`` such as ``config.json`` and the safetensors index,
  ``*.py`` remote code) by content, and every weight file by relative name, size and
  modification time (``mtime_ns``); a weight file that is a link into a hub cache's
  ``blobs/`` by its blob name instead, which is the file's content hash, so copies of
  one hub snapshot on several hosts agree. Nothing large is read: a start costs a
  ``stat`` per weight file.

``weights_id`` (an operator's name for the checkpoint) replaces the weight files'
names, sizes and times, for a storage domain whose replicas load copies of one
checkpoint with different modification times (each host downloaded its own). It must
change whenever the weights do.

Pure: no vLLM import; the connector gathers the inputs (``layout.model_settings``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".gguf",
    ".tensors",
    ".npz",
    ".msgpack",
    ".h5",
)
# Small files that configure the model, hashed whole (config.json, the safetensors
# index, quantization configs, remote code). Larger ones count by their stats.
CONTENT_SUFFIXES = (".json", ".py")
MAX_CONTENT_BYTES = 16 << 20
MAX_FILES = 100_000


@dataclass(frozen=True)
class WeightsFingerprint:
    digest: str  # sha256 hex of everything below
    files: int  # files of the model directory that went into it
    source: str  # "dir", "file", "hub-cache" (files resolved), "hub-id" (no files), "id"


def stable_json(value: Any) -> str:
    """JSON of settings, the same in every process: sorted keys, a callable by its
    qualified name (never its address), anything else unknown as ``str``."""
    return json.dumps(value, sort_keys=True, default=_stable_default)


def _stable_default(value: Any) -> Any:
    if callable(value):
        module = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", None) or type(value).__qualname__
        return f"callable:{module}.{name}"
    if isinstance(value, (set, frozenset)):
        return sorted(str(v) for v in value)
    if hasattr(value, "to_dict"):
        try:
            return value.to_dict()
        except Exception:  # fall back to its text
            pass
    return str(value)


def _blob_name(path: str) -> str | None:
    """The content hash of a hub cache file: snapshots link into ``blobs/<etag>``."""
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    parent = os.path.basename(os.path.dirname(target))
    return os.path.basename(target) if parent == "blobs" else None


def _stat_entry(kind: str, path: str, rel: str) -> tuple[str, ...]:
    """A file counted by its stats: size, and its hub blob name (content hash) when it
    is one, else its modification time."""
    st = os.stat(path)
    blob = _blob_name(path)
    return (kind, rel, str(st.st_size), f"blob:{blob}" if blob else f"mtime:{st.st_mtime_ns}")


def _file_entry(path: str, rel: str, *, with_weights: bool) -> tuple[str, ...] | None:
    name = rel.lower()
    if name.endswith(WEIGHT_SUFFIXES):
        return _stat_entry("w", path, rel) if with_weights else None
    if name.endswith(CONTENT_SUFFIXES):
        if os.stat(path).st_size > MAX_CONTENT_BYTES:
            return _stat_entry("c", path, rel)
        with open(path, "rb") as fh:
            return ("c", rel, hashlib.sha256(fh.read()).hexdigest())
    return None


def model_files(root: Path, *, with_weights: bool = True) -> list[tuple[str, ...]]:
    """One entry per file of a model directory (or a single model file) that goes
    into the fingerprint, sorted by relative path. Hidden directories (``.cache``,
    ``.git``) are skipped."""
    root = Path(root)
    if root.is_file():
        entry = _file_entry(str(root), root.name, with_weights=with_weights)
        return [entry] if entry is not None else []
    out: list[tuple[str, ...]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if fn.startswith("."):
                continue
            path = os.path.join(dirpath, fn)
            rel = os.path.relpath(path, root)
            try:
                entry = _file_entry(path, rel, with_weights=with_weights)
            except FileNotFoundError:
                continue  # a dangling link (an incomplete hub download)
            if entry is not None:
                out.append(entry)
            if len(out) > MAX_FILES:
                raise ValueError(f"kvroute: more than {MAX_FILES} model files under {root}")
    out.sort(key=lambda e: e[1])
    return out


def weights_fingerprint(
    model_dir: Path | None,
    *,
    settings: dict[str, Any],
    weights_id: str | None = None,
    hub: bool = False,
    fallback: Callable[[], Any] | None = None,
) -> WeightsFingerprint:
    """The fingerprint of a checkpoint as this process loads it.

    ``model_dir``: the local model directory or file (None when vLLM's files could not
    be found: then ``fallback()``, e.g. the resolved config, stands in for them);
    ``settings``: what changes the KV besides the files (JSON-able, see
    ``stable_json``); ``weights_id``: replaces the weight files' stats; ``hub``: the
    directory is a hub cache snapshot."""
    files: list[tuple[str, ...]] = []
    if model_dir is not None:
        files = model_files(model_dir, with_weights=weights_id is None)
        source = "file" if Path(model_dir).is_file() else ("hub-cache" if hub else "dir")
    else:
        source = "hub-id"
    extra: Any = None
    if model_dir is None and fallback is not None:
        try:
            extra = fallback()
        except Exception as exc:  # the fallback is best effort
            extra = f"unavailable: {type(exc).__name__}"
    if weights_id is not None:
        source = "id" if model_dir is None else source + "+id"
    doc = {
        "settings": settings,
        "files": files,
        "weights_id": weights_id,
        "fallback": extra,
    }
    digest = hashlib.sha256(stable_json(doc).encode()).hexdigest()
    return WeightsFingerprint(digest=digest, files=len(files), source=source)
