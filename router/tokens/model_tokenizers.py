"""One tokenizer per model, local where configured, remote where it must be.

A fleet may serve several models (and LoRA adapters of them), each with its own tokenizer
and chat template. ``FleetTokenizer`` picks, per request: the local tokenizer configured for
the model (``--model-tokenizer MODEL=PATH``), else for its base model (a LoRA adapter is
tokenized by its base model's tokenizer, as vLLM does), else the default (``--tokenizer``);
remote tokenization (``RemoteTokenizer``: a replica's render endpoint or ``/tokenize``)
when there is none, when the request carries media parts (their placeholders are
model-specific: only the server renders them exactly), or while the live check
(``router/tokens/token_check.py``) has that model switched to remote.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import httpx

from kvroute.router.errors import RouterError
from kvroute.router.tokens.chat_render import has_media
from kvroute.router.tokens.remote_tokens import RemoteTokenizer
from kvroute.router.tokens.requests import ParsedRequest
from kvroute.router.tokens.token_check import LiveCheck
from kvroute.router.tokens.token_types import Prompt, TokenizerBase
from kvroute.router.tokens.tokenization import LocalTokenizer, self_check

if TYPE_CHECKING:
    from kvroute.router.config import RouterSettings
    from kvroute.router.fleet.replicas import Replica

__all__ = [
    "FleetTokenizer",
    "build_tokenizer",
    "check_against_replicas",
    "load_local_tokenizer",
    "log_startup_check",
]

log = logging.getLogger(__name__)


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


def build_tokenizer(
    settings: RouterSettings,
    *,
    given: TokenizerBase | None,
    needs_tokens: bool,
    client: httpx.AsyncClient,
    tokenize_url: Callable[[str], str | None],
    on_check: Callable[..., Any],
    base_model: Callable[[str], str],
) -> TokenizerBase | None:
    """A ``FleetTokenizer``: local tokenizers (default and per model) checked on live
    traffic against the replicas, and remote tokenization where there is none. ``given`` (a
    tokenizer the caller built) is used as it is unless it is a local one to wrap."""
    s = settings
    if given is not None and not isinstance(given, LocalTokenizer):
        return given
    default, per_model = given, {}
    if s.tokenizer_mode == "local":
        if default is None and s.tokenizer:
            default = load_local_tokenizer(
                s, s.tokenizer, s.tokenizer_chat_template, s.tokenizer_content_format
            )
        per_model = {
            model: load_local_tokenizer(s, c.path, c.chat_template, c.content_format)
            for model, c in s.model_tokenizers.items()
        }
    remote = None
    if default is not None or per_model or s.tokenizer_mode == "remote" or needs_tokens:
        remote = RemoteTokenizer(
            client,
            tokenize_url,
            cache_entries=s.tokenizer_cache_entries,
            use_render=s.tokenizer_render,
        )
    if remote is None:
        return None
    if default is None and not per_model and s.tokenizer_mode == "local":
        log.warning("no --tokenizer given: tokenizing with the replicas (render or /tokenize)")
    check = None
    if (default is not None or per_model) and s.tokenizer_check_every > 0:
        check = LiveCheck(s.tokenizer_check_every, s.tokenizer_clean_checks, on_check=on_check)
    return FleetTokenizer(
        default=default,
        per_model=per_model,
        remote=remote,
        base_model=base_model,
        check=check,
    )


def load_local_tokenizer(
    settings: RouterSettings, path: str, chat_template_file: str | None, content_format: str
) -> LocalTokenizer:
    """A local tokenizer from ``path``, with a chat template file when one is given."""
    template = None
    if chat_template_file:
        with open(chat_template_file, encoding="utf-8") as fh:
            template = fh.read()
    return LocalTokenizer(
        path,
        cache_entries=settings.tokenizer_cache_entries,
        segment_cache_entries=settings.tokenizer_segment_cache_entries,
        chat_template=template,
        content_format=content_format,
    )


async def check_against_replicas(
    tokenizer: TokenizerBase,
    replicas: Iterable[Replica],
    client: httpx.AsyncClient,
    samples: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``self_check`` of the router's ids against each replica's /tokenize, one model each;
    a fleet tokenizer's local ids are the ones checked."""
    results = []
    for replica in replicas:
        for model in sorted(replica.models)[:1]:
            tok = tokenizer
            if isinstance(tok, FleetTokenizer):  # the local ids are the ones to check
                tok = tok.local_for(model) or tok
            results.append(await self_check(tok, client, replica.url, model, samples))
    return results


async def log_startup_check(check: Callable[[], Awaitable[list[dict[str, Any]]]]) -> None:
    """Run the tokenizer check once at start and log what it found: advisory, so nothing it
    raises stops the router."""
    try:
        results = await check()
    except Exception as exc:  # the check is advisory; it must never stop the router
        log.warning("tokenizer self-check could not run: %r", exc)
        return
    for result in results:
        if not result["ok"]:
            log.error(
                "tokenizer self-check FAILED against %s: router ids differ from the "
                "replica's; prefix hits will be silently lost. %s",
                result["replica"],
                result["results"],
            )
