"""kvroute KV offloading connector for vLLM v1.

Only ``connector.kvroute_connector`` (the vLLM adapter) and ``connector.events`` import
vLLM. Every other module here (config, keys, bookkeeping, planner, tiers, file format,
transfer, worker executor) needs only torch, so it can be unit-tested and benchmarked
without a vLLM install.
"""

from __future__ import annotations

__all__ = ["ConnectorConfig"]

from connector.config import ConnectorConfig
