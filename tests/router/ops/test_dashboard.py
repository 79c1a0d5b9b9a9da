"""The dashboard page in a real browser (headless Chromium), against a real router.

A router process (as ``kvroute serve`` runs it) in front of four simulated replicas
(bench/sim: vLLM's API and KV events, with CPU and disk tiers) under chat traffic: the page
renders, its numbers are those of ``/index/stats`` (replica count, health, feed state, entries
per tier of every replica), its decision log names the replica that served the last request,
and it updates as more traffic arrives. A second page is served over 100 replicas to check
that the replica table stays readable (pages, sorting, filtering). A screenshot is saved in
the test's tmp dir (and to ``KVROUTE_DASHBOARD_SCREENSHOT`` when set: that is how
docs/img/dashboard.png is made).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvroute.bench.sim.fleet import SimFleet, SimFleetConfig
from kvroute.bench.sim.latency import LatencyModel
from kvroute.deploy.router_process import RouterProcess
from kvroute.router.config import ReplicaConfig, RouterSettings
from kvroute.router.ops.dashboard import add_dashboard
from kvroute.router.ops.dashboard_data import DashboardData
from kvroute.router.routing.policies import POLICY_REASONS
from kvroute.router.service import RouterService
from kvroute.router.serving.auth import ApiKeyMiddleware
from tests.router.browser import chromium, text_of, wait_for
from tests.router.servers import ServerThread

MODEL = "kvroute-sim"
REPLICAS = 4
TIERS = ("GPU", "CPU", "STORAGE")
ROLES = ("prefill", "decode", "both", "both")  # the hundred: a P/D fleet beside aggregated ones


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[SimFleet, RouterProcess]]:
    config = SimFleetConfig(
        replicas=REPLICAS,
        # Small device caches so that blocks move down to the CPU and disk tiers.
        gpu_blocks=48,
        cpu_blocks=40,
        storage_blocks=256,
        max_num_seqs=16,
        max_model_len=4096,
        default_max_tokens=4,
        latency=LatencyModel(time_scale=0.01),
        stream_interval_s=0.002,
    )
    with SimFleet(config) as fleet:
        settings = fleet.router_settings(health_interval_s=0.5)
        with RouterProcess(settings) as proc:
            assert proc.wait_feeds_settled(30)
            yield fleet, proc


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    d = chromium()
    try:
        yield d
    finally:
        d.quit()


def _chat(client: httpx.Client, tenant: int, turn: int) -> httpx.Response:
    system = f"You serve tenant {tenant}. " + "Keep every answer short and exact. " * 24
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {turn} of tenant {tenant}?"},
        ],
        "max_tokens": 4,
    }
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    return resp


def _traffic(url: str, n: int, start: int = 0) -> None:
    with httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _chat(client, i % 10, start + i), range(n)))


def _stable_stats(url: str, timeout_s: float = 15.0) -> dict[str, Any]:
    """/index/stats once its entries stop moving (the last events have been applied)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/index/stats", timeout=10).json()
        view = {n: r.get("entries_by_tier") for n, r in stats["replicas"].items()}
        if view == last:
            return stats
        last = view
        time.sleep(0.5)
    pytest.fail("the index never settled")


# The page re-renders on every poll: read what it shows in one script call (atomic between
# renders) instead of holding element references that a render makes stale.
_READ_PAGE = """
const ids = {};
for (const n of document.querySelectorAll("[id]")) {
  if (!n.children.length) ids[n.id] = n.textContent;
}
const rows = [...document.querySelectorAll("#replicas tbody tr[data-replica]")].map((tr) => {
  const row = {name: tr.dataset.replica};
  for (const td of tr.querySelectorAll("td[data-field]")) row[td.dataset.field] = td.textContent;
  return row;
});
const decisions = [...document.querySelectorAll("#decisions tbody tr[data-chosen]")].map((tr) => ({
  chosen: tr.dataset.chosen, reason: tr.dataset.reason,
  prompt_tokens: tr.querySelector('[data-field="prompt_tokens"]').textContent,
  candidates: [...tr.querySelectorAll(".cand")].map((c) => c.dataset.candidate),
  highlighted: [...tr.querySelectorAll(".cand.chosen")].map((c) => c.textContent),
  highlighted_names: [...tr.querySelectorAll(".cand.chosen")].map((c) => c.dataset.candidate),
}));
const line = (k) => {
  const p = document.querySelector(`path[data-series="${k}"]`);
  return p ? p.getAttribute("d").trim() : "";
};
return {ids, rows, decisions, predicted_line: line("predicted_hit_rate"),
        bars: document.querySelectorAll("#requests-chart rect[data-replica]").length};
"""


def _page(driver: Any) -> dict[str, Any]:
    return driver.execute_script(_READ_PAGE)


def _rows(driver: Any) -> dict[str, dict[str, str]]:
    return {r["name"]: r for r in _page(driver)["rows"]}


def _int(text: str | None) -> int:
    return int(text.replace(",", "")) if text not in (None, "", "\u2013") else -1  # en dash: none


def test_dashboard_renders_the_router_view_and_updates(
    router: tuple[SimFleet, RouterProcess], driver: Any, tmp_path: Path
) -> None:
    _, proc = router
    _traffic(proc.url, 40)
    stats = _stable_stats(proc.url)
    tiers_used = {
        t for r in stats["replicas"].values() for t, n in r["entries_by_tier"].items() if n
    }
    assert set(TIERS) <= tiers_used, stats["fleet"]["entries_by_tier"]

    driver.get(f"{proc.url}/dashboard?interval_ms=500")
    assert driver.title == "kvroute dashboard"
    wait_for(driver, lambda d: text_of(d, "#replica-count") == str(REPLICAS), what="replica count")
    ids = _page(driver)["ids"]
    assert ids["healthy-count"] == str(stats["fleet"]["healthy_replicas"])
    assert ids["feeds-live"] == f"{REPLICAS} / {REPLICAS}"

    # Every replica's row holds /index/stats's numbers: health, feed state, each tier.
    want = {
        name: {
            "health": "ok" if r["health"]["healthy"] else "down",
            "freshness": r["freshness"],
            **{t: r["entries_by_tier"].get(t, 0) for t in TIERS},
        }
        for name, r in stats["replicas"].items()
    }

    def shown(d: Any) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "health": row["health"],
                "freshness": row["freshness"],
                **{t: _int(row[t]) for t in TIERS},
            }
            for name, row in _rows(d).items()
        }

    wait_for(driver, lambda d: shown(d) == want, what=f"replica rows equal to {want}")
    # Each row's role, and the prefill rate it is priced with (seconds per 1,000 tokens, as
    # /index/stats has it) with the samples behind it.
    rows = _rows(driver)
    for name, r in stats["replicas"].items():
        assert rows[name]["role"] == r["role"] == "both"
        shown_rate = float(rows[name]["prefill_s_per_1k"])
        assert shown_rate == pytest.approx(1000 * r["cost_rates"]["prefill_s_per_token"], rel=0.01)
    assert driver.execute_script('return document.getElementById("pd").hidden') is True
    entries = stats["fleet"]["entries_by_tier"]
    wait_for(
        driver,
        lambda d: all(_int(_page(d)["ids"][f"fleet-{t}"]) == entries.get(t, 0) for t in TIERS),
        what="fleet entries per tier",
    )

    # The newest decision is the last request's: the replica that answered, its reason.
    with httpx.Client(base_url=proc.url, timeout=30) as client:
        last = _chat(client, 3, 999)
    served = last.headers["x-kvroute-replica"]
    prompt_tokens = last.json()["usage"]["prompt_tokens"]

    def newest(d: Any) -> Any:
        found = _page(d)["decisions"]
        return found[0] if found and _int(found[0]["prompt_tokens"]) == prompt_tokens else None

    row = wait_for(driver, newest, what="the last request in the decision log")
    assert row["chosen"] == served
    assert row["reason"] in POLICY_REASONS
    assert set(row["candidates"]) == set(stats["replicas"])
    assert row["highlighted_names"] == [served]
    assert row["highlighted"][0].endswith(" ms")  # its estimated TTFT (kvroute policy)

    # More traffic: the routed request count moves by exactly that much.
    before = 41
    wait_for(driver, lambda d: _int(text_of(d, "#requests-total")) == before, what="41 requests")
    _traffic(proc.url, 12, start=100)
    wait_for(
        driver, lambda d: _int(text_of(d, "#requests-total")) == before + 12, what="count update"
    )
    wait_for(driver, lambda d: _page(d)["predicted_line"], what="a hit-rate line")
    page = _page(driver)
    assert page["ids"]["status"].startswith("live")
    assert page["bars"] == REPLICAS

    target = os.environ.get("KVROUTE_DASHBOARD_SCREENSHOT")
    if target:  # for the docs: a few waves of traffic, so the charts have some history
        for wave in range(8):
            _traffic(proc.url, 8 + 4 * (wave % 3), start=200 + 20 * wave)
            time.sleep(1.0)
        time.sleep(1.0)
    shot = tmp_path / "dashboard.png"
    assert driver.save_screenshot(str(shot))
    assert shot.stat().st_size > 20_000
    if target:
        shutil.copyfile(shot, target)


@pytest.fixture(scope="module")
def hundred() -> Iterator[ServerThread]:
    """The dashboard over a real RouterService with 100 replicas (not started: no traffic,
    no feeds), each given its own load and a role, so the page can be checked at fleet scale."""
    configs = [
        ReplicaConfig(url=f"http://127.0.0.1:9/r{i}", name=f"r{i:03d}", role=ROLES[i % 4])
        for i in range(100)
    ]
    service = RouterService(RouterSettings(replicas=configs, policy="round_robin"))
    for i, config in enumerate(configs):
        replica = service.add_replica(config)
        replica.healthy = i % 10 != 7
        replica.set_gauges(running=(i * 37) % 50, waiting=i % 3, kv_usage=((i * 13) % 100) / 100)
    app = FastAPI()
    add_dashboard(app, DashboardData(service).snapshot)
    server = ServerThread(app).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_hundred_replicas_are_paged_sorted_and_filtered(
    hundred: ServerThread, driver: Any
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver.get(f"{hundred.url}/dashboard?interval_ms=500")
    wait_for(driver, lambda d: text_of(d, "#replica-count") == "100", what="replica count")
    assert text_of(driver, "#healthy-count") == "90"

    def names() -> list[str]:
        return [r["name"] for r in _page(driver)["rows"]]

    assert len(names()) == 20
    assert text_of(driver, "#page-info").startswith("1-20 of 100")
    # Sorted by load: the most pending first (running (37 i mod 50) + waiting (i mod 3)).
    pending = {f"r{i:03d}": (i * 37) % 50 + i % 3 for i in range(100)}
    busiest = sorted(pending, key=lambda n: (-pending[n], n))
    assert names() == busiest[:20]
    driver.find_element(By.ID, "next").click()
    assert text_of(driver, "#page-info").startswith("21-40 of 100")
    assert names() == busiest[20:40]
    Select(driver.find_element(By.ID, "sort")).select_by_value("problems")
    assert text_of(driver, "#page-info").startswith("1-20 of 100")
    health = [r["health"] for r in _page(driver)["rows"]]
    assert health == ["down"] * 10 + ["ok"] * 10
    driver.find_element(By.ID, "filter").send_keys("r09")
    assert sorted(names()) == [f"r09{i}" for i in range(10)]
    assert text_of(driver, "#requests-chart-note") == "top 10 of 100"

    # The P/D panel: each pool's replicas and healthy ones (every tenth replica is down).
    pools = driver.execute_script(
        """return [...document.querySelectorAll("#pd-pools tbody tr")].map((tr) =>
             [...tr.children].map((td) => td.textContent));"""
    )
    down = {role: sum(1 for i in range(7, 100, 10) if ROLES[i % 4] == role) for role in ROLES}
    assert driver.execute_script('return document.getElementById("pd").hidden') is False
    assert [row[:3] for row in pools] == [
        [role, str(n), str(n - down[role])]
        for role, n in sorted({"both": 50, "decode": 25, "prefill": 25}.items())
    ]
    assert text_of(driver, "#pd-split") == "0"
    assert text_of(driver, "#pd-pull-failures") == text_of(driver, "#pd-expired-leases") == "0"


def test_a_router_with_a_key_asks_for_it_once(driver: Any) -> None:
    """Behind --api-key the page itself loads (it holds no data); its data answers 401 until
    the user gives the key in the page's field, which the tab then keeps across reloads."""
    from selenium.webdriver.common.by import By

    key = "dashboard-key-93be"
    configs = [ReplicaConfig(url=f"http://127.0.0.1:9/r{i}", name=f"r{i}") for i in range(3)]
    service = RouterService(RouterSettings(replicas=configs, api_keys=[key]))
    for config in configs:
        service.add_replica(config)
    app = FastAPI()
    add_dashboard(app, DashboardData(service).snapshot)
    app.add_middleware(ApiKeyMiddleware, keys=[key])
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/dashboard/data").status_code == 401
        driver.get(f"{server.url}/dashboard?interval_ms=500")
        form = driver.find_element(By.ID, "key-form")
        wait_for(driver, lambda d: form.is_displayed(), what="the key field")
        assert "API key" in text_of(driver, "#status")
        assert text_of(driver, "#replica-count") == "\u2013"  # the placeholder: no data
        for attempt in ("not-the-key", key):
            field = driver.find_element(By.ID, "api-key")
            field.send_keys(attempt)
            driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
            if attempt != key:
                wait_for(driver, lambda d: form.is_displayed(), what="the field again")
        wait_for(driver, lambda d: text_of(d, "#replica-count") == "3", what="the data")
        assert not form.is_displayed()
        assert key not in driver.current_url
        driver.refresh()
        wait_for(driver, lambda d: text_of(d, "#replica-count") == "3", what="data on reload")
        assert not driver.find_element(By.ID, "key-form").is_displayed()
