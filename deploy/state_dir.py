"""Where kvroute keeps what it writes: logs, caches, disk tiers, built models.

Never inside the installed package (site-packages may be read-only and is shared by every
user of the interpreter) and never the working directory (a fleet started from two places
would not find its own state). The order: ``--state-dir`` where a command takes one, else
``$KVROUTE_STATE_DIR``, else ``$XDG_CACHE_HOME/kvroute``, else ``~/.cache/kvroute``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_state_dir"]


def default_state_dir() -> Path:
    """The user's kvroute state directory, read from the environment at each call (so a
    test or a Makefile that sets ``KVROUTE_STATE_DIR`` is obeyed)."""
    explicit = os.environ.get("KVROUTE_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME")
    if cache_home:
        return Path(cache_home).expanduser() / "kvroute"
    return Path.home() / ".cache" / "kvroute"
