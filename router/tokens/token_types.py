"""What every tokenizer of the router returns, and what they share.

A ``Prompt`` is the request's prompt as the replica will see it: token ids plus, for a
multimodal request rendered by a replica, each media item's hash and placeholder range
(vLLM mixes ``(hash, offset in block)`` into the keys of the blocks an item overlaps, so
the index needs them to key those blocks as the replica did).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvroute.router.errors import RouterError
from kvroute.router.tokens.requests import ParsedRequest

__all__ = ["MMItem", "Prompt", "PromptIds", "TokenizerBase", "check_ids", "too_long"]


class MMItem(NamedTuple):
    """One multimodal item of a prompt: vLLM's identifier (its ``mm_hash``) and where its
    placeholder tokens sit (``kvroute.indexer.keys.MMItems`` takes these tuples as they are)."""

    identifier: str
    offset: int
    length: int


class PromptIds(list[int]):
    """Token ids that carry their prompt's multimodal items along (``mm``), so everything
    that passes ids around (routing, batches) keys them without a second channel."""

    __slots__ = ("mm",)

    def __init__(self, ids: list[int], mm: tuple[MMItem, ...] = ()) -> None:
        super().__init__(ids)
        self.mm = mm


@dataclass(slots=True)
class Prompt:
    tokens: list[int]
    # Sorted by offset; empty for text-only prompts.
    mm: list[MMItem] = field(default_factory=list)
    # Where the ids came from: "local", "render", "tokenize" or "given" (token-id prompt).
    source: str = "local"

    def __post_init__(self) -> None:
        if self.mm and not isinstance(self.tokens, PromptIds):
            self.tokens = PromptIds(self.tokens, tuple(self.mm))


def too_long(limit: int, at_least: int, param: str) -> RouterError:
    """vLLM's answer to a prompt past the context length, given before tokenizing it all."""
    return RouterError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your prompt has "
        f"at least {at_least} tokens.",
        param=param,
    )


def check_ids(prompt: list[int], max_model_len: int | None) -> None:
    if max_model_len is not None and len(prompt) > max_model_len:
        raise too_long(max_model_len, len(prompt), "prompt")


class TokenizerBase(ABC):
    mode: str

    @abstractmethod
    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        """The prompt ids the replica will see (the first prompt of a batch). With
        ``max_model_len``, a prompt that certainly exceeds it is a 400 (``too_long``)."""

    async def prompt(self, req: ParsedRequest, max_model_len: int | None = None) -> Prompt:
        """The prompt with its multimodal items (none unless a replica rendered it)."""
        return Prompt(await self.encode(req, max_model_len), source=self.mode)

    def stats(self) -> dict[str, Any]:
        return {"mode": self.mode}
