"""Suite-wide settings.

Tests that need a real vLLM carry ``@pytest.mark.vllm``. Without vLLM installed they are
skipped on a developer's machine, but ``make test`` (and so CI) sets KVROUTE_REQUIRE_VLLM=1,
which turns a missing vLLM into a failure: a broken install never passes as green.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "vllm" not in item.keywords or _HAVE_VLLM:
        return
    if os.environ.get("KVROUTE_REQUIRE_VLLM") == "1":
        pytest.fail("vllm is required here (KVROUTE_REQUIRE_VLLM=1) but is not installed")
    pytest.skip("vllm is not installed (`make test` installs it)")
