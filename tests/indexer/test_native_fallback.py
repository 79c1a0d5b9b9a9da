"""Where the native index core is missing or ruled out, kvroute runs the Python index: it says
so at a router's start (a warning) and in ``/index/stats`` (``index_core``), and answers the
same. Each case runs in a fresh interpreter: the core is chosen once, when
``kvroute.indexer.native_core`` loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.wire import BlockStored

# Blocks the extension's import, as on a machine that could not build it.
_NO_EXTENSION = "import sys; sys.modules['kvroute.indexer._native'] = None\n"

_PROBE = """
import json, logging
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
from kvroute.indexer import native_core
from kvroute.indexer.index import InMemoryPrefixIndex
from kvroute.indexer.stats import collect_stats
from kvroute.indexer.wire import BlockStored
from kvroute.router.config import RouterSettings
from kvroute.router.routing.feeds import index_and_feeds

index, _ = index_and_feeds(RouterSettings())
index.apply("r0", [BlockStored([1, 2], None, list(range(8)), 4)])
try:
    InMemoryPrefixIndex(core="native")
    forced = "built"
except RuntimeError as exc:
    forced = "refused: " + str(exc)
print(json.dumps({
    "core": native_core.CORE,
    "stats": collect_stats(index).to_dict()["fleet"]["index_core"],
    "blocks": index.lookup(list(range(8)))["r0"].blocks,
    "forced": forced,
}))
"""


def _run(prelude: str, core: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVROUTE_INDEX_CORE"}
    if core is not None:
        env["KVROUTE_INDEX_CORE"] = core
    return subprocess.run(
        [sys.executable, "-c", prelude + _PROBE],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _answer(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_missing_extension_falls_back_to_python_and_warns_at_start() -> None:
    done = _run(_NO_EXTENSION, None)
    answer = _answer(done)
    assert answer["core"] == "python"
    assert answer["stats"] == "python"
    assert answer["blocks"] == 2
    assert str(answer["forced"]).startswith("refused: the native index core is not available")
    warnings = [line for line in done.stderr.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1, done.stderr
    assert "native index core is not available" in warnings[0]


def test_the_python_core_asked_for_runs_without_a_warning() -> None:
    done = _run("", "python")
    answer = _answer(done)
    assert (answer["core"], answer["stats"], answer["blocks"]) == ("python", "python", 2)
    assert "LOG WARNING" not in done.stderr


def test_native_asked_for_but_missing_is_an_error() -> None:
    done = _run(_NO_EXTENSION, "native")
    assert done.returncode != 0
    assert "KVROUTE_INDEX_CORE=native but the extension is missing" in done.stderr


def test_an_unknown_core_is_an_error() -> None:
    done = _run("", "rust")
    assert done.returncode != 0
    assert "KVROUTE_INDEX_CORE must be 'native' or 'python'" in done.stderr


def test_stats_name_each_index_core() -> None:
    for core in ("python", "native"):
        index = InMemoryPrefixIndex(core=core)
        index.apply("r0", [BlockStored([1], None, [1, 2, 3, 4], 4)])
        fleet = collect_stats(index).to_dict()["fleet"]
        assert fleet["index_core"] == core
