"""Fixtures: a tiny local tokenizer, simulated vLLM replicas and a router, all on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.deploy.tiny_model import build_tiny_model
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.sim_fleet import Fleet, make_fleet


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="session")
def local_tokenizer(tiny_model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer(str(tiny_model_dir))


@pytest.fixture
def fleet(local_tokenizer: LocalTokenizer) -> Iterator[Fleet]:
    with make_fleet(local_tokenizer) as f:
        yield f
