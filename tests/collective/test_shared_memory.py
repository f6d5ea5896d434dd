"""Workers on one host: the shared-memory channel and transport (fleet/collective/shm.py, transports/shared_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import patterns
from dist_harness import run_workers
from fleet.collective import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory path needs x86-64 and /dev/shm")


def _table(world: int, width: int) -> torch.Tensor:
    return torch.zeros(shm.Channel.numel(world, width), dtype=torch.int64)


def test_channel_exchanges_values_and_keeps_rounds_apart():
    world, rounds = 3, 50
    table = _table(world, 2)
    seen: dict[int, list] = {}

    def worker(rank: int) -> None:
        channel = shm.Channel(table, rank, world, 2, timeout_s=10)
        seen[rank] = [channel.exchange([rank, step]) for step in range(rounds)]
        channel.barrier()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    for rank in range(world):
        assert seen[rank] == [[[r, step] for r in range(world)] for step in range(rounds)]


def _count_a_wait(monkeypatch, spin: bool = True, yield_s: float = 0.0) -> tuple[int, int]:
    """(yields, futex sleeps) of worker 0's barrier with a peer 0.3 s late; each yield takes ``yield_s`` (the
    time another process ran meanwhile)."""
    table = _table(2, 1)
    yields, sleeps = [], []
    real_sleep, real_futex_wait = time.sleep, shm._futex_wait

    def counted_sleep(seconds: float) -> None:
        if seconds == 0:
            yields.append(1)
            real_sleep(yield_s)
        else:
            real_sleep(seconds)

    def counted_futex_wait(*args) -> None:
        sleeps.append(1)
        real_futex_wait(*args)

    monkeypatch.setattr(shm.time, "sleep", counted_sleep)
    monkeypatch.setattr(shm, "_futex_wait", counted_futex_wait)
    late = shm.Channel(table, 1, 2, 1, timeout_s=10, spin=spin)
    arrival = threading.Timer(0.3, late.barrier)
    arrival.start()
    shm.Channel(table, 0, 2, 1, timeout_s=10, spin=spin).barrier()
    arrival.join(10)
    return len(yields), len(sleeps)


def test_a_wait_on_busy_cores_sleeps_on_the_futex_after_a_few_yields(monkeypatch):
    """Each yield on busy cores gives the core away for up to a time slice: a wait stops yielding after about
    0.1 ms (not after 50 yields, tens of milliseconds and as many context switches) and sleeps on the futex,
    which the peer's arrival wakes."""
    yields, sleeps = _count_a_wait(monkeypatch, yield_s=50e-6)
    assert sleeps, "the wait never slept on the futex"
    assert 1 <= yields <= 10, f"{yields} yields before sleeping"


def test_a_wait_sleeps_at_once_where_spinning_does_not_pay(monkeypatch):
    """More processes of the job on this host than cores (W6's PS job: 2 workers and a server on 2 cores):
    a wait does not yield at all before it sleeps on the futex."""
    from fleet.runtime import env

    monkeypatch.setattr(shm.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert shm.spinning_pays(2, env.EnvReader({}))  # a core for each worker
    assert shm.spinning_pays(2, env.EnvReader({env.FLEET_LOCAL_PROCESSES: "2"}))
    assert not shm.spinning_pays(2, env.EnvReader({env.FLEET_LOCAL_PROCESSES: "3"}))  # a server beside them
    assert not shm.spinning_pays(3, env.EnvReader({}))
    yields, sleeps = _count_a_wait(monkeypatch, spin=False)
    assert sleeps and not yields


def test_channel_names_a_peer_whose_process_is_gone():
    table = _table(2, 1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    table.view(2, 4)[1, 1] = dead.pid  # worker 1 joined the channel, then its process ended
    channel = shm.Channel(table, 0, 2, 1, timeout_s=30)
    with pytest.raises(shm.ChannelError, match="worker 1 died") as error:
        channel.barrier()
    assert error.value.ranks == [1]


def test_channel_names_a_peer_that_never_arrives():
    table = _table(2, 1)
    table.view(2, 4)[1, 1] = os.getpid()  # alive, but never writes
    with pytest.raises(shm.ChannelError, match="worker 1 did not arrive within 0.5 s"):
        shm.Channel(table, 0, 2, 1, timeout_s=0.5).barrier()


def test_channel_without_pid_checks_never_calls_an_unseen_peer_dead():
    """A peer in another pid namespace (a container sharing /dev/shm): its pid means nothing here."""
    table = _table(2, 1)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    table.view(2, 4)[1, 1] = dead.pid  # here no such process: there, worker 1 may well be alive
    with pytest.raises(shm.ChannelError, match="worker 1 did not arrive within 1.2 s"):
        shm.Channel(table, 0, 2, 1, timeout_s=1.2, check_pids=False).barrier()


def test_a_peer_that_has_not_built_its_channel_yet_is_late_not_dead():
    """Worker 1 mapped the table but has not written its pid (it was descheduled right after connect's
    agreement): it must not be reported dead from the empty pid field, only late after the timeout."""
    table = _table(2, 1)
    with pytest.raises(shm.ChannelError, match="worker 1 did not arrive within 1.2 s"):
        shm.Channel(table, 0, 2, 1, timeout_s=1.2).barrier()


def test_a_segment_is_owner_only_and_fully_allocated(tmp_path):
    path = f"{shm.SHM_DIR}/fleet-test-{os.getpid()}"
    try:
        segment = shm.create(path, 1000, torch.float32)
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(path).st_blocks * 512 >= 4000
        segment.fill_(1.0)
        assert shm.attach(path, 1000, torch.float32).sum() == 1000
        with pytest.raises(OSError, match="holds 4000 bytes, expected 8000"):
            shm.attach(path, 2000, torch.float32)
    finally:
        os.unlink(path)


def fallback_worker(rank: int, fail_rank: int) -> dict:
    """One worker cannot allocate shared memory: every worker falls back to the process group together."""
    import fleet
    from fleet.collective.transports import shared_memory as transport

    if rank == fail_rank:

        def no_space(*args, **kwargs):
            raise OSError(28, "No space left on device")

        transport.shm.create = no_space
    fleet.init()
    out = patterns.distributed("unused_branch", "sgd", rank, 2, fleet.distributed_optimizer)
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_no_shared_memory_on_one_worker_falls_back_together():
    results = run_workers(fallback_worker, 2, 1)
    want = patterns.reference("unused_branch", "sgd", 2)
    for result in results:
        assert not patterns.compare(result, want)


def overlapped_worker(rank: int, names: tuple[str, ...], thread_min_bytes: int | None = None) -> dict:
    """With a core to spare, buckets are summed on a thread of their own while backward goes on (with
    ``thread_min_bytes`` 0: even buckets too small to pay for its hand-off, the training thread's otherwise)."""
    import fleet
    from fleet.collective.transports import shared_memory as transport

    transport.overlap_pays = lambda workers_here: True
    if thread_min_bytes is not None:
        transport.THREAD_MIN_BYTES = thread_min_bytes
    fleet.init()
    out = {name: patterns.distributed(name, "adam", rank, 2, fleet.distributed_optimizer) for name in names}
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_buckets_summed_on_their_own_thread_equal_single_process():
    results = run_workers(overlapped_worker, 2, ("unused_branch", "two_optimizers"))
    for name in ("unused_branch", "two_optimizers"):
        want = patterns.reference(name, "adam", 2)
        for result in results:
            assert not patterns.compare(result[name], want), name


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_small_buckets_summed_on_the_thread_equal_single_process():
    results = run_workers(overlapped_worker, 2, ("unused_branch",), 0)
    want = patterns.reference("unused_branch", "adam", 2)
    for result in results:
        assert not patterns.compare(result["unused_branch"], want)


def connect_worker(rank: int) -> dict:
    """LocalHost.connect three times: as it is; with worker 1 in another pid namespace; with worker 1 seeing a
    file of the segment's name that is not worker 0's memory (another /dev/shm)."""
    import torch.distributed as dist

    import fleet

    fleet.init()
    group = dist.group.WORLD
    out = {}
    host = shm.LocalHost.connect(group, 10)
    out["same"] = host is not None and host.lockstep.check_pids and host.buckets.check_pids
    real = shm.pid_namespace
    if rank == 1:
        shm.pid_namespace = lambda: real() + 1
    host = shm.LocalHost.connect(group, 10)
    out["other_pids"] = host is not None and not host.lockstep.check_pids and not host.buckets.check_pids
    shm.pid_namespace = real
    if rank == 1:
        shm.attach = lambda path, numel, dtype: torch.zeros(numel, dtype=dtype)
    out["foreign_file"] = shm.LocalHost.connect(group, 10) is None
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_connect_rests_on_proof_and_checks_pids_only_in_one_pid_namespace():
    for result in run_workers(connect_worker, 2):
        assert result == {"same": True, "other_pids": True, "foreign_file": True}


def test_a_batch_waited_for_before_all_its_buckets_launched_fails_loudly_and_sums_nothing():
    """A layout's buckets summed inline share one pair of barriers; a round that waited for the first before
    launching the rest would pair those barriers with the peers' wrongly, so it is refused."""
    from fleet.collective.transports.shared_memory import _Batch, _Batched

    barriers, summed = [], []
    batch = _Batch(SimpleNamespace(barrier=lambda: barriers.append(1)), size=2)
    first = _Batched(lambda: summed.append(0), batch)
    batch.add(first, first=True)
    with pytest.raises(RuntimeError, match="1 of 2 buckets launched"):
        first.wait(None)
    assert barriers == [] and summed == []
    works = [_Batched(lambda i=i: summed.append(i), batch) for i in range(2)]
    for i, work in enumerate(works):
        batch.add(work, first=i == 0)
    works[0].wait(None)
    works[1].wait(None)  # summed with the first, between the same two barriers
    assert barriers == [1, 1] and summed == [0, 1] and not batch.pending


def test_a_batch_forgets_a_round_abandoned_before_its_wait():
    """Backward raised on every worker after some buckets launched, and the script went on: that round met no
    barrier anywhere, so the next round (which begins at bucket 0) sums alone, as unbatched buckets do."""
    from fleet.collective.transports.shared_memory import _Batch, _Batched

    barriers, summed = [], []
    batch = _Batch(SimpleNamespace(barrier=lambda: barriers.append(1)), size=2)
    batch.add(_Batched(lambda: summed.append("abandoned"), batch), first=True)
    works = [_Batched(lambda i=i: summed.append(i), batch) for i in range(2)]
    for i, work in enumerate(works):
        batch.add(work, first=i == 0)
    works[0].wait(None)
    works[1].wait(None)
    assert barriers == [1, 1] and summed == [0, 1]
