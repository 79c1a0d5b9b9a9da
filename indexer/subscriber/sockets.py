"""The socket side of one feed: a thread holding the SUB socket on the replica's publisher and
its connection monitor, and a DEALER on the replay socket opened for each replay asked for.

The thread keeps no state of the stream: it passes what it sees (a message, a connection up
or down, the time passing) to the feed's transition methods (``ReplicaFeed``), one at a time,
in the order it saw them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvroute.indexer.cpu_priority import as_background_work
from kvroute.indexer.index import PrefixIndex
from kvroute.indexer.subscriber.budget import ByteBudget
from kvroute.indexer.subscriber.replica_feed import ReplicaFeed
from kvroute.indexer.subscriber.types import EventSource
from kvroute.indexer.wire import Frame, WireError, decode_replay_reply
from kvroute.indexer.wire import encode_replay_request as _replay_request

__all__ = ["MAX_MESSAGE_BYTES", "MAX_REPLAY_FRAMES"]

log = logging.getLogger(__name__)

# How often a feed's thread drops the replica's unconfirmed holdings past their time.
_EXPIRE_EVERY_S = 1.0
# The largest event message accepted from a publisher. vLLM sends one batch per engine step;
# even a 128k-token prefill's batch is well under 2 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# libzmq reconnects a peer that went away by itself, but never one it dropped for a protocol
# error (a frame past MAXMSGSIZE): a connection down this long is re-made by hand.
_RECONNECT_AFTER_S = 3.0
# A replay is vLLM's buffer of past batches (10,000 by default): a reply longer than this is
# not a replay but a publisher that never stops answering.
MAX_REPLAY_FRAMES = 65_536
# Live messages ZMQ may queue per feed (see _FeedThread.run).
_RCVHWM = 1_000


class _FeedThread(threading.Thread):
    """Socket loop of one replica: SUB + connection monitor + on-demand replay DEALER."""

    def __init__(
        self,
        source: EventSource,
        index: PrefixIndex,
        ctx: zmq.Context,
        *,
        budget: ByteBudget | None,
        replay_timeout_s: float,
        stale_clear_after_s: float,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        name = source.replica + (f"-{source.stream}" if source.stream else "")
        super().__init__(name=f"kv-feed-{name}", daemon=True)
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        self.stale_clear_after_s = stale_clear_after_s
        self.max_message_bytes = max_message_bytes
        self.stop_event = threading.Event()
        replay = self._replay if source.replay_endpoint else None
        self.feed = ReplicaFeed(source, index, replay=replay, budget=budget)

    def _replay(self, start: int) -> list[Frame] | None:
        """Ask the replay socket for every batch from ``start``; None when it does not answer."""
        endpoint = self.feed.source.replay_endpoint
        assert endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        frames: list[Frame] = []
        deadline = time.monotonic() + self.replay_timeout_s
        try:
            sock.connect(endpoint)
            sock.send_multipart(_replay_request(start))
            while not self.stop_event.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    return None
                try:
                    frame = decode_replay_reply(sock.recv_multipart())
                except WireError as exc:
                    self.feed.note_malformed(str(exc))
                    continue
                if frame is None:
                    return frames
                frames.append(frame)
                if len(frames) > MAX_REPLAY_FRAMES:
                    log.warning(
                        "replay from %s sent over %d batches: ignored", endpoint, MAX_REPLAY_FRAMES
                    )
                    return None
            return None
        except zmq.ZMQError as exc:
            log.warning("replay from %s failed: %s", endpoint, exc)
            return None
        finally:
            sock.close(linger=0)

    def run(self) -> None:
        as_background_work()
        source = self.feed.source
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # Messages ZMQ queues for this feed while its thread is busy (a replay, a burst). vLLM
        # sends at most one batch per engine step, so 1,000 outlasts a replay's timeout on a
        # busy replica; past it ZMQ drops, which the sequence gap's replay repairs. It is also
        # what a flooding publisher can make this process hold: at 10,000 a soak's flood of
        # 5 KB batches queued 60 MB that the allocator did not always give back.
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        # A frame past this makes ZMQ drop the publisher's connection unread (re-made below;
        # the sequence gap then asks for a replay): one oversized publisher costs its own feed.
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.RECONNECT_IVL, 100)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        stale_since: float | None = None
        down_since: float | None = None
        next_expiry = time.monotonic() + _EXPIRE_EVERY_S
        try:
            sub.connect(source.endpoint)
            while not self.stop_event.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    event = recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self.feed.on_disconnected()
                        stale_since = down_since = time.monotonic()
                    elif event["event"] == zmq.EVENT_CONNECTED:
                        down_since = None
                        self.feed.on_connected()
                        stale_since = None
                if sub in ready:
                    # Drain what is queued before polling again: bursts arrive together.
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.feed.handle_frames(frames)
                now = time.monotonic()
                if down_since is not None and now - down_since > _RECONNECT_AFTER_S:
                    with contextlib.suppress(zmq.ZMQError):
                        sub.disconnect(source.endpoint)
                    sub.connect(source.endpoint)
                    down_since = now
                if stale_since is not None and now - stale_since > self.stale_clear_after_s:
                    self.feed.on_gone(self.stale_clear_after_s)
                    stale_since = None
                if now >= next_expiry:
                    self.feed.expire()
                    next_expiry = now + _EXPIRE_EVERY_S
        except Exception:  # the feed must never die silently
            log.exception("event feed of %s%s crashed", source.replica, source.stream)
            self.feed.on_crash()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
