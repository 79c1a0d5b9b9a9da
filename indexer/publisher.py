"""vLLM's ZmqEventPublisher, byte-for-byte on the wire, for publishers that are not vLLM.

The storage evictor (``kvroute storage gc``), the simulator, the tests and the benchmarks
publish KV events through this class so that a subscriber meets exactly what a real replica
sends: a PUB socket with 3-frame messages and
sequence numbers from 0, plus an optional ROUTER replay socket that answers a DEALER's
``[b"", start_seq]`` with every buffered batch from that sequence on and an end marker.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvroute.indexer.wire import (
    Event,
    WireError,
    encode_batch,
    encode_frames,
    encode_replay_end,
    encode_replay_reply,
    parse_replay_request,
)

__all__ = ["EventPublisher", "vllm_binds"]


def vllm_binds(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint names a wildcard or a local transport, else connect."""
    return any(s in endpoint for s in ("*", "::", "ipc://", "inproc://"))


class EventPublisher:
    """Publishes event batches; thread-safe ``publish``; the replay socket has its own thread.

    ``drop=True`` puts a batch in the replay buffer without sending it: the subscriber sees a
    gap, exactly as when ZMQ drops a message at the high-water mark.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        context: zmq.Context | None = None,
        data_parallel_rank: int | None = None,
        bind: bool | None = None,
    ) -> None:
        """``bind=None`` follows vLLM's rule; tests pass ``bind=True`` with
        ``tcp://127.0.0.1:0`` to get a free loopback port (see ``self.endpoint``)."""
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.seq = 0
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        if vllm_binds(endpoint) if bind is None else bind:
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._replay: zmq.Socket | None = None
        self._replay_thread: threading.Thread | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            try:
                self._replay.bind(replay_endpoint)
            except zmq.ZMQError:
                # give the PUB port back too: a caller retrying the bind needs both
                self._replay.close(linger=0)
                self._pub.close(linger=0)
                raise
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, name="kv-replay", daemon=True
            )
            self._replay_thread.start()

    def publish(
        self, events: Sequence[Event], *, ts: float | None = None, drop: bool = False
    ) -> int:
        """Publish one batch; returns its sequence number."""
        payload = encode_batch(
            events, ts=time.time() if ts is None else ts, data_parallel_rank=self.data_parallel_rank
        )
        return self.publish_payload(payload, drop=drop)

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        """Publish an already-encoded payload (also used to send garbage in tests)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self._buffer.append((seq, payload))
            if not drop:
                self._pub.send_multipart(encode_frames(self.topic, seq, payload), copy=False)
        return seq

    def lose_at_source(self) -> int:
        """Consume a sequence number, sending and buffering nothing: what vLLM's publisher
        does with a batch it fails to encode (LMCache's events on its tensor path carry a
        ``torch.device`` medium). Returns the lost seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
        return seq

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames (malformed-message tests); touches no sequence number."""
        with self._lock:
            self._pub.send_multipart(list(frames))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        while not self._closed.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._replay.recv_multipart()
            except zmq.ZMQError:
                return
            identity = frames[0] if frames else b""
            try:
                start = parse_replay_request(frames)
            except WireError:
                continue
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in batches:
                    self._replay.send_multipart(
                        encode_replay_reply(identity, self.topic, seq, payload)
                    )
                self._replay.send_multipart(encode_replay_end(identity))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._closed.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        with self._lock:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
