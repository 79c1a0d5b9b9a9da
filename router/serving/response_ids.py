"""Which replica holds each stored Responses object.

vLLM keeps a stored response (``store=true``, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in
the memory of the API server that created it; ``GET /v1/responses/{id}``, its ``/cancel``,
``DELETE``, and a new response continuing it (``previous_response_id``) must reach that same
replica, or they are a 404. The router learns the id from the create answer (the JSON
``id``, or the ``response.id`` of the first SSE event when streaming) and remembers
id -> replica in a bounded LRU (``MAX_IDS``; ~150 bytes an entry). An id it does not know
(another router created it, or it was evicted) is asked of the healthy replicas in turn.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from kvroute.router.common.lru import LRU

__all__ = ["MAX_IDS", "ResponseHomes", "SseResponseId", "id_from_body", "id_in_path"]

MAX_IDS = 262_144
_decode = msgspec.json.decode
_PATH = re.compile(r"^/v1/responses/([^/]+)(?:/cancel)?/?$")
# The first SSE event is small (response.created: the response without output); one that
# has not ended within this many bytes is not what we look for.
_HEAD_LIMIT = 1 << 16


class ResponseHomes:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self._ids: LRU[str, str] = LRU(max_ids)

    def remember(self, response_id: str, replica: str) -> None:
        self._ids.put(response_id, replica)

    def get(self, response_id: str) -> str | None:
        return self._ids.get(response_id)

    def __len__(self) -> int:
        return len(self._ids)


def id_in_path(path: str) -> str | None:
    """The response id of ``/v1/responses/{id}`` or ``/v1/responses/{id}/cancel``."""
    found = _PATH.match(path)
    return found.group(1) if found else None


def _id_of(obj: object) -> str | None:
    if not isinstance(obj, dict):
        return None
    inner = obj.get("response")
    if isinstance(inner, dict):  # an SSE event: {"type": "response.created", "response": ...}
        obj = inner
    rid = obj.get("id")
    return rid if isinstance(rid, str) and rid and obj.get("object") == "response" else None


def id_from_body(body: bytes) -> str | None:
    """The id of a non-streamed Responses answer."""
    try:
        return _id_of(_decode(body))
    except msgspec.DecodeError:
        return None


class SseResponseId:
    """Fed the streamed chunks in order until it returns True: finds the response id in
    the first SSE event (``event: response.created`` / ``data: {...}``) and hands it to
    ``on_found`` at once, before the chunk that carries it is relayed: a client that reads
    the id and asks for the response straight away must find it already remembered."""

    __slots__ = ("head", "id", "on_found")

    def __init__(self, on_found: Callable[[str], None] | None = None) -> None:
        self.head = b""
        self.id: str | None = None
        self.on_found = on_found

    def __call__(self, chunk: bytes) -> bool:
        self.head += chunk
        end = self.head.find(b"\n\n")
        if end < 0:
            return len(self.head) > _HEAD_LIMIT
        for line in self.head[:end].split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    self.id = _id_of(_decode(line[5:].strip()))
                except msgspec.DecodeError:
                    pass
        if self.id is not None and self.on_found is not None:
            self.on_found(self.id)
        return True
