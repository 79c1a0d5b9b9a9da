"""The simulated fleet's tokenizer: a real Hugging Face tokenizer directory, used like vLLM.

The router's local tokenizer mode must produce the ids a replica computes, so both load the
same directory with ``transformers.AutoTokenizer``. The directory is the tiny model that
``kvroute.deploy.tiny_model.build_tiny_model`` writes (byte-level BPE, ChatML template): the same
files the real-vLLM tests serve, so a tokenization mismatch found with the simulator is one
that real replicas would show as well.

Chat prompts are rendered as vLLM's OpenAI server does: ``apply_chat_template(tokenize=False)``
to text, then ``encode(text, add_special_tokens=False)``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MAX_MODEL_LEN", "SimTokenizer", "default_model_dir", "ensure_model_dir"]

DEFAULT_MAX_MODEL_LEN = 32768


def default_model_dir(max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> Path:
    """Where the simulator keeps its model directory: in the state dir
    (``kvroute.deploy.state_dir``) unless ``KVROUTE_SIM_MODEL_DIR`` says otherwise."""
    env = os.environ.get("KVROUTE_SIM_MODEL_DIR")
    if env:
        return Path(env)
    from kvroute.deploy.state_dir import default_state_dir

    return default_state_dir() / f"sim-model-{max_model_len}"


def ensure_model_dir(
    model_dir: Path | None = None, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN
) -> Path:
    """Build the tiny model directory once (idempotent; a few seconds the first time).
    Without weights: only the tokenizer is used, and a base install has no torch."""
    from kvroute.deploy.tiny_model import build_tiny_model

    return build_tiny_model(
        model_dir or default_model_dir(max_model_len), max_model_len=max_model_len, weights=False
    )


class SimTokenizer:
    """Prompt rendering and tokenization exactly as vLLM does it, plus the fake generator."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.eos_token_id: int = self.tok.eos_token_id
        # vLLM refuses a token id past the tokenizer's largest (renderers' validate_token_ids).
        self.max_token_id: int = len(self.tok) - 1
        special = set(self.tok.all_special_ids)
        # Output ids are drawn from word-start tokens so generated text reads as words.
        vocab = self.tok.get_vocab()
        self._word_ids = sorted(
            i
            for s, i in vocab.items()
            if i not in special and s.startswith("\u0120") and s[1:].isalpha() and len(s) > 2
        )
        if not self._word_ids:  # pragma: no cover - the tiny model's vocab always has some
            self._word_ids = sorted(i for i in vocab.values() if i not in special)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """The chat prompt text (raises ValueError on messages the template cannot render);
        ``chat_template`` is the server's ``--chat-template`` (None: the tokenizer's).

        As vLLM's "string" content format hands messages to the template: a missing content
        is an empty string, and the ``developer`` role becomes ``system`` (merged with the
        other system messages at the front) for a template that never names it."""
        from kvroute.router.tokens.chat_render import map_developer_role

        conv = [{**m, "content": ""} if m.get("content") is None else dict(m) for m in messages]
        template = chat_template or getattr(self.tok, "chat_template", None)
        conv = map_developer_role(conv, template)
        try:
            text = self.tok.apply_chat_template(
                conv,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                chat_template=template,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 and transformers raise a variety of types
            raise ValueError(f"cannot apply the chat template: {exc}") from exc
        if not isinstance(text, str):
            raise ValueError("the chat template did not render text")
        return text

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def generate(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        """``n`` output ids, each a pure function of everything before it (the prompt and the
        ids already generated), as greedy decoding is: every replica answers a request the
        same way, so a workload's later turns do not depend on where earlier ones ran, and a
        request continued elsewhere from its prompt plus its first ``k`` ids (the router's
        stream resumption) goes on exactly as it would have."""
        context = hashlib.sha256(_pack(prompt_ids))
        words = self._word_ids
        out: list[int] = []
        for _ in range(n):
            step = int.from_bytes(context.copy().digest()[:8], "little")
            token = words[step % len(words)]
            out.append(token)
            context.update(_pack((token,)))
        return out


def _pack(ids: Sequence[int]) -> bytes:
    from array import array

    return array("I", ids).tobytes()
