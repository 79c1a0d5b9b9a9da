"""The local tokenizer checked on live traffic: a replica whose chat template differs is
detected, its model switched to remote tokenization (hits come back), and switched back
after clean checks. Render endpoints preferred, /tokenize when they answer 403. Per-model
tokenizers and LoRA adapters. Real HTTP servers on 127.0.0.1 (simulated vLLM replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvroute.router.app import create_app
from kvroute.router.config import ModelTokenizerConfig, ReplicaConfig, RouterSettings
from kvroute.router.tokens.remote_tokens import RemoteTokenizer
from kvroute.router.tokens.requests import parse_body
from kvroute.router.tokens.tokenization import LocalTokenizer
from tests.router.servers import ServerThread, wait_until
from tests.router.sim_fleet import make_fleet
from tests.router.sim_replica import SimServer

# What a replica started with another --chat-template renders: nothing like ChatML.
OTHER_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### ASSISTANT:{% endif %}"
)
SYSTEM = "You are the switch test assistant. " + "Cache me if you can, block by block. " * 12


def _chat(n: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {n}"}]


def _predicted(url: str, messages: list[dict[str, str]], model: str = "tiny") -> int:
    body = {"model": model, "messages": messages}
    decision = httpx.post(f"{url}/debug/route", json=body, timeout=10).json()
    chosen = decision["chosen"]
    return next(v["predicted_cached_tokens"] for v in decision["replicas"] if v["name"] == chosen)


def _model_state(url: str, model: str = "tiny") -> dict[str, Any]:
    return httpx.get(f"{url}/index/stats", timeout=5).json()["tokenizer"]["models"].get(model, {})


def _metric(url: str, line_start: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_mismatch_on_live_traffic_switches_to_remote_and_back(
    local_tokenizer: LocalTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="kvroute.router.tokens.token_check")
    with make_fleet(
        local_tokenizer, n=1, tokenizer_check_every=2, tokenizer_clean_checks=2, hint_ttl_s=0
    ) as fleet:
        fake = fleet.fakes[0]
        fake.replica.config.chat_template = OTHER_TEMPLATE  # another --chat-template
        client = OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="tiny", messages=_chat(0), max_tokens=2)
        wait_until(lambda: fleet.stats()["replicas"]["r0"]["entries"] > 0)
        # The replica holds the system prompt, but the router's ids are not the replica's:
        # a silent zero. (Request 2 of this model: the sampled one; its check starts now.)
        assert _predicted(fleet.url, _chat(1)) == 0
        wait_until(lambda: _model_state(fleet.url)["mode"] == "remote", timeout_s=10)
        state = _model_state(fleet.url)
        assert state["mismatches"] == 1 and state["switches_to_remote"] == 1
        detail = state["last_mismatch"]
        assert detail["first_difference"] == 0
        assert detail["router_ids"] != detail["replica_ids"]
        # Started without --enable-scale-out, the replica answers render with a 403.
        assert detail["replica_source"] == "tokenize"
        # Hits come back: the router now keys with the replica's own ids.
        assert _predicted(fleet.url, _chat(2)) > 0
        assert _metric(fleet.url, 'kvroute_tokenizer_mismatches_total{model="tiny"}') == 1.0
        assert _metric(fleet.url, 'kvroute_tokenizer_mode{mode="remote",model="tiny"}') == 1.0
        # While remote it keeps sampling; more mismatches are counted, not logged again.
        for n in range(3, 7):
            client.chat.completions.create(model="tiny", messages=_chat(n), max_tokens=2)
        wait_until(lambda: _model_state(fleet.url)["mismatches"] >= 2, timeout_s=10)
        assert _model_state(fleet.url)["mode"] == "remote"
        errors = [r for r in caplog.records if "MISMATCH" in r.getMessage()]
        assert len(errors) == 1 and errors[0].levelno == logging.ERROR
        assert "position 0" in errors[0].getMessage()
        # The replica is fixed (restarted with the model's template): clean checks return
        # the model to local tokenization after 2 in a row.
        fake.replica.config.chat_template = None
        n = 10
        while _model_state(fleet.url)["mode"] != "local" and n < 40:
            client.chat.completions.create(model="tiny", messages=_chat(n), max_tokens=2)
            n += 1
            with contextlib.suppress(AssertionError):
                wait_until(lambda: fleet.service.tokenizer.check._task.done(), timeout_s=5)
        state = _model_state(fleet.url)
        assert state["mode"] == "local" and state["clean_streak"] >= 2
        assert _metric(fleet.url, 'kvroute_tokenizer_mode{mode="local",model="tiny"}') == 1.0
        assert len([r for r in caplog.records if "MISMATCH" in r.getMessage()]) == 1


def test_checks_never_delay_requests_and_skip_when_busy(local_tokenizer: LocalTokenizer) -> None:
    with make_fleet(local_tokenizer, n=1, tokenizer_check_every=1) as fleet:
        # A check takes 3 s at least: a request that waited for its check would take that
        # long on its own, while four that do not take a fraction of it even on a busy machine.
        fleet.fakes[0].faults.tokenize_delay_s = 3.0
        client = OpenAI(base_url=f"{fleet.url}/v1", api_key="x", max_retries=0)
        start = time.monotonic()
        for n in range(4):
            client.chat.completions.create(model="tiny", messages=_chat(100 + n), max_tokens=2)
        assert time.monotonic() - start < 3.0  # requests never wait for their checks
        state = _model_state(fleet.url)
        assert state["requests"] == 4 and state["skipped_busy"] >= 2  # one check at a time
        wait_until(lambda: _model_state(fleet.url)["checks"] == 1, timeout_s=10)
        assert _model_state(fleet.url)["mode"] == "local"


def _remote(url: str) -> RemoteTokenizer:
    return RemoteTokenizer(httpx.AsyncClient(trust_env=False), lambda model: url)


def _req(body: dict[str, Any], kind: str = "chat"):
    return parse_body(json.dumps({"model": "tiny", **body}).encode(), kind)


def test_render_is_preferred_and_403_falls_back_to_tokenize(tiny_model_dir: Path) -> None:
    fake = SimServer("r", tiny_model_dir, scale_out=True, chat_template=OTHER_TEMPLATE)
    with fake as server:

        async def go() -> None:
            remote = _remote(server.url)
            req = _req({"messages": _chat(1), "truncate_prompt_tokens": 7})
            got = await remote.prompt(req)
            assert got.source == "render"
            full = fake.tokenize_prompt({"model": "tiny", "messages": _chat(1)})
            assert got.tokens == full[-7:]
            img = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
            mm = _req(
                {"messages": [{"role": "user", "content": [img, {"type": "text", "text": "?"}]}]}
            )
            got = await remote.prompt(mm)
            assert [(m.offset, m.length) for m in got.mm] == [(0, 1)]
            assert got.mm[0].identifier
            completion = await remote.prompt(_req({"prompt": "hello there"}, "completion"))
            assert completion.tokens == fake.tokenize_prompt({"prompt": "hello there"})
            assert {s.path for s in fake.seen} == {
                "/v1/chat/completions/render",
                "/v1/completions/render",
            }
            # A replica without --enable-scale-out: 403, asked once, then /tokenize.
            fake.replica.config.scale_out = False
            fake.seen.clear()
            other = _remote(server.url)
            for n in range(3):
                got = await other.prompt(_req({"messages": _chat(10 + n)}))
                assert got.source == "tokenize"
                assert got.tokens == fake.tokenize_prompt(
                    {"model": "tiny", "messages": _chat(10 + n)}
                )
            paths = [s.path for s in fake.seen]
            assert paths.count("/v1/chat/completions/render") == 1
            assert paths.count("/tokenize") == 3
            assert other.stats()["no_render"][0]["reason"].startswith("403")
            # /tokenize knows no truncation: the router applies vLLM's (the last k ids).
            cut = await other.prompt(_req({"messages": _chat(20), "truncate_prompt_tokens": 4}))
            assert cut.tokens == fake.tokenize_prompt({"model": "tiny", "messages": _chat(20)})[-4:]

        asyncio.run(go())


@contextlib.contextmanager
def _two_model_fleet(
    tiny_model_dir: Path, tmp_path: Path, **settings_kw: Any
) -> Iterator[tuple[ServerThread, list[SimServer]]]:
    """Replica r0 serves `tiny` (and LoRA `ad1`), r1 serves `other` with its own template;
    the router loads a tokenizer per model from settings."""
    template_file = tmp_path / "other.jinja"
    template_file.write_text(OTHER_TEMPLATE)
    with contextlib.ExitStack() as stack:
        fakes, configs = [], []
        for i, (model, template, loras) in enumerate(
            [("tiny", None, ["ad1"]), ("other", OTHER_TEMPLATE, [])]
        ):
            fake = SimServer(
                f"r{i}", tiny_model_dir, model=model, loras=loras, chat_template=template
            )
            stack.enter_context(fake)
            fakes.append(fake)
            configs.append(ReplicaConfig(fake.url, fake.events, fake.replay, name=f"r{i}"))
        settings = RouterSettings(
            replicas=configs,
            health_interval_s=0.2,
            tokenizer_check_on_start=False,
            model_tokenizers={
                "tiny": ModelTokenizerConfig(str(tiny_model_dir)),
                "other": ModelTokenizerConfig(
                    str(tiny_model_dir), chat_template=str(template_file)
                ),
            },
            **settings_kw,
        )
        router = stack.enter_context(ServerThread(create_app(settings)))
        service = router.app.state.service
        wait_until(lambda: len(service.registry.healthy()) == 2, timeout_s=20)
        yield router, fakes


def test_two_models_two_tokenizers_and_a_lora_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    with _two_model_fleet(tiny_model_dir, tmp_path, tokenizer_check_every=1) as (router, fakes):
        url = router.url
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        # Each model's local ids equal its replica's (template per model): no mismatch.
        for model in ("tiny", "other"):  # one check in flight at a time: one model each
            client.chat.completions.create(model=model, messages=_chat(1), max_tokens=2)
            wait_until(lambda m=model: _model_state(url, m).get("checks", 0) >= 1, timeout_s=10)
        client.chat.completions.create(model="ad1", messages=_chat(1), max_tokens=2)
        for model in ("tiny", "other"):
            state = _model_state(url, model)
            assert state["mode"] == "local" and state["mismatches"] == 0, (model, state)
        # The adapter is tokenized (and checked) as its base model, keyed by its own name.
        assert "ad1" not in httpx.get(f"{url}/index/stats").json()["tokenizer"]["models"]
        assert [s.path for s in fakes[1].seen if s.body.get("model") == "ad1"] == []
        wait_until(lambda: _predicted(url, _chat(2), "other") > 0)
        wait_until(lambda: _predicted(url, _chat(2), "ad1") > 0)
        decision = httpx.post(
            f"{url}/debug/route", json={"model": "ad1", "messages": _chat(3)}
        ).json()
        assert decision["lora_name"] == "ad1" and decision["ranked"] == ["r0"]
        # The adapter's blocks are keyed with its name: the base model does not match them.
        lora_only = [{"role": "system", "content": "Adapter only. " * 40}, _chat(0)[1]]
        client.chat.completions.create(model="ad1", messages=lora_only, max_tokens=2)
        wait_until(lambda: _predicted(url, lora_only, "ad1") > 0)
        assert _predicted(url, lora_only, "tiny") == 0


def test_a_new_lora_adapter_is_routable_as_soon_as_a_replica_lists_it(
    local_tokenizer: LocalTokenizer,
) -> None:
    with make_fleet(local_tokenizer, n=1, models_refresh_s=300) as fleet:
        url = f"{fleet.url}/v1/chat/completions"
        body = {"model": "ad2", "messages": _chat(1), "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=10).status_code == 404
        load = {"lora_name": "ad2", "lora_path": "/loras/ad2"}
        loaded = httpx.post(f"{fleet.fakes[0].url}/v1/load_lora_adapter", json=load, timeout=10)
        assert loaded.status_code == 200, loaded.text
        start = time.monotonic()
        wait_until(lambda: httpx.post(url, json=body, timeout=10).status_code == 200, 5)
        assert time.monotonic() - start < 5  # not the 300 s models refresh
        decision = httpx.post(f"{fleet.url}/debug/route", json=body, timeout=10).json()
        assert decision["lora_name"] == "ad2"
