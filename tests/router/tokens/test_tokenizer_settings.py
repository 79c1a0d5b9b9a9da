"""Tokenizer settings from the command line: per-model tokenizers and chat templates, the
live check's cadence, render on/off; bad values are refused with the reason."""

from __future__ import annotations

import argparse

import pytest

from kvroute.router.cli import add_arguments, settings_from_args
from kvroute.router.config import ConfigError, ModelTokenizerConfig, RouterSettings
from kvroute.router.specs import parse_model_tokenizer_flag


def _settings(*argv: str) -> RouterSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from_args(parser.parse_args(["--replica", "http://127.0.0.1:9", *argv]))


def test_model_tokenizer_flags() -> None:
    s = _settings(
        "--tokenizer",
        "/m/base",
        "--tokenizer-chat-template",
        "/t/base.jinja",
        "--model-tokenizer",
        "llama=/m/llama,chat_template=/t/llama.jinja",
        "--model-tokenizer",
        "qwen=/m/qwen,content_format=openai",
        "--tokenizer-check-every",
        "50",
        "--tokenizer-clean-checks",
        "5",
        "--no-tokenizer-render",
    )
    assert s.tokenizer == "/m/base" and s.tokenizer_chat_template == "/t/base.jinja"
    assert s.model_tokenizers == {
        "llama": ModelTokenizerConfig("/m/llama", chat_template="/t/llama.jinja"),
        "qwen": ModelTokenizerConfig("/m/qwen", content_format="openai"),
    }
    assert (s.tokenizer_check_every, s.tokenizer_clean_checks) == (50, 5)
    assert s.tokenizer_render is False
    defaults = _settings()
    assert (defaults.tokenizer_check_every, defaults.tokenizer_clean_checks) == (100, 3)
    assert defaults.tokenizer_render is True and defaults.model_tokenizers == {}


def test_bad_tokenizer_settings_are_refused() -> None:
    for bad in ("llama", "=/m", "llama=/m,template=/x", "llama=/m,content_format=html"):
        with pytest.raises(ConfigError):
            parse_model_tokenizer_flag(bad)
    with pytest.raises(ConfigError):
        RouterSettings(tokenizer_check_every=-1)
    with pytest.raises(ConfigError):
        RouterSettings(tokenizer_clean_checks=0)
