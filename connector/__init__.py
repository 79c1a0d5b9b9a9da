"""kvroute KV offloading connector for vLLM v1.

Only ``kvroute.connector.kvroute_connector`` (the vLLM adapter), ``kvroute.connector.events`` and
``kvroute.connector.vllm_extras`` import vLLM. Every other module here (config, keys, extra
keys, identity, bookkeeping, planner, tiers, file format, disk scan, transfer, copiers,
copy ledger, worker executor) needs only torch, so it can be unit-tested and
benchmarked without a vLLM install.
"""

from __future__ import annotations

__all__ = ["ConnectorConfig"]

from kvroute.connector.config import ConnectorConfig

if __name__ == "connector":  # the pre-namespace name, found in a source tree on sys.path
    from kvroute.old_connector_path import redirect

    redirect()
