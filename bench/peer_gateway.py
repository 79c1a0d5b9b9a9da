"""SGLang's model gateway (``smg``, PyPI) as a process beside kvroute in ``kvroute bench proxy``:
the Rust router users compare kvroute's request path with, over the same upstream, on the
same core, measured by the same load generator in the same run.

``smg launch --worker-urls <upstream>`` with its defaults (policy ``cache_aware``, its
approximate radix tree over request text: the cache-aware counterpart of kvroute's default
policy), request logging off (``--log-level warn``) as kvroute's router runs at ``warning``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
from collections.abc import Collection
from pathlib import Path

from kvroute.deploy.processes import ChildProcess, free_port

__all__ = ["SMG_POLICY", "smg_executable", "smg_version", "start_smg"]

SMG_POLICY = "cache_aware"


def smg_executable() -> str | None:
    """The ``smg`` console script of this Python's environment (else one on PATH), or None
    when smg is not installed (``pip install 'kvroute[smg]'``)."""
    beside = Path(sys.executable).with_name("smg")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("smg")


def smg_version() -> str | None:
    try:
        return importlib.metadata.version("smg")
    except importlib.metadata.PackageNotFoundError:
        return None


def start_smg(
    upstream_url: str, cpus: Collection[int], children: list[ChildProcess], timeout_s: float = 60
) -> int:
    """An ``smg launch`` child routing to ``upstream_url`` on ``cpus``, once it answers a
    completion (its workers registered); its port. Appended to ``children`` before it
    starts, so the caller stops it whatever happens."""
    exe = smg_executable()
    if exe is None:
        raise RuntimeError("smg is not installed (pip install 'kvroute[smg]')")
    port = free_port()
    child = ChildProcess("proxy-bench smg")
    children.append(child)
    child.start(
        [
            exe,
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            upstream_url,
            "--policy",
            SMG_POLICY,
            "--log-level",
            "warn",
            # its metrics server binds 0.0.0.0:29000 by default: loopback, a free port
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ],
        cpus=cpus,
    )
    # /health answers before the worker is registered: a model list naming the upstream's
    # model says requests will be routed.
    child.wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s, accept=lambda b: b"bench" in b)
    return port
