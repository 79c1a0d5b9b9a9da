"""kvroute KV offloading connector for vLLM v1.

Only ``connector.kvroute_connector`` (the vLLM adapter), ``connector.events`` and
``connector.vllm_extras`` import vLLM. Every other module here (config, keys, extra
keys, identity, bookkeeping, planner, tiers, file format, disk scan, transfer, copiers,
copy ledger, worker executor) needs only torch, so it can be unit-tested and
benchmarked without a vLLM install.
"""

from __future__ import annotations

__all__ = ["ConnectorConfig"]

from connector.config import ConnectorConfig
