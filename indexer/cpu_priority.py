"""How the OS schedules a router's threads: request serving first, event ingestion behind it.

Why: every router ingests every replica's events on one thread per stream, and each event
batch wakes its thread (8 replicas at vLLM's step rate: about 400 wakeups a second per
router on the routing benchmark). On a busy core those wakeups sit in the run queue ahead of
the thread serving requests. Measured with four routers sharing a core (the routing
benchmark's `--router-cpus`, /proc's schedstat over 40 s of the chat preset): the serving
thread waited 2.6 ms in the run queue every time it woke, several times per request. A batch
ingested a few milliseconds later costs the index nothing; a request waiting behind it
costs its latency.

Two hints, each a no-op where the platform lacks it (and never an error):

* ``as_background_work`` (the feed threads): Linux ``SCHED_BATCH`` (a waking batch thread
  does not preempt a running one) and a nice of at least ``BACKGROUND_NICE`` (a third of a
  normal thread's share when the core is contended, so ingestion still keeps up when the
  router is saturated; raising one's own nice needs no privilege).
* ``as_latency_sensitive`` (the event loop's thread): a short EEVDF time slice (Linux 6.12+,
  ``sched_setattr``'s ``sched_runtime`` for a fair-class thread), so the loop gets an early
  deadline and preempts background work when a request wakes it. Older kernels ignore it.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import struct
import threading

__all__ = [
    "BACKGROUND_NICE",
    "as_background_work",
    "as_latency_sensitive",
    "custom_slices_supported",
    "thread_slice_ns",
]

BACKGROUND_NICE = 5
# sched_setattr(2) by architecture; a platform not listed gets no slice hint.
_SYS_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SCHED_ATTR_SIZE = 56  # SCHED_ATTR_SIZE_VER1
_MIN_SLICE_NS, _MAX_SLICE_NS = 100_000, 100_000_000  # what the kernel clamps a slice to


def as_background_work() -> bool:
    """The calling thread becomes batch work of low priority; False where neither applies."""
    done = False
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is not None and hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
            done = True
        except OSError:
            pass
    if hasattr(os, "setpriority"):
        tid = threading.get_native_id()  # Linux: a nice value is a thread's own
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < BACKGROUND_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)
            done = True
        except OSError:
            pass
    return done


def as_latency_sensitive(slice_s: float) -> bool:
    """Ask for a time slice of ``slice_s`` (clamped to the kernel's 0.1-100 ms) for the calling
    thread, keeping its policy and nice. False where the call is not available or refused
    (a kernel before 6.12 accepts and ignores it: ``thread_slice_ns`` tells)."""
    nr = _SYS_SCHED_SETATTR.get(platform.machine())
    if nr is None or not hasattr(os, "sched_getscheduler") or os.name != "posix":
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False  # a real-time or batch thread is the operator's choice: leave it
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except OSError:
        return False
    runtime = min(_MAX_SLICE_NS, max(_MIN_SLICE_NS, round(slice_s * 1e9)))
    # struct sched_attr: size, policy, flags, nice, priority, runtime, deadline, period,
    # util_min, util_max.
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQII", _SCHED_ATTR_SIZE, os.SCHED_OTHER, 0, nice, 0, runtime, 0, 0, 0, 0)
    )
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(nr, 0, attr, 0)) == 0
    except (OSError, AttributeError):
        return False


def thread_slice_ns(tid: int | None = None) -> int | None:
    """The thread's current time slice as the kernel reports it (``se.slice`` in
    /proc/<tid>/sched), or None where it does not."""
    tid = threading.get_native_id() if tid is None else tid
    try:
        with open(f"/proc/self/task/{tid}/sched") as f:
            for line in f:
                if line.startswith("se.slice"):
                    return int(line.split(":")[1])
    except (OSError, ValueError):
        return None
    return None


def custom_slices_supported() -> bool:
    """Whether this kernel honours a fair-class thread's own slice (EEVDF, Linux 6.12+) and
    ``as_latency_sensitive`` knows this architecture's system call."""
    m = re.match(r"(\d+)\.(\d+)", platform.release())
    return (
        platform.system() == "Linux"
        and m is not None
        and (int(m[1]), int(m[2])) >= (6, 12)
        and platform.machine() in _SYS_SCHED_SETATTR
    )
