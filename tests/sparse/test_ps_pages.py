"""Pages of a table's next memory are faulted in off the server's loop, and nothing in them changes."""

from __future__ import annotations

import mmap
import os
import time

import pytest
import torch

from fleet.sparse import pages


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _wait_for_the_helper(timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pages._PREFAULTER._work.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the last tensor taken off the queue may still be in madvise


def test_prefault_keeps_the_contents():
    t = torch.arange(4 << 20, dtype=torch.int64)
    pages.prefault(t)
    pages.prefault(t[123:4567])  # a view that starts and ends mid-page
    _wait_for_the_helper()
    assert torch.equal(t, torch.arange(4 << 20, dtype=torch.int64))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc to read the RSS")
def test_prefault_makes_fresh_memory_present_without_the_caller_writing_it():
    if not pages._PREFAULTER.supported:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): prefault is a no-op here")
    # a fresh anonymous mapping, never touched: torch.empty may reuse memory the allocator has already
    # faulted in for an earlier test in this process, which no prefault can make grow the RSS
    region = mmap.mmap(-1, 64 << 20)
    t = torch.frombuffer(region, dtype=torch.uint8)
    before = _rss_bytes()
    pages.prefault(t)
    _wait_for_the_helper()
    if not pages._PREFAULTER.supported:
        pytest.skip("the kernel refused MADV_POPULATE_WRITE: prefault is a no-op here")
    deadline = time.monotonic() + 20.0  # on a loaded machine the helper's madvise may still be running
    while _rss_bytes() - before <= 48 << 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    grown = _rss_bytes() - before
    assert grown > 48 << 20, f"RSS grew by {grown >> 20} MiB after prefaulting 64 MiB"
    t.fill_(7)
    assert int(t.sum()) == 7 * (64 << 20)


def test_the_helper_thread_stops_before_the_interpreter_exits():
    # A daemon thread torn down by the interpreter's finalisation inside torch aborted the process at exit
    # ("terminate called without an active exception"): the helper is stopped by an exit handler instead.
    helper = pages._Prefaulter()
    if not helper.supported:
        pytest.skip("no madvise here: the helper never starts")
    helper.submit(torch.empty(64 << 20, dtype=torch.uint8))  # 8 chunks: stop() lands between two
    thread = helper._thread
    assert thread is not None and thread.is_alive()
    helper.stop()
    assert not thread.is_alive()
    queued = helper._work.qsize()
    helper.submit(torch.empty(1 << 20, dtype=torch.uint8))  # after the exit handler: ignored, no new thread
    assert helper._thread is thread and helper._work.qsize() == queued
