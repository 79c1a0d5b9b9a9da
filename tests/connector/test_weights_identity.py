"""The layout identity covers the checkpoint: new weights at the same path, a
quantization switched on or an override changed make a new identity, and files written
under one identity are never loaded under another (private directory and storage
domain). No vLLM: the connector's identity is built here from stand-ins for vLLM's
config objects, as ``KVRouteConnector._identity`` builds it from the real ones; the
real-vLLM check is ``test_vllm_weights_identity.py``."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvroute.connector.config import ConnectorConfig
from kvroute.connector.disk_format import file_name
from kvroute.connector.disk_scan import scan_layout
from kvroute.connector.disk_tier import tier_directory, unlink_chunk_all_ranks
from kvroute.connector.fingerprint import model_files, stable_json, weights_fingerprint
from kvroute.connector.identity import RankInfo, layout_digest, layout_identity
from kvroute.connector.layout import checkpoint_fingerprint, identity_fields, local_model_dir
from kvroute.connector.planner import Planner
from kvroute.connector.shared_store import SharedStore
from kvroute.connector.worker import WorkerExecutor
from tests.connector.helpers import BLOCK, BPC, CHUNK, block_hashes, make_paged, step

RANK = RankInfo()


# ---------------------------------------------------------------- stand-ins for vLLM
def _model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "rope_theta": 10000.0}))
    (d / "tokenizer.json").write_text('{"model": "bpe"}')
    (d / "model-00001-of-00002.safetensors").write_bytes(b"A" * 1000)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"B" * 500)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "1"}}))
    (d / "README.md").write_text("not part of the checkpoint")
    for i, p in enumerate(sorted(d.iterdir())):
        os.utime(p, ns=(1_700_000_000_000_000_000 + i, 1_700_000_000_000_000_000 + i))
    return d


def _vllm_config(model: str, **model_kw: Any) -> Any:
    hf_config = model_kw.pop("hf_config", None) or SimpleNamespace(
        _commit_hash=model_kw.pop("commit", None),
        to_json_string=lambda: json.dumps({"rope_theta": 10000.0}),
    )
    mc = {
        "model": model,
        "revision": None,
        "dtype": "torch.bfloat16",
        "quantization": None,
        "quantization_config": None,
        "hf_overrides": {},
        "hf_config_path": None,
        "model_weights": "",
        "hf_config": hf_config,
    }
    mc.update(model_kw)
    return SimpleNamespace(
        model_config=SimpleNamespace(**mc),
        cache_config=SimpleNamespace(
            cache_dtype="auto", block_size=32, prefix_caching_hash_algo="sha256"
        ),
        load_config=SimpleNamespace(load_format="auto", download_dir=None),
    )


def _identity(vllm_config: Any, weights_id: str | None = None) -> str:
    """What ``KVRouteConnector._identity`` computes, TP=PP=1."""
    fp, _ = checkpoint_fingerprint(vllm_config, weights_id)
    fields = identity_fields(
        vllm_config,
        weights=fp.digest,
        num_layers=2,
        stage_layers=[2],
        page_bytes=4096,
        chunk_tokens=256,
        hash_seed="0",
    )
    return layout_identity(fields, tp_size=1, pp_size=1)


def _rewrite(path: Path, data: bytes, ns: int) -> None:
    path.write_bytes(data)
    os.utime(path, ns=(ns, ns))


# Each change of what determines the KV, applied to a fresh model dir / config.
CHANGES: dict[str, Callable[[Path, Any], Any]] = {
    "weights rewritten in place (same size, new mtime)": lambda d, c: _rewrite(
        d / "model-00001-of-00002.safetensors", b"C" * 1000, 1_800_000_000_000_000_000
    ),
    "weights of another size": lambda d, c: _rewrite(
        d / "model-00002-of-00002.safetensors", b"B" * 501, 1_700_000_000_000_000_004
    ),
    "a weight file renamed": lambda d, c: (d / "model-00002-of-00002.safetensors").rename(
        d / "model-00002-of-00003.safetensors"
    ),
    "a weight file added": lambda d, c: (d / "extra.safetensors").write_bytes(b"x"),
    "config.json changed": lambda d, c: (d / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "rope_theta": 500000.0})
    ),
    "safetensors index changed": lambda d, c: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "2"}})
    ),
    "quantization on": lambda d, c: setattr(c.model_config, "quantization", "fp8"),
    "quantization config": lambda d, c: setattr(
        c.model_config, "quantization_config", {"activation_scheme": "dynamic"}
    ),
    "hf_overrides (rope)": lambda d, c: setattr(
        c.model_config, "hf_overrides", {"rope_scaling": {"type": "yarn", "factor": 4.0}}
    ),
    "hf_overrides callable": lambda d, c: setattr(c.model_config, "hf_overrides", _override),
    "load format dummy": lambda d, c: setattr(c.load_config, "load_format", "dummy"),
    "kv cache dtype": lambda d, c: setattr(c.cache_config, "cache_dtype", "fp8"),
}


def _override(cfg: Any) -> Any:
    return cfg


def test_same_inputs_give_the_same_identity(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    a = _identity(_vllm_config(str(d)))
    assert a == _identity(_vllm_config(str(d)))  # another process, same checkpoint
    # Files that do not configure or hold the model do not count.
    (d / "README.md").write_text("edited")
    (d / ".cache").mkdir()
    (d / ".cache" / "x.safetensors").write_bytes(b"zzz")
    assert _identity(_vllm_config(str(d))) == a
    # A callable override is named, never by its address.
    c1, c2 = _vllm_config(str(d)), _vllm_config(str(d))
    c1.model_config.hf_overrides = _override
    c2.model_config.hf_overrides = _override
    assert _identity(c1) == _identity(c2)
    assert "0x" not in stable_json({"f": _override})


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_input_changes_the_identity(tmp_path: Path, change: str) -> None:
    d = _model_dir(tmp_path)
    before = _identity(_vllm_config(str(d)))
    cfg = _vllm_config(str(d))
    CHANGES[change](d, cfg)
    after = _identity(cfg)
    assert after != before
    assert layout_digest(after) != layout_digest(before)  # another directory


def test_weights_id_replaces_the_weight_files_stats(tmp_path: Path) -> None:
    d = _model_dir(tmp_path)
    a = _identity(_vllm_config(str(d)), weights_id="ckpt-7")
    # A copy of the same checkpoint with other file times: same identity with an id.
    for p in d.glob("*.safetensors"):
        os.utime(p, ns=(1_900_000_000_000_000_000, 1_900_000_000_000_000_000))
    assert _identity(_vllm_config(str(d)), weights_id="ckpt-7") == a
    assert _identity(_vllm_config(str(d)), weights_id="ckpt-8") != a
    assert _identity(_vllm_config(str(d))) != a
    # Config and settings still count.
    cfg = _vllm_config(str(d), quantization="fp8")
    assert _identity(cfg, weights_id="ckpt-7") != a
    with pytest.raises(ValueError, match="weights_id"):
        ConnectorConfig.from_extra_config({"weights_id": " "})


def _hub_snapshot(cache: Path, repo: str, commit: str, blob: str, mtime_ns: int) -> Path:
    """A hub cache entry as huggingface_hub lays it out: files are links into blobs/."""
    base = cache / f"models--{repo.replace('/', '--')}"
    (base / "blobs").mkdir(parents=True, exist_ok=True)
    (base / "refs").mkdir(exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (base / "blobs" / blob).write_bytes(b"W" * 100)
    os.utime(base / "blobs" / blob, ns=(mtime_ns, mtime_ns))
    (base / "blobs" / "cfgblob").write_text('{"num_hidden_layers": 2}')
    (snap / "model.safetensors").symlink_to(f"../../blobs/{blob}")
    (snap / "config.json").symlink_to("../../blobs/cfgblob")
    return snap


def test_hub_model_is_fingerprinted_from_the_snapshot_vllm_downloaded(tmp_path: Path) -> None:
    repo, commit = "org/tiny", "a" * 40
    host1 = _hub_snapshot(tmp_path / "h1", repo, commit, "e3b0" * 16, 1_700_000_000_000_000_000)
    host2 = _hub_snapshot(tmp_path / "h2", repo, commit, "e3b0" * 16, 1_800_000_000_000_000_000)
    # The blob name (the file's content hash) stands for the weights, not the file time,
    # so two hosts' downloads of one snapshot agree.
    assert model_files(host1) == model_files(host2)
    assert ("w", "model.safetensors", "100", f"blob:{'e3b0' * 16}") in model_files(host1)

    def cfg(cache: Path) -> Any:
        c = _vllm_config(repo, commit=commit)
        c.load_config.download_dir = str(cache)
        return c

    assert local_model_dir(cfg(tmp_path / "h1")) == (host1, True)
    fp1, _ = checkpoint_fingerprint(cfg(tmp_path / "h1"))
    fp2, _ = checkpoint_fingerprint(cfg(tmp_path / "h2"))
    assert fp1.source == "hub-cache" and fp1.files == 2 and fp1 == fp2
    # Another snapshot of the repo: other blobs, another identity.
    host3 = _hub_snapshot(tmp_path / "h3", repo, "b" * 40, "f00d" * 16, 1_700_000_000_000_000_000)
    assert model_files(host3) != model_files(host1)
    assert _identity(cfg(tmp_path / "h3")) != _identity(cfg(tmp_path / "h1"))


def test_hub_id_without_local_files_uses_what_vllm_resolved(tmp_path: Path) -> None:
    def cfg(commit: str, rope: float) -> Any:
        hf = SimpleNamespace(
            _commit_hash=commit, to_json_string=lambda: json.dumps({"rope_theta": rope})
        )
        c = _vllm_config("org/not-cached", hf_config=hf)
        c.load_config.download_dir = str(tmp_path / "empty-cache")
        return c

    assert local_model_dir(cfg("a" * 40, 1.0)) == (None, False)
    fp, model_dir = checkpoint_fingerprint(cfg("a" * 40, 1.0))
    assert model_dir is None and fp.source == "hub-id" and fp.files == 0
    assert _identity(cfg("a" * 40, 1.0)) == _identity(cfg("a" * 40, 1.0))
    assert _identity(cfg("b" * 40, 1.0)) != _identity(cfg("a" * 40, 1.0))  # new commit
    assert _identity(cfg("a" * 40, 2.0)) != _identity(cfg("a" * 40, 1.0))  # new config


def test_a_single_model_file_is_fingerprinted(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"G" * 10)
    fp = weights_fingerprint(f, settings={})
    assert fp.source == "file" and fp.files == 1
    _rewrite(f, b"H" * 10, 1_900_000_000_000_000_000)
    assert weights_fingerprint(f, settings={}) != fp


# ---------------------------------------------------------------- never load across it
class Engine:
    """A planner + worker executor of one identity on ``base`` (as the connector makes
    them: the layout directory named by the identity's digest)."""

    def __init__(self, base: Path, identity: str, *, domain: str | None = None) -> None:
        self.dir = tier_directory(base, layout_digest(identity))
        self.paged = make_paged()
        g = torch.Generator().manual_seed(3)
        for t in self.paged.layers:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        nbytes = self.paged.num_layers * BPC * self.paged.block_bytes()
        self.shared = (
            SharedStore(self.dir, identity, [RANK], domain=domain) if domain is not None else None
        )
        self.p = Planner(
            block_size=BLOCK,
            blocks_per_chunk=BPC,
            num_slots=8,
            chunk_payload_bytes=nbytes,
            identity=identity,
            disk_capacity_bytes=1 << 20,
            disk_enabled=True,
            unlink=lambda k: unlink_chunk_all_ranks(self.dir, [RANK], k),
            shared=self.shared,
        )
        if self.shared is None:
            self.p.add_disk_entries(scan_layout(self.dir, identity, [RANK]))
        self.ex = WorkerExecutor(
            self.paged, blocks_per_chunk=BPC, num_slots=8, identity=identity, disk_dir=self.dir
        )

    def store(self, tokens: list[int], hashes: list[bytes]) -> None:
        self.p.on_scheduled("w", list(range(len(hashes))), hashes, tokens, len(tokens))
        step(self.p, self.ex)
        step(self.p, self.ex)

    def lookup(self, tokens: list[int], hashes: list[bytes]) -> int:
        return self.p.lookup("r", hashes, tokens, len(tokens), 0).num_tokens

    def close(self) -> None:
        self.ex.close()
        if self.shared is not None:
            self.shared.close()


def _two_identities(tmp_path: Path) -> tuple[str, str]:
    d = _model_dir(tmp_path / "m")
    a = _identity(_vllm_config(str(d)))
    CHANGES["weights rewritten in place (same size, new mtime)"](d, None)
    b = _identity(_vllm_config(str(d)))
    assert a != b
    return a, b


@pytest.mark.parametrize("domain", [None, "rack-1"])
def test_files_written_under_one_identity_are_never_loaded_under_another(
    tmp_path: Path, domain: str | None
) -> None:
    a_id, b_id = _two_identities(tmp_path)
    base = tmp_path / "kv"
    tokens = [7 + i for i in range(2 * CHUNK + 1)]
    hashes = block_hashes(tokens)
    a = Engine(base, a_id, domain=domain)
    a.store(tokens, hashes)
    a_files = sorted(a.dir.glob("*/*.kvc"))
    assert len(a_files) == 2
    a.close()
    # Restarted on the new weights (or another replica of the domain on them): a miss,
    # and A's files are left alone (another replica of the domain may still be on A).
    b = Engine(base, b_id, domain=domain)
    assert b.dir != a.dir
    assert b.lookup(tokens, hashes) == 0
    assert sorted(a.dir.glob("*/*.kvc")) == a_files
    # An A file copied under B's directory (a digest collision, a careless copy) is
    # foreign: a miss, removed, never served.
    key = hashes[BPC - 1]
    dst = b.dir / RANK.dir_name / file_name(key)
    shutil.copy(a.dir / RANK.dir_name / file_name(key), dst)
    if domain is None:
        b.close()
        b = Engine(base, b_id)  # a private directory is read by the start-up scan
    assert b.lookup(tokens, hashes) == 0
    assert not dst.exists()
    # B computes and stores the chunks itself, and serves its own bytes.
    b.store(tokens, hashes)
    assert b.lookup(tokens, hashes) == 2 * CHUNK
    b.close()
    # A replica still on the old weights keeps serving its own files.
    a2 = Engine(base, a_id, domain=domain)
    assert a2.lookup(tokens, hashes) == 2 * CHUNK
    a2.close()
