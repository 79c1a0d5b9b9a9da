"""The OS scheduling hints for a router's threads (indexer/cpu_priority.py), read back from the
kernel: each is set on a thread of its own so the test process keeps its class."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvroute.indexer.cpu_priority import (
    BACKGROUND_NICE,
    as_background_work,
    as_latency_sensitive,
    custom_slices_supported,
    thread_slice_ns,
)

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")


def _in_thread(body: Callable[[], Any]) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(body()))
    thread.start()
    thread.join(10)
    assert out, "the thread did not finish"
    return out[0]


@linux_only
def test_background_work_is_batch_class_at_a_low_priority() -> None:
    inherited = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())  # 19 under nice

    def body() -> tuple[bool, int, int]:
        done = as_background_work()
        tid = threading.get_native_id()
        return done, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, tid)

    done, policy, nice = _in_thread(body)
    assert done and policy == os.SCHED_BATCH and nice == max(inherited, BACKGROUND_NICE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is untouched


@linux_only
def test_a_thread_already_nicer_keeps_its_nice() -> None:
    def body() -> tuple[int, int]:
        tid = threading.get_native_id()
        nicer = max(BACKGROUND_NICE + 5, os.getpriority(os.PRIO_PROCESS, tid))
        os.setpriority(os.PRIO_PROCESS, tid, nicer)
        before = os.getpriority(os.PRIO_PROCESS, tid)
        as_background_work()
        return before, os.getpriority(os.PRIO_PROCESS, tid)

    before, after = _in_thread(body)
    assert after == before > BACKGROUND_NICE


@pytest.mark.skipif(not custom_slices_supported(), reason="no per-thread slices before 6.12")
@pytest.mark.parametrize(("asked", "got"), [(0.0001, 100_000), (0.0005, 500_000), (1e-6, 100_000)])
def test_a_latency_sensitive_thread_gets_the_slice_it_asked_clamped(asked: float, got: int) -> None:
    def body() -> tuple[bool, int | None, int]:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        ok = as_latency_sensitive(asked)
        return ok, thread_slice_ns(), os.getpriority(os.PRIO_PROCESS, tid) - before

    ok, slice_ns, nice_change = _in_thread(body)
    assert ok and slice_ns == got and nice_change == 0


@linux_only
def test_a_batch_thread_is_not_made_latency_sensitive() -> None:
    """A thread the operator (or the feeds) put in another class is left as it is."""

    def body() -> tuple[bool, int]:
        as_background_work()
        return as_latency_sensitive(0.0001), os.sched_getscheduler(0)

    assert _in_thread(body) == (False, os.SCHED_BATCH)
