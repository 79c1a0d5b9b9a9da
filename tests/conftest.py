"""Suite-wide settings.

Tests that need a real vLLM carry ``@pytest.mark.vllm``. Without vLLM installed they are
skipped on a developer's machine, but ``make test`` (and so CI) sets KVROUTE_REQUIRE_VLLM=1,
which turns a missing vLLM into a failure: a broken install never passes as green.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): the
``vllm`` tests one after the other on one of them, the other modules beside them
(tests/xdist_groups.py). A test marked ``solo`` runs with nothing beside it.

What the suite builds or starts without a ``--state-dir`` of its own (tiny models, the
simulator's tokenizer) goes to the repository's ``.kvroute/`` (which ``make clean`` removes),
not to the user's cache, unless ``KVROUTE_STATE_DIR`` already says where.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests import xdist_groups
from tests.paths import REPO_ROOT

os.environ.setdefault("KVROUTE_STATE_DIR", str(REPO_ROOT / ".kvroute"))

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    xdist_groups.write_units(config, items)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: defined only where xdist is installed
def pytest_configure_node(node: Any) -> None:
    xdist_groups.configure_node(node)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return xdist_groups.make_scheduler(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with xdist_groups.turn_of(item):
        return (yield)


def pytest_unconfigure(config: pytest.Config) -> None:
    xdist_groups.cleanup(config)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "vllm" not in item.keywords or _HAVE_VLLM:
        return
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
        pytest.fail("vllm is required here (KVROUTE_REQUIRE_VLLM=1) but is not installed")
    pytest.skip("vllm is not installed (`make test` installs it)")
