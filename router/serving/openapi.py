"""The proxied endpoints in the router's OpenAPI document (``GET /openapi.json``).

They are raw ASGI routes (kvroute.router.serving.endpoints), so FastAPI cannot describe them itself.
The request schemas say what the router reads to route a request, in vLLM's shapes; every other
field is the replica's to judge and passes untouched (``additionalProperties``). Clients and code
generators get a true description, and the fuzz tests generate requests from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["PROXIED", "ProxiedOperation", "add_proxied_paths"]

_TOKEN_IDS: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0},
}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "a model the fleet serves"},
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "max_tokens": {"type": "integer", "minimum": 0},
    "n": {"type": "integer", "minimum": 0},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "cache_salt": {
        "type": "string",
        "description": "vLLM: the prefix cache is shared only among requests with this salt",
    },
}
_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "null"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type"],
                        "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
                    },
                },
            ]
        },
        "name": {"type": "string"},
    },
}
_SCHEMAS: dict[str, dict[str, Any]] = {
    "CompletionRequest": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            **_COMMON,
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    _TOKEN_IDS,
                    {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
                ],
                "description": "a batch is routed as a whole, to one replica, as vLLM serves it",
            },
            "add_special_tokens": {"type": "boolean", "default": True},
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            **_COMMON,
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "max_completion_tokens": {"type": "integer", "minimum": 0},
            "add_generation_prompt": {"type": "boolean", "default": True},
            "continue_final_message": {"type": "boolean", "default": False},
            "add_special_tokens": {"type": "boolean", "default": False},
            "chat_template": {"type": "string"},
            "chat_template_kwargs": {"type": "object"},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": _COMMON["model"],
            "prompt": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "add_special_tokens": {"type": "boolean"},
            "add_generation_prompt": {"type": "boolean"},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["model", "tokens"],
        "properties": {"model": _COMMON["model"], "tokens": _TOKEN_IDS},
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["integer", "string", "null"]},
                },
            }
        },
    },
}

_SCORE_TEXT: dict[str, Any] = {
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]
}
_INPUT: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ],
    "description": "a batch is routed as a whole, to one replica, as vLLM serves it",
}
_MORE_SCHEMAS: dict[str, dict[str, Any]] = {
    "ResponsesRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": _COMMON["model"],
            "input": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "object"}},
                ],
                "description": "a string, or input items (messages, function calls, outputs)",
            },
            "instructions": {"type": "string"},
            "previous_response_id": {
                "type": "string",
                "description": "sent to the replica that stored that response",
            },
            "stream": _COMMON["stream"],
            "store": {"type": "boolean", "default": True},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": _COMMON["temperature"],
            "top_p": _COMMON["top_p"],
            "tools": {"type": "array", "items": {"type": "object"}},
            "cache_salt": _COMMON["cache_salt"],
        },
    },
    "AnthropicMessagesRequest": {
        "type": "object",
        "required": ["model", "messages", "max_tokens"],
        "properties": {
            "model": _COMMON["model"],
            "max_tokens": {"type": "integer", "minimum": 1},
            "system": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]
            },
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "role": {"type": "string"},
                        "content": {
                            "anyOf": [
                                {"type": "string"},
                                {"type": "array", "items": {"type": "object"}},
                            ]
                        },
                    },
                },
            },
            "stream": _COMMON["stream"],
            "tools": {"type": "array", "items": {"type": "object"}},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["input"],
        "properties": {
            "model": _COMMON["model"],
            "input": _INPUT,
            "encoding_format": {"type": "string", "enum": ["float", "base64"]},
            "add_special_tokens": {"type": "boolean", "default": True},
        },
    },
    "PoolingRequest": {
        "type": "object",
        "properties": {
            "model": _COMMON["model"],
            "input": _INPUT,
            "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
            "add_special_tokens": {"type": "boolean"},
        },
    },
    "ScoreRequest": {
        "type": "object",
        "properties": {
            "model": _COMMON["model"],
            "text_1": _SCORE_TEXT,
            "text_2": _SCORE_TEXT,
            "queries": _SCORE_TEXT,
            "documents": _SCORE_TEXT,
        },
    },
    "RerankRequest": {
        "type": "object",
        "required": ["query", "documents"],
        "properties": {
            "model": _COMMON["model"],
            "query": {"type": "string"},
            "documents": _SCORE_TEXT,
            "top_n": {"type": "integer", "minimum": 0},
        },
    },
    "GenerateRequest": {
        "type": "object",
        "required": ["token_ids"],
        "properties": {
            "model": _COMMON["model"],
            "token_ids": _TOKEN_IDS,
            "sampling_params": {"type": "object"},
        },
    },
    "AudioRequest": {
        "type": "object",
        "required": ["file"],
        "properties": {
            "file": {"type": "string", "format": "binary"},
            "model": {"type": "string"},
        },
    },
}


@dataclass(frozen=True, slots=True)
class ProxiedOperation:
    kind: str  # how kvroute.router.serving.endpoints ranks it
    summary: str
    schema: str | None = None  # the request body's schema
    content: str = "application/json"


_JSON_ROUTED = "routed by the cached prefix of its prompt, as completions are"
# path -> method -> operation. The router's routes are made from this table
# (kvroute.router.app), so the document cannot list a path the router does not route. Any
# other path, any method, is passed through by load (a catch-all, not described: it has no schema of
# its own).
PROXIED: dict[str, dict[str, ProxiedOperation]] = {
    "/v1/completions": {
        "post": ProxiedOperation(
            "completion",
            "Completions, routed by the prompt's cached prefix (a batch as a whole)",
            "CompletionRequest",
        )
    },
    "/v1/chat/completions": {
        "post": ProxiedOperation(
            "chat",
            "Chat completions, routed by the rendered conversation's cached prefix",
            "ChatCompletionRequest",
        )
    },
    "/tokenize": {
        "post": ProxiedOperation(
            "tokenize", "vLLM's /tokenize, forwarded to the least loaded replica", "TokenizeRequest"
        )
    },
    "/detokenize": {
        "post": ProxiedOperation(
            "detokenize",
            "vLLM's /detokenize, forwarded to the least loaded replica",
            "DetokenizeRequest",
        )
    },
    "/v1/responses": {
        "post": ProxiedOperation(
            "responses",
            "Responses API: routed by the rendered conversation's cached prefix; a "
            "continuation (previous_response_id) goes to the replica that stored it",
            "ResponsesRequest",
        )
    },
    "/v1/responses/{response_id}": {
        "get": ProxiedOperation("response", "A stored response, from the replica that stored it"),
        "delete": ProxiedOperation(
            "response",
            "Delete a stored response, on the replica that stored it (vLLM 0.32 has no "
            "such route: its 405 passes through)",
        ),
    },
    "/v1/responses/{response_id}/cancel": {
        "post": ProxiedOperation(
            "response", "Cancel a background response, on the replica that stored it"
        )
    },
    "/v1/messages": {
        "post": ProxiedOperation(
            "messages",
            "Anthropic Messages API, routed by the rendered conversation's cached prefix",
            "AnthropicMessagesRequest",
        )
    },
    "/v1/embeddings": {
        "post": ProxiedOperation("embeddings", f"Embeddings, {_JSON_ROUTED}", "EmbeddingRequest")
    },
    "/pooling": {
        "post": ProxiedOperation("pooling", f"vLLM's pooling, {_JSON_ROUTED}", "PoolingRequest")
    },
    "/classify": {
        "post": ProxiedOperation(
            "classify", f"vLLM's classification, {_JSON_ROUTED}", "PoolingRequest"
        )
    },
    **{
        path: {
            "post": ProxiedOperation(
                "score", f"vLLM's scoring, {_JSON_ROUTED} (every text)", "ScoreRequest"
            )
        }
        for path in ("/v1/score", "/score")
    },
    **{
        path: {
            "post": ProxiedOperation(
                "rerank", f"vLLM's rerank, {_JSON_ROUTED} (every text)", "RerankRequest"
            )
        }
        for path in ("/v1/rerank", "/rerank", "/v2/rerank")
    },
    "/inference/v1/generate": {
        "post": ProxiedOperation(
            "generate", f"vLLM's token-in/token-out generate, {_JSON_ROUTED}", "GenerateRequest"
        )
    },
    **{
        path: {
            "post": ProxiedOperation(
                "audio",
                "Speech to text: the multipart body passes untouched, to the least loaded replica",
                "AudioRequest",
                "multipart/form-data",
            )
        }
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations")
    },
    "/version": {"get": ProxiedOperation("other", "vLLM's version, from the least loaded replica")},
}

_ERRORS = {
    "400": "a field the router reads is missing or malformed",
    "404": "no replica serves the model (or the replica's own 404, passed through)",
    "408": "the body did not arrive within --body-timeout-s",
    "413": "the body is larger than --max-body-bytes",
    "429": "the router's --max-in-flight is reached, or every replica is saturated and the "
    "request cannot start in time (admission; Retry-After)",
    "503": "no healthy replica, or every replica saturated with --no-admission (Retry-After)",
}
_RETRIEVE_QUERY = [
    {"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean"}},
    {"name": "starting_after", "in": "query", "required": False, "schema": {"type": "integer"}},
]


def _operation(path: str, method: str, op: ProxiedOperation) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    responses: dict[str, Any] = {
        "200": {
            "description": "the replica's answer (JSON, or SSE when streaming)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
    for code, why in _ERRORS.items():
        responses[code] = {"description": why, "content": error}
    out: dict[str, Any] = {"summary": op.summary, "responses": responses}
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", path)
    ]
    if op.kind == "response" and method == "get":
        params += _RETRIEVE_QUERY
    if params:
        out["parameters"] = params
    if op.schema is not None:
        out["requestBody"] = {
            "required": True,
            "content": {op.content: {"schema": {"$ref": f"#/components/schemas/{op.schema}"}}},
        }
    return out


def add_proxied_paths(document: dict[str, Any]) -> dict[str, Any]:
    """Add the proxied paths and their schemas to FastAPI's generated document."""
    paths = document.setdefault("paths", {})
    for path, ops in PROXIED.items():
        paths[path] = {method: _operation(path, method, op) for method, op in ops.items()}
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in {**_SCHEMAS, **_MORE_SCHEMAS}.items():
        schemas[name] = {**schema, "additionalProperties": True} if name != "Error" else schema
    return document
