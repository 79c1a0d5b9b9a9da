"""Which index core runs: the native one (``kvroute.indexer._native``, C++) or Python.

The native core is an optional extension (setup.py): a machine without a compiler installs
kvroute all the same and runs the Python index. Each native function has a Python twin that is
its specification (``keys.block_keys``, ``Lookups._walk_counts``); callers ask ``NATIVE`` and
fall back to the twin when it is None. ``KVROUTE_INDEX_CORE=python`` forces the Python core
(tests of the fallback, or to rule the native one out); ``=native`` makes a missing extension
an error instead of a warning.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

__all__ = ["CORE", "NATIVE", "UNAVAILABLE", "warn_if_python"]

log = logging.getLogger(__name__)


def _load() -> tuple[ModuleType | None, str | None]:
    wanted = os.environ.get("KVROUTE_INDEX_CORE", "").strip().lower()
    if wanted not in ("", "native", "python"):
        raise ValueError(f"KVROUTE_INDEX_CORE must be 'native' or 'python', not {wanted!r}")
    if wanted == "python":
        return None, None
    try:
        from kvroute.indexer import _native  # type: ignore[attr-defined]
    except ImportError as exc:
        if wanted == "native":
            raise ImportError(
                f"KVROUTE_INDEX_CORE=native but the extension is missing: {exc}"
            ) from exc
        return None, str(exc)
    return _native, None


NATIVE, UNAVAILABLE = _load()
"""The extension module (None: the Python core runs), and why it is missing when it should
have run (None when it loaded, or the Python core was asked for)."""
CORE = "native" if NATIVE is not None else "python"
"""What ``/index/stats`` reports as ``index_core``."""

_warned = False


def warn_if_python() -> None:
    """Warn once, at a router's start, that the native core is missing (not when asked off)."""
    global _warned
    if UNAVAILABLE is not None and not _warned:
        _warned = True
        log.warning(
            "kvroute's native index core is not available (%s): running the Python index, "
            "slower to ingest and look up at fleet scale; reinstall kvroute where a C++ "
            "compiler exists (docs/indexer.md, 'Native core')",
            UNAVAILABLE,
        )
