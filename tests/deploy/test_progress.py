"""kvroute.deploy.progress: a tqdm bar on a terminal, one summary line per run anywhere else."""

from __future__ import annotations

import io

from tqdm import tqdm

from kvroute.deploy.progress import LineProgress, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_prints_one_line_per_run_and_no_carriage_return() -> None:
    out = io.StringIO()
    for run in ("kvroute     ", "round_robin "):
        with progress(12, run, "req", file=out) as bar:
            assert isinstance(bar, LineProgress)
            for _ in range(12):
                bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("kvroute: 12/12 req in ") and lines[0].endswith(" req/s)")
    assert lines[1].startswith("round_robin: 12/12 req in ")


def test_a_terminal_gets_a_live_bar() -> None:
    out = _Terminal()
    with progress(3, "kvroute", "req", file=out) as bar:
        assert isinstance(bar, tqdm)
        bar.update(3)
    assert "\r" in out.getvalue() and "3/3" in out.getvalue()
