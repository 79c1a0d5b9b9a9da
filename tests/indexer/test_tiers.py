"""The one tier vocabulary: its order, its wire names, and its text keys."""

from __future__ import annotations

import json
import subprocess
import sys

from kvroute.indexer import wire
from kvroute.indexer.tiers import Tier


def test_tiers_are_ordered_fastest_first_and_named_as_on_the_wire() -> None:
    assert list(Tier) == sorted(Tier) == [Tier.GPU, Tier.CPU, Tier.STORAGE]
    assert [t.name for t in Tier] == ["GPU", "CPU", "STORAGE"]  # vLLM's medium strings
    assert all(wire.MEDIA[t.name].tier is t and wire.MEDIA[t.name].confirmed for t in Tier)
    assert wire.Medium is Tier


def test_labels_are_the_json_keys() -> None:
    assert Tier.CPU.label() == "CPU"
    assert Tier.STORAGE.label(confirmed=False) == "STORAGE_UNCONFIRMED"
    assert json.dumps({t.label(): int(t) for t in Tier}) == '{"GPU": 0, "CPU": 1, "STORAGE": 2}'


def test_importing_the_tiers_loads_no_third_party_module() -> None:
    """The connector imports this module inside vLLM's processes."""
    probe = (
        "import json, sys; import kvroute.indexer.tiers; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] != 'kvroute')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = {m.split(".")[0] for m in json.loads(out.stdout)}
    assert not loaded & {"msgspec", "xxhash", "zmq", "yaml", "torch", "vllm"}
