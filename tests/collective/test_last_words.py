"""A worker that ends on an error is named with it by the peers that find it gone (issue 34).

The issue's failure: worker 0 reported "all-reduce of gradient bucket 0 failed: worker 1 died (its
process is gone)" and nothing else, because the harness then showed the first worker's error only,
and fleet could not tell an exception of worker 1's own from a crash. Worker 1's last words
(fleet/runtime/last_words.py) are kept in the job's shared memory, and the survivors name them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dist_harness import run_workers
from fleet.collective import shm
from fleet.runtime import last_words

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory path needs x86-64 and /dev/shm")


def _hosts(world: int = 2) -> list[shm.LocalHost]:
    """Every worker's view of one job's shared memory, in this process."""
    table = torch.zeros(shm.LocalHost.size(world) + 1, dtype=torch.int64)
    return [shm.LocalHost("test", table, rank, world, timeout_s=30) for rank in range(world)]


def _ended(host: shm.LocalHost, process: subprocess.Popen) -> None:
    """The worker of ``host`` joined the channels as ``process``, which has ended since."""
    for channel in (host.lockstep, host.buckets):
        channel.table[host.rank, 1] = process.pid


def test_a_gone_peer_is_named_with_the_error_it_ended_on():
    survivor, victim = _hosts()
    victim.say(last_words.summary(RuntimeError("worker 1's backward failed at step 2\nsecond line")))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _ended(victim, gone)
    with pytest.raises(shm.PeerGone) as error:
        survivor.buckets.barrier()
    assert str(error.value) == "worker 1 exited after an error: RuntimeError: worker 1's backward failed at step 2"
    assert error.value.ranks == [1]


def test_a_peer_killed_by_a_signal_is_named_with_it_while_the_kernel_shows_it():
    survivor, victim = _hosts()
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()  # not reaped yet: a zombie, whose exit the kernel still shows
    try:
        _ended(victim, killed)
        with pytest.raises(shm.PeerGone, match=r"^worker 1 died \(its process is gone\): killed by SIGKILL$"):
            survivor.lockstep.barrier()
    finally:
        killed.wait()
    with pytest.raises(shm.PeerGone, match=r"^worker 1 died \(its process is gone\)$"):  # reaped: nothing more
        survivor.lockstep.barrier()


def test_last_words_are_one_bounded_line_of_text():
    survivor, victim = _hosts()
    victim.say("x" * 1000 + "\n\x1b[2Jmore")
    words = survivor.last_words(1)
    assert words == "x" * last_words.MAX_BYTES
    victim.say("é" * 300)  # cut at a character's boundary, never inside one
    assert survivor.last_words(1) == "é" * (last_words.MAX_BYTES // 2)
    assert survivor.last_words(0) is None  # worker 0 said nothing
    for length in (-1, 10**9):  # a length the row cannot hold is read as nothing said
        victim._words[1, 0] = length
        assert survivor.last_words(1) is None


class _Listener:
    def __init__(self) -> None:
        self.heard: list[str] = []

    def hear(self, words: str) -> None:
        self.heard.append(words)


def test_an_uncaught_exception_is_said_by_fleets_excepthook(capsys):
    import fleet  # noqa: F401 - installs the hook

    listener = _Listener()
    last_words.listen(listener.hear)
    try:
        raise ValueError("bad batch")
    except ValueError as error:
        sys.excepthook(type(error), error, error.__traceback__)
    assert listener.heard == ["ValueError: bad batch"]
    assert "bad batch" in capsys.readouterr().err  # and Python's report is still printed


def failing_backward_worker(rank: int, shared_memory: bool) -> None:
    """Worker 1 raises inside its backward at step 2, after it announced the gradient round: its peer then
    waits for it in bucket 0, as worker 0 did in the issue."""
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(shared_memory=shared_memory))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        if rank == 1 and step == 2:

            def fail(param: torch.Tensor) -> None:  # the first layer's gradient is accumulated last
                raise RuntimeError("worker 1's backward failed at step 2")

            model[0].weight.register_post_accumulate_grad_hook(fail)
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    fleet.stop_worker()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["one-host", "process-group"])
def test_the_survivor_names_the_error_its_peer_ended_on_and_the_report_lists_both(shared_memory):
    """On one host the survivor reads worker 1's last words in shared memory; through the process group (workers
    on several hosts), in the rendezvous store, once worker 1's heartbeat is found silent."""
    with pytest.raises(AssertionError) as report:
        run_workers(failing_backward_worker, 2, shared_memory, timeout=45)
    text = str(report.value)
    named = "worker 1 exited after an error: RuntimeError: worker 1's backward failed at step 2"
    survivor = text.split("\n\nworker 1 ")[0]
    assert survivor.startswith("worker 0 error: PeerError: ") and f"failed: {named}" in survivor, text
    if shared_memory:  # the very place, where it said "worker 1 died (its process is gone)"
        assert f"all-reduce of gradient bucket 0 failed: {named}." in survivor, text
    assert "worker 1 error: RuntimeError: worker 1's backward failed at step 2" in text, text
    assert "worker 1 died" not in text, text


# --- what made worker 1 give up on a live worker 0 in the first place ------------------------------------------


def _waiting(answers: list, arrive_after: int):
    """A wait whose peers arrive after ``arrive_after`` slices, with the heartbeats' answers in order."""
    from fleet.collective import patience

    slices = []
    looks = iter(answers)

    def attempt(seconds: float):
        slices.append(seconds)
        return "arrived" if len(slices) > arrive_after else None

    return lambda: patience.wait_for_peers(attempt, 60, lambda: next(looks)), slices


def test_a_heartbeat_that_stands_still_for_one_look_only_is_slow_not_dead():
    """A live worker 0 starved of the CPU for one heartbeat window is waited for: judged dead, it made worker 1
    give up and exit, and worker 0 then reported worker 1's death (issue 34, reproduced by stopping worker 0
    for 9 s: PROBE_S + WATCH_S)."""
    wait, slices = _waiting([[0], [], []], arrive_after=2)
    assert wait() == "arrived" and len(slices) == 3


def test_a_heartbeat_silent_in_two_looks_in_a_row_is_dead():
    from fleet.collective import patience

    wait, _ = _waiting([[0], [0]], arrive_after=5)
    with pytest.raises(patience.Dead) as dead:
        wait()
    assert dead.value.ranks == [0]
    wait, _ = _waiting([None], arrive_after=5)  # the store's host is gone: at once
    with pytest.raises(patience.Dead):
        wait()
