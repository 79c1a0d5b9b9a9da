"""Suite-wide settings.

Tests that need a real vLLM carry ``@pytest.mark.vllm``. Without vLLM installed they are
skipped on a developer's machine, but ``make test`` (and so CI) sets KVROUTE_REQUIRE_VLLM=1,
which turns a missing vLLM into a failure: a broken install never passes as green.

What the suite builds or starts without a ``--state-dir`` of its own (tiny models, the
simulator's tokenizer) goes to the repository's ``.kvroute/`` (which ``make clean`` removes),
not to the user's cache, unless ``KVROUTE_STATE_DIR`` already says where.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.paths import REPO_ROOT

os.environ.setdefault("KVROUTE_STATE_DIR", str(REPO_ROOT / ".kvroute"))

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "vllm" not in item.keywords or _HAVE_VLLM:
        return
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
        pytest.fail("vllm is required here (KVROUTE_REQUIRE_VLLM=1) but is not installed")
    pytest.skip("vllm is not installed (`make test` installs it)")
