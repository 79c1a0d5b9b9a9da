"""The ``kvroute`` command imports only the chosen subcommand's module.

``kvroute serve``, ``up`` and ``sim`` must start (and show their help) on a base install,
which has neither torch nor vLLM, and without paying for importing them where they are
installed. Each case runs in a fresh interpreter and reports what ``sys.modules`` holds after
the command line was parsed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

import pytest

from kvroute.deploy.cli import BENCHES, COMMANDS

HEAVY = ("torch", "vllm")
SUBCOMMAND_MODULES = [module for module, _ in (*COMMANDS.values(), *BENCHES.values())]

_PROBE = """
import json, sys
from kvroute.deploy.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


def imported_by(*argv: str) -> tuple[set[str], str]:
    """The modules loaded by ``kvroute <argv>`` (which must exit by itself, as --help does)
    and what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    *printed, modules = done.stdout.rstrip("\n").split("\n")
    return set(json.loads(modules)), "\n".join(printed)


@pytest.mark.parametrize("command", ["serve", "up", "sim"])
def test_help_of_the_serving_commands_imports_neither_torch_nor_vllm(command: str) -> None:
    modules, printed = imported_by(command, "--help")
    assert f"usage: kvroute {command}" in printed
    assert COMMANDS[command][0] in modules  # the chosen one is loaded: its options are shown
    assert not {name for name in modules if name.split(".")[0] in HEAVY}


@pytest.mark.parametrize("argv", [("--help",), ("bench", "--help")])
def test_listings_name_every_subcommand_without_importing_one(argv: tuple[str, ...]) -> None:
    modules, printed = imported_by(*argv)
    listed = COMMANDS if argv == ("--help",) else BENCHES
    for name in listed:
        assert name in printed
    assert not modules & set(SUBCOMMAND_MODULES)


@pytest.mark.skipif(find_spec("torch") is None, reason="needs torch (kvroute[cpu])")
def test_the_probe_sees_torch_where_a_subcommand_does_import_it() -> None:
    modules, printed = imported_by("bench", "connector", "--help")
    assert "usage: kvroute bench connector" in printed
    assert "torch" in modules
