"""One tokenizer per model, local where configured, remote where it must be.

A fleet may serve several models (and LoRA adapters of them), each with its own tokenizer
and chat template. ``FleetTokenizer`` picks, per request: the local tokenizer configured for
the model (``--model-tokenizer MODEL=PATH``), else for its base model (a LoRA adapter is
tokenized by its base model's tokenizer, as vLLM does), else the default (``--tokenizer``);
remote tokenization (``RemoteTokenizer``: a replica's render endpoint or ``/tokenize``)
when there is none, when the request carries media parts (their placeholders are
model-specific: only the server renders them exactly), or while the live check
(``router/token_check.py``) has that model switched to remote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvroute.router.chat_render import has_media
from kvroute.router.errors import RouterError
from kvroute.router.remote_tokens import RemoteTokenizer
from kvroute.router.requests import ParsedRequest
from kvroute.router.token_check import LiveCheck
from kvroute.router.token_types import Prompt, TokenizerBase
from kvroute.router.tokenization import LocalTokenizer

__all__ = ["FleetTokenizer"]


class FleetTokenizer(TokenizerBase):
    def __init__(
        self,
        *,
        default: LocalTokenizer | None = None,
        per_model: dict[str, LocalTokenizer] | None = None,
        remote: RemoteTokenizer | None = None,
        base_model: Callable[[str], str] | None = None,
        check: LiveCheck | None = None,
    ) -> None:
        self.default = default
        self.per_model = dict(per_model or {})
        self.remote = remote
        self.base_model = base_model or (lambda model: model)
        self.check = check if remote is not None else None

    @property
    def mode(self) -> str:  # type: ignore[override]
        return "local" if self.default is not None or self.per_model else "remote"

    @property
    def has_local(self) -> bool:
        return self.mode == "local"

    def local_for(self, model: str, base: str | None = None) -> LocalTokenizer | None:
        found = self.per_model.get(model)
        if found is None:
            if not self.per_model:
                return self.default
            found = self.per_model.get(base or self.base_model(model), self.default)
        return found

    async def prompt(self, req: ParsedRequest, max_model_len: int | None = None) -> Prompt:
        key = self.base_model(req.model)
        local = self.local_for(req.model, key)
        given = req.kind == "completion" and isinstance(req.prompt, list)
        media = req.kind == "chat" and has_media(req.messages)
        remote = self.remote
        if (
            remote is not None
            and not given
            and (
                local is None
                or media
                or (self.check is not None and self.check.mode(key) == "remote")
            )
        ):
            found = await remote.prompt(req, max_model_len)
        elif local is not None:
            found = Prompt(await local.encode(req, max_model_len), source="local")
        elif remote is not None:
            found = await remote.prompt(req, max_model_len)
        else:
            raise RouterError(500, "the router has no tokenizer for this request")
        if (
            local is not None
            and remote is not None
            and self.check is not None
            and not (given or media)
        ):
            self.check.observe(key, req, local, remote)
        return found

    async def encode(self, req: ParsedRequest, max_model_len: int | None = None) -> list[int]:
        return (await self.prompt(req, max_model_len)).tokens

    async def close(self) -> None:
        if self.check is not None:
            await self.check.close()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self.default.stats() if self.default is not None else {}
        out["mode"] = self.mode
        out["tokenizers"] = {
            model: {"tokenizer": tok.name, "chat_template": tok.chat_template is not None}
            for model, tok in sorted(self.per_model.items())
        }
        out["models"] = self.check.stats() if self.check is not None else {}
        if self.check is not None:
            out["check_every"] = self.check.every
            out["clean_checks_to_return"] = self.check.clean_to_return
        out["remote"] = None if self.remote is None else self.remote.stats()
        return out
