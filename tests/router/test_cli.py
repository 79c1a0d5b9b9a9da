"""``kvroute serve`` flags map onto RouterSettings; bad flags fail with a clear message."""

from __future__ import annotations

import argparse

import pytest

from kvroute.router.cli import add_arguments, main, settings_from_args
from kvroute.router.config import DisaggSettings
from kvroute.router.routing.policies import POLICIES


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_to_settings() -> None:
    args = _parse(
        "--replica",
        "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,name=a",
        "--replica",
        "http://127.0.0.1:8002",
        "--policy",
        "least_loaded",
        "--prefill-s-per-token",
        "2e-4",
        "--hint-ttl-s",
        "0",
        "--max-body-bytes",
        "1000",
        "--read-timeout-s",
        "30",
    )
    s = settings_from_args(args)
    assert [r.key for r in s.replicas] == ["a", "127.0.0.1:8002"]
    assert s.replicas[0].events == "tcp://127.0.0.1:5557"
    assert s.policy == "least_loaded" and s.cost.prefill_s_per_token == 2e-4
    assert s.hint_ttl_s == 0 and s.max_body_bytes == 1000 and s.read_timeout_s == 30


def test_policy_choices_are_the_registered_policies() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    policy = next(a for a in parser._actions if a.dest == "policy")
    assert list(policy.choices) == list(POLICIES) and policy.default in POLICIES
    for name in POLICIES:
        args = _parse("--replica", "http://a:1", "--policy", name)
        assert settings_from_args(args).policy == name


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_parse("--replica", "localhost:8000")) == 2
    assert "http(s)://" in capsys.readouterr().err
    assert main(_parse()) == 2
    assert "--replica" in capsys.readouterr().err


def test_the_whole_on_prefill_choice_is_a_flag_both_ways() -> None:
    argv = ("--replica", "http://127.0.0.1:8001")
    default = settings_from_args(_parse(*argv)).disagg.whole_on_prefill
    assert (
        settings_from_args(_parse(*argv, "--no-pd-whole-on-prefill")).disagg.whole_on_prefill
        is False
    )
    assert (
        settings_from_args(_parse(*argv, "--pd-whole-on-prefill")).disagg.whole_on_prefill is True
    )
    assert default is DisaggSettings().whole_on_prefill
