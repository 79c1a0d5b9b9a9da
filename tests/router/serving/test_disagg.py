"""Prefill/decode disaggregation end to end: simulated replicas with P/D roles (their
NixlConnector-like leases and pulls: bench/sim/disagg.py) behind the router, through the
official openai client, streamed and not, chat and completions; what each leg's body is;
a returning user whose history the decode replica holds skips the prefill; and the
failures (a dead prefill replica, one of two, a prefill without a connector, a decode that
cannot pull) end with zero client errors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvroute.bench.sim.disagg import BOARD
from kvroute.router.config import DisaggSettings
from tests.router.servers import wait_until
from tests.router.sim_fleet import Fleet, make_fleet
from tests.router.sim_replica import ReplicaFaults

LONG = "You are a careful assistant that answers questions about caches and routers. " * 14
ALWAYS = DisaggSettings(mode="always", skip_tokens=8, skip_fraction=0.1)


def _client(fleet: Fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="sk-test", max_retries=0)


def _stats(fleet: Fleet) -> dict[str, Any]:
    return fleet.stats()["disaggregation"]


@pytest.fixture
def pd_fleet(local_tokenizer: Any) -> Iterator[Fleet]:
    """r0 prefill, r1 decode, every eligible request split."""
    with make_fleet(local_tokenizer, 2, roles=["prefill", "decode"], disagg=ALWAYS) as fleet:
        yield fleet


def _legs(fleet: Fleet, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    (prefill,) = [s for s in fleet.fakes[0].seen if s.path == path]
    (decode,) = [s for s in fleet.fakes[1].seen if s.path == path]
    return (
        {"body": prefill.body, "id": prefill.headers.get("x-request-id")},
        {"body": decode.body, "id": decode.headers.get("x-request-id")},
    )


def test_a_split_completion_runs_both_legs_on_vllms_protocol(pd_fleet: Fleet) -> None:
    pulls = BOARD.pulls
    client = _client(pd_fleet)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=LONG, max_tokens=3, extra_body={"min_tokens": 2}
    )
    completion = raw.parse()
    assert raw.headers["x-kvroute-replica"] == "r1"
    assert raw.headers["x-kvroute-prefill-replica"] == "r0"
    # The decode replica's tokens are what an aggregated run generates.
    assert completion.choices[0].text == "".join(pd_fleet.fakes[1].generated_text({"prompt": LONG}))
    prefill, decode = _legs(pd_fleet, "/v1/completions")
    assert prefill["id"] == decode["id"] == raw.headers["x-request-id"]
    p = prefill["body"]
    assert (p["max_tokens"], p["stream"], p["prompt"]) == (1, False, LONG)
    assert "min_tokens" not in p and "stream_options" not in p
    assert p["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    d = decode["body"]
    assert (d["max_tokens"], d["min_tokens"], d["prompt"]) == (3, 2, LONG)
    params = d["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"].startswith("r0-")
    assert params["remote_host"] == "127.0.0.1"  # "localhost" replaced by r0's URL host
    assert params["prompt_token_ids"] == pd_fleet.fakes[1].tokenize_prompt({"prompt": LONG})
    assert BOARD.pulls == pulls + 1
    stats = _stats(pd_fleet)
    assert (stats["split"], stats["prefill_legs"], stats["decode_legs"]) == (1, 1, 1)
    assert stats["loopback_hosts_replaced"] == 1 and stats["bypass_rate"] == 0.0
    assert stats["pools"]["prefill"]["replicas"] == stats["pools"]["decode"]["replicas"] == 1
    # Again: the prefill replica now holds the prompt, and the decode replica reports the
    # prefill's cached tokens as its own, as vLLM does.
    again = client.completions.create(model="tiny", prompt=LONG, max_tokens=3)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == (again.usage.prompt_tokens - 1) // 16 * 16
    r0 = pd_fleet.stats()["replicas"]["r0"]["accuracy"]
    assert r0["delivered_cached_tokens"] == cached


def test_a_split_chat_stream_is_streamed_and_the_decode_replica_announces_the_pulled_blocks(
    pd_fleet: Fleet,
) -> None:
    client = _client(pd_fleet)
    messages = [{"role": "user", "content": LONG}]
    with client.chat.completions.with_streaming_response.create(
        model="tiny",
        messages=messages,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        assert response.headers["x-kvroute-prefill-replica"] == "r0"
        assert response.headers["x-kvroute-replica"] == "r1"
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(pd_fleet.fakes[1].generated_text({"messages": messages}))
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 100
    prefill, decode = _legs(pd_fleet, "/v1/chat/completions")
    assert prefill["body"]["stream"] is False and "stream_options" not in prefill["body"]
    assert prefill["body"]["max_tokens"] == 1
    assert decode["body"]["stream"] is True and decode["body"]["stream_options"]
    # The decode replica cached what it pulled and said so in its KV events: the index now
    # holds the prompt there.
    body = {"model": "tiny", "messages": messages}

    def decode_holds_it() -> bool:
        route = httpx.post(f"{pd_fleet.url}/debug/route", json=body, timeout=5).json()
        return route["replicas"][0]["name"] == "r1" and route["replicas"][0]["match_tokens"] > 100

    wait_until(decode_holds_it, timeout_s=5)
    route = httpx.post(f"{pd_fleet.url}/debug/route", json=body, timeout=5).json()
    assert route["disaggregation"]["decode"] == "r1"
    assert route["disaggregation"]["prefill"] == "r0"
    assert route["disaggregation"]["reason"] == "split_always"


def test_max_completion_tokens_is_capped_too_and_n_above_one_goes_decode_only(
    pd_fleet: Fleet,
) -> None:
    client = _client(pd_fleet)
    messages = [{"role": "user", "content": LONG}]
    client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=3)
    prefill, _ = _legs(pd_fleet, "/v1/chat/completions")
    assert prefill["body"]["max_completion_tokens"] == prefill["body"]["max_tokens"] == 1
    with pytest.raises(openai.BadRequestError):  # the simulator serves n=1 only: its 400
        client.completions.create(model="tiny", prompt=LONG, max_tokens=3, n=2)
    assert len([s for s in pd_fleet.fakes[0].seen if s.path == "/v1/completions"]) == 0
    assert _stats(pd_fleet)["decisions"]["single_replica_request"] == 1


def test_a_returning_user_whose_history_the_decode_replica_holds_skips_the_prefill(
    local_tokenizer: Any,
) -> None:
    auto = DisaggSettings(mode="auto", skip_tokens=8, skip_fraction=0.2)
    with make_fleet(local_tokenizer, 2, roles=["prefill", "decode"], disagg=auto) as fleet:
        client = _client(fleet)
        history = [{"role": "user", "content": LONG}]
        client.chat.completions.create(model="tiny", messages=history, max_tokens=3)
        body = {"model": "tiny", "messages": history}
        wait_until(
            lambda: (
                httpx.post(f"{fleet.url}/debug/route", json=body, timeout=5).json()["replicas"][0][
                    "match_tokens"
                ]
                > 100
            ),
            timeout_s=5,
        )
        turn = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=turn, max_tokens=3
        )
        assert raw.headers["x-kvroute-replica"] == "r1"
        assert "x-kvroute-prefill-replica" not in raw.headers
        assert _stats(fleet)["decisions"]["small_fraction"] == 1
        assert not any(s.path == "/v1/chat/completions" for s in fleet.fakes[0].seen)


def test_a_dead_prefill_pool_falls_back_to_decode_only_with_zero_client_errors(
    local_tokenizer: Any,
) -> None:
    # Health checks 30 s apart: the checker cannot notice the dead replica before the
    # requests do, however slowly a loaded machine runs them (at pd_fleet's 0.2 s it could).
    with make_fleet(
        local_tokenizer, 2, roles=["prefill", "decode"], disagg=ALWAYS, health_interval_s=30.0
    ) as fleet:
        fleet.fakes[0].stop()  # refuses connections; the health checker has not noticed
        client = _client(fleet)
        for i in range(4):
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=f"{LONG} {i}", max_tokens=3
            )
            assert raw.parse().choices[0].text
            assert raw.headers["x-kvroute-replica"] == "r1"
            assert "x-kvroute-prefill-replica" not in raw.headers
        stats = _stats(fleet)
        assert stats["prefill_fallbacks"] >= 1 and stats["prefill_failures"] >= 1


def test_one_of_two_prefill_replicas_killed_the_other_takes_the_prefill(
    local_tokenizer: Any,
) -> None:
    roles = ["prefill", "prefill", "decode"]
    with make_fleet(local_tokenizer, 3, roles=roles, disagg=ALWAYS) as fleet:
        fleet.fakes[0].stop()
        client = _client(fleet)
        prefills = set()
        for i in range(6):
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=f"{i} {LONG}", max_tokens=3
            )
            assert raw.parse().choices[0].text
            prefills.add(raw.headers["x-kvroute-prefill-replica"])
        assert prefills == {"r1"}
        assert _stats(fleet)["prefill_fallbacks"] == 0


def test_a_prefill_answer_without_transfer_params_is_counted_and_decode_recomputes(
    local_tokenizer: Any,
) -> None:
    with make_fleet(
        local_tokenizer, 2, roles=["prefill", "decode"], nixl=[False, True], disagg=ALWAYS
    ) as fleet:
        raw = _client(fleet).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=3
        )
        assert raw.parse().choices[0].text == "".join(
            fleet.fakes[1].generated_text({"prompt": LONG})
        )
        assert "x-kvroute-prefill-replica" not in raw.headers
        (decode,) = [s for s in fleet.fakes[1].seen if s.path == "/v1/completions"]
        assert "kv_transfer_params" not in decode.body
        assert _stats(fleet)["missing_transfer_params"] == 1


def test_a_decode_that_cannot_pull_is_served_again_decode_only(pd_fleet: Fleet) -> None:
    """The decode replica fails the split request (vLLM's kv_load_failure_policy="fail"):
    counted as a transfer failure, and the request is sent again without the params."""
    decode = pd_fleet.fakes[1]
    failing = {"left": 1}
    original = decode.replica.faults

    class FailOnce(type(original)):  # type: ignore[misc]
        @property
        def fail_status(self) -> int | None:  # type: ignore[override]
            if failing["left"]:
                failing["left"] -= 1
                return 500
            return None

        @fail_status.setter
        def fail_status(self, value: int | None) -> None:
            pass

    decode.replica.faults = FailOnce()
    raw = _client(pd_fleet).completions.with_raw_response.create(
        model="tiny", prompt=LONG, max_tokens=3
    )
    assert raw.parse().choices[0].text
    stats = _stats(pd_fleet)
    assert stats["transfer_failures"] == 1
    bodies = [s.body for s in decode.seen if s.path == "/v1/completions"]
    assert "kv_transfer_params" in bodies[0] and "kv_transfer_params" not in bodies[-1]


def test_a_decode_that_could_not_pull_and_recomputed_is_reported(pd_fleet: Fleet) -> None:
    """The pull fails and the decode recomputes (kv_load_failure_policy="recompute"): an
    ordinary 200 the router cannot tell apart, so it reads the decode replica's own
    counter (vllm:nixl_num_failed_transfers) at its scrape: /index/stats, /metrics."""
    gone = {"do_remote_prefill": True, "remote_engine_id": "gone-1", "remote_request_id": "x"}
    answer = _client(pd_fleet).completions.create(
        model="tiny", prompt=LONG, max_tokens=3, extra_body={"kv_transfer_params": gone}
    )
    assert answer.choices[0].text
    wait_until(lambda: _stats(pd_fleet)["pull_failures"] == 1, timeout_s=10)
    stats = pd_fleet.stats()
    assert stats["replicas"]["r1"]["pd_transport"]["nixl_failed_transfers"] == 1
    assert stats["replicas"]["r0"]["pd_transport"]["nixl_failed_transfers"] == 0
    assert stats["disaggregation"]["transfer_failures"] == 0  # no error reached the router
    text = httpx.get(f"{pd_fleet.url}/metrics", timeout=5).text
    assert 'kvroute_pd_failures_total{kind="pull_failure"} 1.0' in text
    assert 'kvroute_pd_transport_total{counter="nixl_failed_transfers",replica="r1"} 1.0' in text


def test_pd_metrics_are_exported(pd_fleet: Fleet) -> None:
    _client(pd_fleet).completions.create(model="tiny", prompt=LONG, max_tokens=3)
    text = httpx.get(f"{pd_fleet.url}/metrics", timeout=5).text
    assert 'kvroute_pd_decisions_total{reason="split_always"} 1.0' in text
    assert 'kvroute_pd_legs_total{leg="prefill"} 1.0' in text


def test_a_prefill_leg_that_never_answers_times_out_and_the_next_one_serves(
    local_tokenizer: Any,
) -> None:
    pd = DisaggSettings(mode="always", prefill_timeout_s=0.5)
    slow = ReplicaFaults(prefill_delay_s=30.0)
    with make_fleet(
        local_tokenizer,
        3,
        roles=["prefill", "prefill", "decode"],
        faults=[slow, ReplicaFaults(), ReplicaFaults()],
        disagg=pd,
    ) as fleet:
        client = _client(fleet)
        for i in range(2):
            raw = client.completions.with_raw_response.create(
                model="tiny", prompt=f"{i} {LONG}", max_tokens=3
            )
            assert raw.parse().choices[0].text
            assert raw.headers["x-kvroute-prefill-replica"] == "r1"
        assert _stats(fleet)["prefill_failures"] >= 1


def test_a_responses_request_is_split_with_its_own_spelling_of_one_token(
    pd_fleet: Fleet,
) -> None:
    client = _client(pd_fleet)
    response = client.responses.create(model="tiny", input=LONG, max_output_tokens=3)
    assert response.output_text
    (prefill,) = [s for s in pd_fleet.fakes[0].seen if s.path == "/v1/responses"]
    body = prefill.body
    assert (body["max_output_tokens"], body["store"], body["stream"]) == (1, False, False)
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert "max_tokens" not in body
    # The simulator's Responses endpoint has no connector: the decode replica recomputes.
    assert _stats(pd_fleet)["missing_transfer_params"] == 1


def test_embeddings_stay_on_the_decode_pool_uncounted(pd_fleet: Fleet) -> None:
    raw = _client(pd_fleet).embeddings.with_raw_response.create(model="tiny", input="hello")
    assert raw.parse().data and raw.headers["x-kvroute-replica"] == "r1"
    assert not any(s.path == "/v1/embeddings" for s in pd_fleet.fakes[0].seen)
    assert sum(_stats(pd_fleet)["decisions"].values()) == 0


def test_the_storage_transports_parameters_reach_the_decode_leg_whole() -> None:
    """connector/pd_store.py's parameters (no ``remote_host``: nothing to rewrite) go to
    the decode leg as the prefill answered them, with the prompt's token ids added."""
    from kvroute.router.config import ReplicaConfig
    from kvroute.router.fleet.replicas import Replica
    from kvroute.router.serving.disagg import decode_body

    named = {"v": 1, "domain": "d", "layout": "ab" * 8, "chunk_tokens": 64, "keys": ["00" * 32]}
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvroute_storage": named,
        "remote_prefill_cached_tokens": 0,
    }
    prefill = Replica(ReplicaConfig(url="http://10.0.0.7:8000", name="p", role="prefill"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}
    out, replaced = decode_body(body, params, prefill, [1, 2, 3])
    assert not replaced
    assert out["kv_transfer_params"] == {**params, "prompt_token_ids": [1, 2, 3]}
    assert out["kv_transfer_params"]["kvroute_storage"] == named
    assert {k: v for k, v in out.items() if k != "kv_transfer_params"} == body


def _decode_replica_busy(fleet: Fleet, seconds: float = 30.0) -> None:
    """The router has ``seconds`` of prefill queued on the decode replica r1: decode only
    and a split's decode leg both wait for it, the whole request on r0 does not."""
    fleet.service.router.backlog.add("r1", "queued ahead", seconds)


def test_a_whole_request_is_served_on_the_prefill_replica_as_one_ordinary_leg(
    local_tokenizer: Any,
) -> None:
    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    with make_fleet(local_tokenizer, 2, roles=["prefill", "decode"], disagg=auto) as fleet:
        _decode_replica_busy(fleet)
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 3}
        route = httpx.post(f"{fleet.url}/debug/route", json=body, timeout=5).json()
        shown = route["disaggregation"]
        assert (shown["reason"], shown["on_prefill"], shown["prefill"]) == (
            "whole_on_prefill",
            True,
            "r0",
        )
        assert shown["on_prefill_s"] < min(shown["decode_only_s"], shown["split_s"])
        raw = _client(fleet).completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=3, extra_body={"min_tokens": 2}
        )
        assert raw.parse().choices[0].text == "".join(
            fleet.fakes[0].generated_text({"prompt": LONG})
        )
        assert raw.headers["x-kvroute-replica"] == "r0"
        assert "x-kvroute-prefill-replica" not in raw.headers
        (served,) = [s for s in fleet.fakes[0].seen if s.path == "/v1/completions"]
        assert "kv_transfer_params" not in served.body
        assert (served.body["max_tokens"], served.body["min_tokens"]) == (3, 2)
        assert not any(s.path == "/v1/completions" for s in fleet.fakes[1].seen)
        stats = _stats(fleet)
        assert stats["decisions"]["whole_on_prefill"] == stats["on_prefill"] == 1
        assert (stats["prefill_legs"], stats["decode_legs"], stats["split"]) == (0, 0, 0)
        assert stats["on_prefill_fallbacks"] == 0
        # Ended: no longer counted decoding there.
        assert fleet.service.router.backlog.decoding("r0") == 0
        text = httpx.get(f"{fleet.url}/metrics", timeout=5).text
        assert 'kvroute_pd_decisions_total{reason="whole_on_prefill"} 1.0' in text


def test_a_whole_request_its_prefill_replica_refuses_goes_to_the_decode_replica(
    local_tokenizer: Any,
) -> None:
    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    with make_fleet(local_tokenizer, 2, roles=["prefill", "decode"], disagg=auto) as fleet:
        _decode_replica_busy(fleet)
        fleet.fakes[0].stop()  # refuses connections; the health checker has not noticed yet
        with _client(fleet).chat.completions.with_streaming_response.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=3, stream=True
        ) as response:
            assert response.headers["x-kvroute-replica"] == "r1"
            chunks = list(response.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stats = _stats(fleet)
        assert stats["decisions"]["whole_on_prefill"] == 1
        assert stats["on_prefill_fallbacks"] == 1
        (served,) = [s for s in fleet.fakes[1].seen if s.path == "/v1/chat/completions"]
        assert "kv_transfer_params" not in served.body


def test_a_prefill_replica_killed_while_computing_a_whole_request_leaves_no_client_error(
    local_tokenizer: Any,
) -> None:
    """Killed like a crashed process (connections dropped) while the prompt computes:
    nothing was relayed yet, so the request goes to the decode replica."""
    import threading

    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    slow = ReplicaFaults(prefill_delay_s=30.0)
    with make_fleet(
        local_tokenizer,
        2,
        roles=["prefill", "decode"],
        faults=[slow, ReplicaFaults()],
        disagg=auto,
    ) as fleet:
        _decode_replica_busy(fleet)
        prefill = fleet.fakes[0]
        answers: list[Any] = []

        def ask() -> None:
            with _client(fleet).chat.completions.with_streaming_response.create(
                model="tiny",
                messages=[{"role": "user", "content": LONG}],
                max_tokens=3,
                stream=True,
            ) as response:
                chunks = list(response.parse())
                answers.append((response.headers["x-kvroute-replica"], chunks))

        asker = threading.Thread(target=ask)
        asker.start()
        wait_until(lambda: any(s.path == "/v1/chat/completions" for s in prefill.seen), 10)
        prefill._run(prefill.replica.kill())
        asker.join(timeout=20)
        ((replica, chunks),) = answers
        assert replica == "r1"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stats = _stats(fleet)
        assert stats["decisions"]["whole_on_prefill"] == 1
        assert stats["on_prefill_fallbacks"] == 1
        assert fleet.service.router.backlog.decoding("r0") == 0


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_whole_streamed_answer_whose_prefill_replica_dies_mid_answer_is_finished_on_decode(
    local_tokenizer: Any, kind: str
) -> None:
    """r0's connection breaks after two chunks, as when vLLM crashes mid-answer: the router
    goes on from the ids it streamed on r1 (a /v1/completions request of the prompt's ids
    plus those), and the client gets one answer, the one an unbroken run gives (the
    simulator's next token is a function of the context, as greedy decoding's is)."""
    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    dying = ReplicaFaults(die_after_chunks=2)
    with make_fleet(
        local_tokenizer,
        2,
        roles=["prefill", "decode"],
        faults=[dying, ReplicaFaults()],
        disagg=auto,
    ) as fleet:
        _decode_replica_busy(fleet)
        client = _client(fleet)
        usage = {"include_usage": True}
        if kind == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": LONG}]}
            with client.chat.completions.with_streaming_response.create(
                model="tiny", max_tokens=8, stream=True, stream_options=usage, **body
            ) as response:
                headers, chunks = response.headers, list(response.parse())
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            path = "/v1/chat/completions"
        else:
            body = {"prompt": LONG}
            with client.completions.with_streaming_response.create(
                model="tiny", max_tokens=8, stream=True, stream_options=usage, **body
            ) as response:
                headers, chunks = response.headers, list(response.parse())
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            path = "/v1/completions"
        assert headers["x-kvroute-replica"] == "r0"
        assert text == "".join(fleet.fakes[0].generated_text(body, 8))
        # One answer: the original's id throughout, usage counted from the original prompt.
        assert len({c.id for c in chunks}) == 1
        prompt = fleet.fakes[0].tokenize_prompt(body)
        final = chunks[-1].usage
        assert final is not None
        assert (final.prompt_tokens, final.completion_tokens) == (len(prompt), 8)
        # The ids asked for on the client's behalf are not shown to it.
        assert all(getattr(c.choices[0], "token_ids", None) is None for c in chunks if c.choices)
        (served,) = [s for s in fleet.fakes[0].seen if s.path == path]
        assert served.body["return_token_ids"] is True
        (cont,) = [s for s in fleet.fakes[1].seen if s.path == "/v1/completions"]
        streamed = cont.body["prompt"][len(prompt) :]
        assert cont.body["prompt"][: len(prompt)] == prompt and 0 < len(streamed) < 8
        assert cont.body["max_tokens"] == 8 - len(streamed)
        stats = _stats(fleet)
        assert stats["decisions"]["whole_on_prefill"] == 1
        assert (stats["resumed_streams"], stats["resume_failures"]) == (1, 0)
        assert fleet.service.router.backlog.decoding("r0") == 0


def test_a_whole_answer_no_replica_can_finish_ends_in_an_error_event_and_is_counted(
    local_tokenizer: Any,
) -> None:
    """Both replicas break after two chunks: the continuation on r1 breaks too, and with no
    replica left the client gets an error event (as from any replica dying mid-answer)."""
    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    dying = [ReplicaFaults(die_after_chunks=2), ReplicaFaults(die_after_chunks=2)]
    with make_fleet(
        local_tokenizer, 2, roles=["prefill", "decode"], faults=dying, disagg=auto
    ) as fleet:
        _decode_replica_busy(fleet)
        with (
            pytest.raises(openai.APIError, match="not resumed: no other replica"),
            _client(fleet).completions.with_streaming_response.create(
                model="tiny", prompt=LONG, max_tokens=12, stream=True
            ) as response,
        ):
            list(response.parse())
        stats = _stats(fleet)
        assert (stats["resumed_streams"], stats["resume_failures"]) == (1, 1)
        text = httpx.get(f"{fleet.url}/metrics", timeout=5).text
        assert 'kvroute_pd_failures_total{kind="resume_failure"} 1.0' in text


def test_a_streamed_request_that_could_not_be_resumed_is_not_served_whole_on_prefill(
    local_tokenizer: Any,
) -> None:
    auto = DisaggSettings(mode="auto", skip_tokens=8, whole_on_prefill=True)
    with make_fleet(local_tokenizer, 2, roles=["prefill", "decode"], disagg=auto) as fleet:
        _decode_replica_busy(fleet)
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 3,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        }
        for stream, on_prefill in ((False, True), (True, False)):
            route = httpx.post(
                f"{fleet.url}/debug/route", json={**body, "stream": stream}, timeout=5
            ).json()
            assert route["disaggregation"]["on_prefill"] is on_prefill
        with _client(fleet).chat.completions.with_streaming_response.create(
            stream=True, **body
        ) as response:
            assert response.headers["x-kvroute-replica"] != "r0"
            list(response.parse())
        assert _stats(fleet)["decisions"]["whole_on_prefill"] == 0
