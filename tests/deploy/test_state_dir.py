"""Where kvroute writes: ``--state-dir``, else the environment's choice, never the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.deploy.fleet_config import FleetConfig
from kvroute.deploy.state_dir import default_state_dir
from kvroute.deploy.tiny_model import default_tiny_model_dir


def test_kvroute_state_dir_wins_over_the_cache_dirs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVROUTE_STATE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "explicit"


def test_xdg_cache_home_then_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVROUTE_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "kvroute"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_state_dir() == tmp_path / "home" / ".cache" / "kvroute"


def test_defaults_are_read_when_used_not_when_imported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVROUTE_STATE_DIR", str(tmp_path))
    assert FleetConfig().state_dir == tmp_path / "fleet"
    assert default_tiny_model_dir() == tmp_path / "models" / "tiny"


def test_nothing_defaults_to_the_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvroute

    monkeypatch.delenv("KVROUTE_STATE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    package = Path(kvroute.__file__).resolve().parent
    for path in (default_state_dir(), FleetConfig().state_dir, default_tiny_model_dir()):
        assert not path.resolve().is_relative_to(package)
        assert not path.resolve().is_relative_to(package.parent / "deploy")
