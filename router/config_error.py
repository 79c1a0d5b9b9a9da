"""``ConfigError``: a setting, flag or file that cannot be used, with the reason (raised by
router/config.py and the settings modules beside it, re-exported there)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A replica flag or file that cannot be used, with the reason."""
