"""Paths into this repository, for tests that read its files (examples, dashboards, sources).

The installed package knows nothing of a repository: only tests do.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
