"""Build a tiny Llama model directory that vLLM can serve without any hub access.

The connector tests, the end-to-end tests, the demo and the benchmarks need a *real* vLLM
replica, on machines that may have no network and no GPU. This module writes a complete
Hugging Face model directory (config, byte-level BPE tokenizer with a ChatML template, random
safetensors weights) in a few seconds, under the state dir (``default_tiny_model_dir``), never
inside the installed package.

Design points:

* The tokenizer is a byte-level BPE trained with ``tokenizers`` on a small built-in corpus.
  ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` explicitly so that
  ``AutoTokenizer`` does not substitute the Llama family tokenizer class (whose ids would
  differ from ``tokenizer.json``).
* Everything is deterministic for a given ``seed`` and set of knobs, so two builds give
  byte-identical files and block hashes line up across machines.
* The build is idempotent: a ``kvroute_build.json`` stamp records the parameters, and a
  directory already built with the same parameters is left untouched (vLLM replicas may be
  serving it). Builders of one directory take turns (a lock file beside it): a second
  process that asks while the first builds (two test workers, two ``kvroute up``) waits and
  then finds the build done.
* ``weights=False`` writes everything but ``model.safetensors``: the simulator and the router
  only tokenize, and that build needs neither torch nor safetensors (a base install has none).
* Random weights are scaled so that next-token distributions are peaked: greedy decoding is
  then stable against the tiny numeric differences between attention code paths, which is
  what lets tests compare outputs of cached and recomputed prefills exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from kvroute.deploy.state_dir import default_state_dir

BUILD_STAMP = "kvroute_build.json"
BUILD_FORMAT = 1

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A small, varied corpus: prose, code, numbers and chat-like turns, so merges cover the
# kinds of text tests send. Kept in the source so builds need no files or network.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A cache-aware router sends each request "
    "to the replica that already holds the longest prefix of its prompt in its KV cache.",
    "You are a helpful assistant. Answer the user's question concisely and accurately.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) "
    "+ fibonacci(n - 2)\n",
    "import json\nimport os\n\nwith open('config.json') as f:\n    data = json.load(f)\n",
    "SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC;",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
    "wife. Every morning he went out with his nets, and every evening he came back home.",
    "The mitochondria is the powerhouse of the cell. Photosynthesis converts light energy "
    "into chemical energy stored in glucose.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 2024 2025 2026 3.14159",
    "Question: What is the capital of France? Answer: Paris. Question: What is two plus "
    "two? Answer: four.",
    "Summarize the following document in three bullet points. Then list the key risks.",
    "The system prompt describes the tools available: search(query), read(url), and "
    "calculator(expression). Call a tool by writing its name and arguments as JSON.",
    '{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}',
    "Large language models generate text one token at a time. The prefill phase processes "
    "the prompt; the decode phase produces new tokens using the key-value cache.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz !@#$%^&*()_+-=[]{};':\",./<>?",
    "Le renard brun rapide saute par-dessus le chien paresseux. Der schnelle braune Fuchs.",
]


@dataclass(frozen=True)
class TinyModelParams:
    """Every knob that changes the built files; stored in the build stamp."""

    seed: int = 0
    max_model_len: int = 4096
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    weights: bool = True
    format: int = BUILD_FORMAT


def default_tiny_model_dir() -> Path:
    """Where ``kvroute up`` builds the tiny model when it is given none."""
    return default_state_dir() / "models" / "tiny"


def _train_tokenizer(vocab_size: int):  # -> tokenizers.Tokenizer
    """Train a byte-level BPE on the built-in corpus (deterministic: the trainer breaks
    count ties by pair order, and the corpus is fixed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus a few times so that frequent pairs dominate the merges.
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _config(params: TinyModelParams, vocab_size: int, eos_id: int, bos_id: int) -> dict:
    head_dim = params.hidden_size // params.num_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": params.hidden_size,
        "intermediate_size": params.intermediate_size,
        "num_hidden_layers": params.num_layers,
        "num_attention_heads": params.num_heads,
        "num_key_value_heads": params.num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": params.max_model_len,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
    }


def _weights(params: TinyModelParams, vocab_size: int) -> dict:
    """Random weights from a seeded generator. The LM head is scaled up so greedy choices
    have wide margins (robust to bf16 noise between attention code paths)."""
    import torch

    gen = torch.Generator().manual_seed(params.seed)
    h, inter = params.hidden_size, params.intermediate_size
    head_dim = h // params.num_heads
    kv = params.num_kv_heads * head_dim

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16).contiguous()

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(vocab_size, h, std=1.0),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rnd(vocab_size, h, std=0.5),
    }
    std = 1.0 / (h**0.5)
    for i in range(params.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(h, h, std=std)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, h, std=std)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, h, std=std)
        w[p + "self_attn.o_proj.weight"] = rnd(h, h, std=std)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h, std=std)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h, std=std)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter, std=1.0 / (inter**0.5))
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return w


def _is_built(out_dir: Path, params: TinyModelParams) -> bool:
    """True when ``out_dir`` holds a build that serves ``params``: the same knobs, and
    weights when they are asked for (a build with weights also serves a tokenizer-only ask)."""
    try:
        stamp = json.loads((out_dir / BUILD_STAMP).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict):
        return False
    stamp.setdefault("weights", True)  # stamps written before the knob existed had weights
    wanted = asdict(params)
    return stamp == wanted or (not params.weights and stamp == {**wanted, "weights": True})


def build_tiny_model(
    out_dir: Path,
    *,
    seed: int = 0,
    max_model_len: int = 4096,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 1024,
    weights: bool = True,
) -> Path:
    """Write a servable tiny Llama model to ``out_dir`` and return it.

    Idempotent: when ``out_dir`` already holds a build with the same parameters nothing is
    written. Otherwise the model is built in a temporary sibling directory and swapped in,
    so a concurrent reader never sees half a model; concurrent builders of ``out_dir`` take
    turns, and the later ones find it built. ``weights=False`` builds the tokenizer and
    config only (no torch needed).
    """
    out_dir = Path(out_dir).resolve()
    params = TinyModelParams(
        seed=seed,
        max_model_len=max_model_len,
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size if intermediate_size is not None else 2 * hidden_size,
        vocab_size=vocab_size,
        weights=weights,
    )
    if params.hidden_size % params.num_heads:
        raise ValueError("hidden_size must be a multiple of num_heads")
    if params.num_heads % params.num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if _is_built(out_dir, params):
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _builder_lock(out_dir):
        if not _is_built(out_dir, params):  # else another process built it while we waited
            _build(out_dir, params)
    return out_dir


@contextlib.contextmanager
def _builder_lock(out_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``out_dir``'s builders (``.NAME.lock`` beside it)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: builds stay atomic, just not serialized
        yield
        return
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _build(out_dir: Path, params: TinyModelParams) -> None:
    """Build in a temporary sibling directory and swap it in."""
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        tok = _train_tokenizer(params.vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        real_vocab = tok.get_vocab_size()
        # Pad the embedding table to a multiple of 64 (kernels like aligned shapes); ids
        # past the tokenizer's vocab are never produced by it but are valid logits.
        padded_vocab = (real_vocab + 63) // 64 * 64
        eos_id = tok.token_to_id("<|im_end|>")
        bos_id = tok.token_to_id("<|endoftext|>")

        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": params.max_model_len,
            "chat_template": CHATML_TEMPLATE,
            "added_tokens_decoder": {
                str(tok.token_to_id(t)): {
                    "content": t,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for t in SPECIAL_TOKENS
            },
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (tmp / "special_tokens_map.json").write_text(
            json.dumps(
                {
                    "bos_token": "<|endoftext|>",
                    "eos_token": "<|im_end|>",
                    "pad_token": "<|endoftext|>",
                },
                indent=2,
            )
        )
        (tmp / "config.json").write_text(
            json.dumps(_config(params, padded_vocab, eos_id, bos_id), indent=2)
        )
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id}, indent=2)
        )
        if params.weights:
            from safetensors.torch import save_file

            save_file(
                _weights(params, padded_vocab),
                str(tmp / "model.safetensors"),
                metadata={"format": "pt"},
            )
        (tmp / BUILD_STAMP).write_text(json.dumps(asdict(params), indent=2))

        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.rename(out_dir, old / "m")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def model_digest(model_dir: Path) -> str:
    """sha256 over the model's files, for checking that two builds are identical."""
    h = hashlib.sha256()
    for name in sorted(p.name for p in Path(model_dir).iterdir() if p.is_file()):
        h.update(name.encode())
        h.update((Path(model_dir) / name).read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build a tiny local Llama model for vLLM.")
    parser.add_argument(
        "out_dir", type=Path, nargs="?", help="default: models/tiny in the state dir"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument(
        "--no-weights", action="store_true", help="tokenizer and config only (needs no torch)"
    )
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir or default_tiny_model_dir(),
        seed=args.seed,
        max_model_len=args.max_model_len,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        weights=not args.no_weights,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
