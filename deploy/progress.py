"""Progress for long runs: a live bar on a terminal, one summary line per run otherwise.

A tqdm bar redraws itself with carriage returns; written to a file or a CI log that is a
screen of ``\\r`` fragments per run. When the stream is not a terminal, ``progress`` counts
silently and prints one line when the run ends (what it did, how fast), which reads well in
``make demo > file`` and in CI.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["LineProgress", "progress"]


class LineProgress:
    """tqdm's ``update`` / context-manager surface, printing one line at the end."""

    def __init__(self, total: int, desc: str, unit: str, file: TextIO) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.file = file
        self.n = 0
        self._started = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        elapsed = time.perf_counter() - self._started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        print(
            f"{self.desc.strip()}: {self.n}/{self.total} {self.unit} in {elapsed:.1f}s "
            f"({rate:.1f} {self.unit}/s)",
            file=self.file,
            flush=True,
        )

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int, desc: str, unit: str = "it", file: TextIO | None = None) -> Any:
    """A tqdm bar when ``file`` (stderr by default, as tqdm) is a terminal, else a
    ``LineProgress``. Use as a context manager; call ``update(n)``."""
    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, leave=True, file=stream)
    return LineProgress(total, desc, unit, stream)
