"""The committed KV-event fixtures are vLLM's own output: regenerating them gives the same bytes.

``tests/fixtures/vllm_events/generate.py`` drives vLLM's real scheduler (and, per scenario, its
offloading or LMCache connector code) and records what vLLM's ``ZmqEventPublisher`` sends. This
test runs it again into a temporary directory, in its own process (it pins ``PYTHONHASHSEED``
and vLLM's module-level hash seed), and compares every fixture with the committed one: every
batch payload byte for byte except the 8 bytes of its float64 ``ts``, the seqs and steps, the
auxiliary (llm-d) frames the same way, and the probes' truth.

``lmcache_shape`` runs LMCache's own code, which is not a dependency of kvroute: it is
regenerated when ``$KVROUTE_LMCACHE_PATH`` names a directory holding LMCache 0.5.6 (``pip
install --no-deps --target DIR lmcache==0.5.6 aiofile caio``), and skipped otherwise.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm_events"


def _without_ts(payload_b64: str) -> bytes:
    """The payload with its leading float64 timestamp zeroed.

    vLLM's ``KVEventBatch`` is ``[ts, events, data_parallel_rank]`` (fixarray 3) and llm-d's
    storage batch ``[ts, events]`` (fixarray 2); both start with a msgpack float64 (0xcb).
    """
    raw = base64.b64decode(payload_b64)
    assert raw[0] in (0x92, 0x93) and raw[1] == 0xCB, raw[:2].hex()
    return raw[:2] + bytes(8) + raw[10:]


def _normalised(doc: dict[str, Any]) -> dict[str, Any]:
    doc = dict(doc)
    for key in ("batches", "aux_batches"):
        if key in doc:
            doc[key] = [{**b, "payload_b64": _without_ts(b["payload_b64"]).hex()} for b in doc[key]]
    return doc


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vllm_events")
    env = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fixtures.vllm_events.generate", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


LMCACHE = "lmcache_shape.json"


def _skipped_without_lmcache(regenerated: Path, name: str) -> None:
    """Without LMCache the LMCache fixture cannot be made again: skipped, unless LMCache was
    named (``make test`` installs it and sets ``KVROUTE_LMCACHE_PATH``), where that is a
    failure."""
    if name == LMCACHE and not (regenerated / name).exists():
        if os.environ.get("KVROUTE_LMCACHE_PATH"):
            pytest.fail("KVROUTE_LMCACHE_PATH is set but LMCache's fixture was not generated")
        pytest.skip("LMCache is not importable here: set KVROUTE_LMCACHE_PATH (see generate.py)")


def test_the_same_scenarios_are_generated(regenerated: Path) -> None:
    committed = sorted(p.name for p in FIXTURES.glob("*.json"))
    assert committed, "no committed fixtures"
    fresh = sorted(p.name for p in regenerated.glob("*.json"))
    if LMCACHE not in fresh:
        committed.remove(LMCACHE)
    assert fresh == committed


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_regenerated_fixture_equals_the_committed_one(regenerated: Path, name: str) -> None:
    import vllm

    _skipped_without_lmcache(regenerated, name)
    committed = json.loads((FIXTURES / name).read_text())
    fresh = json.loads((regenerated / name).read_text())
    assert committed["vllm_version"] == vllm.__version__, (
        f"{name} was generated with vLLM {committed['vllm_version']}, this is "
        f"{vllm.__version__}: regenerate with `python -m tests.fixtures.vllm_events.generate`"
    )
    old, new = _normalised(committed), _normalised(fresh)
    for key in ("batches", "aux_batches"):
        old_batches, new_batches = old.get(key, []), new.get(key, [])
        assert len(new_batches) == len(old_batches), f"{name}: number of {key}"
        for i, (a, b) in enumerate(zip(old_batches, new_batches, strict=True)):
            assert a == b, f"{name}: {key}[{i}] differs"
    assert new == old
