"""A Ray Serve app of simulated engines, for kvroute's request router without vLLM.

``SimEngine`` is a Serve deployment whose replicas each run one simulated engine
(``SimReplica``'s scheduler, prefix cache and KV-event publisher, no HTTP of its own) and
advertise its event stream as ``KVRouteLLMServer`` does (``kvroute_kv_events`` in the replica
metadata and the routing stats). ``SimIngress`` holds the handle to it, as Ray Serve LLM's
``OpenAiIngress`` holds the ``LLMServer``'s: the deployment's request router runs in the
ingress replica's process. ``build_app`` wires them; the router is kvroute's unless another
``request_router_class`` is given (Ray's ``PrefixCacheAffinityRouter``, to compare).

A request is an OpenAI body (a dict): chat (``messages``) or completion (``prompt``); the
answer says which replica served it and how many prompt tokens it found cached, as vLLM's
``usage.prompt_tokens_details.cached_tokens`` does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.handle import DeploymentHandle

from kvroute.bench.sim.replica import SimReplica, SimReplicaConfig
from kvroute.bench.sim.tokenizer import SimTokenizer
from kvroute.router.ray.endpoints import METADATA_KEY

__all__ = [
    "KVROUTE_ROUTER",
    "ChatRequest",
    "CompletionRequest",
    "SimEngine",
    "SimIngress",
    "build_app",
]

KVROUTE_ROUTER = "kvroute.router.ray.request_router:KVRouteRequestRouter"


class ChatRequest(BaseModel):
    """What the ingress hands the engines' handle, as Ray Serve LLM's ingress hands its
    ``ChatCompletionRequest`` (a pydantic model with ``messages``: what Ray's own routers
    read); other OpenAI fields ride along."""

    model_config = ConfigDict(extra="allow")
    model: str
    messages: list[dict[str, Any]]


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | list[int]


def _request(body: dict[str, Any]) -> BaseModel:
    return ChatRequest(**body) if "messages" in body else CompletionRequest(**body)


class SimEngine:
    """One simulated engine per replica (module doc)."""

    async def __init__(
        self, model_dir: str, model: str = "tiny", block_size: int = 16, gpu_blocks: int = 4096
    ) -> None:
        context = serve.get_replica_context()
        self.name = context.replica_id.unique_id
        self.model_dir = model_dir
        self.tokenizer = SimTokenizer(model_dir)  # type: ignore[arg-type]
        config = SimReplicaConfig(
            name=self.name, model=model, block_size=block_size, gpu_blocks=gpu_blocks
        )
        self.engine = SimReplica(config, self.tokenizer)
        await self.engine.start_engine("127.0.0.1", 0)

    def _advertised(self) -> dict[str, Any]:
        return {
            METADATA_KEY: {
                "endpoint": self.engine.events_endpoint,
                "replay_endpoint": self.engine.replay_endpoint,
                "topic": self.engine.topic,
                "block_size": self.engine.config.block_size,
            },
            "model_source": self.model_dir,
        }

    def record_replica_metadata(self) -> dict[str, Any]:
        return self._advertised()

    def record_routing_stats(self) -> dict[str, Any]:
        return self._advertised()

    def _prompt(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            return self.tokenizer.encode_chat(body["messages"])
        prompt = body["prompt"]
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    async def chat(self, request: BaseModel | dict[str, Any]) -> dict[str, Any]:
        body = request if isinstance(request, dict) else request.model_dump()
        prompt = self._prompt(body)
        gen = None
        async for state, _ in self.engine.generate(prompt, int(body.get("max_tokens") or 4)):
            gen = state
        assert gen is not None
        return {
            "replica": self.name,
            "usage": {
                "prompt_tokens": gen.prompt_tokens,
                "completion_tokens": len(gen.output),
                "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
            },
        }


class SimIngress:
    """Holds the engines' handle: the request router runs here."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine

    async def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.engine.chat.remote(_request(body))

    def router_stats(self) -> list[dict[str, Any]]:
        """The stats of the kvroute routers in this process (none with another router)."""
        from kvroute.router.ray.fleet import router_stats

        return router_stats()


def build_app(
    model_dir: str,
    *,
    replicas: int = 2,
    block_size: int = 16,
    request_router_class: str = KVROUTE_ROUTER,
    request_router_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The ingress bound to ``replicas`` simulated engines routed by ``request_router_class``."""
    kwargs = dict(request_router_kwargs or {})
    engine = serve.deployment(
        SimEngine,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=64,
        request_router_config={
            "request_router_class": request_router_class,
            "request_router_kwargs": kwargs,
        },
    )
    ingress = serve.deployment(SimIngress, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(model_dir, block_size=block_size))
