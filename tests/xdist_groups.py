"""How ``pytest -n 2 --dist loadgroup`` (``make test``) shares the suite between its workers.

Every test marked ``vllm`` is one unit of work, run on one worker in file order: two real
vLLM fleets never start at once (each wants the machine's cores), and the package- and
module-scoped fleets start once, as in a serial run. Every other module is a unit of its
own (its module fixtures are set up once). Units go to whichever worker is free, the largest
(the vLLM one) first.

A test marked ``solo`` compares timings (a benchmark's latencies, a rate limit's effect) and
runs with no test of the other worker running beside it: each test holds a shared lock, a
solo test the exclusive one (and a turnstile lets it in once the running tests end).

xdist's own ``loadgroup`` would do this with ``xdist_group`` marks, but it tells the
controller a test's group by setting ``item._nodeid`` to ``ID@group``, which pytest 9.2 no
longer reads (a node's id is ``item._id`` there): every test would be a group of its own. So
the workers write each test's unit to a file at collection, and the controller's scheduler
(xdist's load-by-scope scheduling, with our units as its scopes) reads it. tests/conftest.py
registers the hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_DIR_KEY = "kvroute_units_dir"
_dir_key = pytest.StashKey[str]()


def unit_of(item: pytest.Item) -> str:
    """The unit of work ``item`` belongs to: ``vllm``, or its module."""
    if "vllm" in item.keywords:
        return "vllm"
    return item.nodeid.split("::", 1)[0]


def write_units(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker run by our scheduler: write each collected test's unit."""
    workerinput: dict[str, Any] = getattr(config, "workerinput", {})
    units_dir = workerinput.get(_DIR_KEY)
    if not units_dir:
        return
    path = Path(units_dir) / f"{workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({item.nodeid: unit_of(item) for item in items}))
    os.replace(tmp, path)  # the controller never reads half a file


@contextlib.contextmanager
def turn_of(item: pytest.Item) -> Iterator[None]:
    """In an xdist worker: hold the run lock while ``item`` runs (setup, call, teardown),
    exclusively for a ``solo`` test."""
    import fcntl

    workerinput: dict[str, Any] = getattr(item.config, "workerinput", {})
    units_dir = workerinput.get(_DIR_KEY)
    if not units_dir:
        yield
        return
    solo = item.get_closest_marker("solo") is not None
    lock_dir = Path(units_dir)
    with open(lock_dir / "turnstile.lock", "a") as turn, open(lock_dir / "run.lock", "a") as run:
        fcntl.flock(turn, fcntl.LOCK_EX)  # a waiting solo test holds it: no one passes
        fcntl.flock(run, fcntl.LOCK_EX if solo else fcntl.LOCK_SH)
        if not solo:
            fcntl.flock(turn, fcntl.LOCK_UN)
        yield  # both released when their files close


def _units_dir(config: pytest.Config) -> str:
    if _dir_key not in config.stash:
        config.stash[_dir_key] = tempfile.mkdtemp(prefix="kvroute-xdist-units-")
    return config.stash[_dir_key]


def configure_node(node: Any) -> None:
    """Controller side, before a worker starts: where it writes its units."""
    if node.config.getoption("dist") == "loadgroup":
        node.workerinput[_DIR_KEY] = _units_dir(node.config)


def make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Controller side: our scheduler for ``--dist loadgroup``, xdist's for the others."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    units_dir = Path(_units_dir(config))

    class UnitScheduling(LoadScopeScheduling):
        """Scopes are our units; a test no worker wrote down is a unit of its own."""

        _units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._units is None:  # first called once every worker has collected
                self._units = {}
                for path in sorted(units_dir.glob("gw*.json")):
                    self._units.update(json.loads(path.read_text()))
            return self._units.get(nodeid, nodeid)

    return UnitScheduling(config, log)


def cleanup(config: pytest.Config) -> None:
    units_dir = config.stash.get(_dir_key, None)
    if units_dir:
        shutil.rmtree(units_dir, ignore_errors=True)
