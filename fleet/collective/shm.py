"""Shared memory between the workers of one host: segments, and a channel for barriers and small all-gathers.

Why: on a busy machine every collective that goes through gloo pays thread hand-offs (the
calling thread wakes gloo's I/O thread, which wakes the peer's, which wakes the peer's
caller), each a scheduling delay of up to a time slice when the cores are busy computing.
Measured on W1 (2 workers on 2 cores), a round's 48-byte header exchange took 2.6 ms and a
bucket's two barriers most of a 6 ms tail. A :class:`Channel` does the same on the calling
thread: each worker writes its values and then a sequence number into its own slot of a
shared table and waits, yielding the CPU, until every slot shows that sequence.

Ordering: a worker's values (and the gradients it wrote before a barrier) become visible to
the others no later than its sequence number because x86-64 keeps stores in order and
loads in order (TSO) and every write here is a separate call; :func:`supported` limits this
path to x86-64 (elsewhere fleet keeps the process group).

Values are double-buffered by the parity of the sequence number: a worker can only write
sequence s+2 (over the buffer of s) after every worker wrote s+1, which each does only after
it finished reading s.

A peer that dies is noticed within about a second (its process is gone), one that hangs
after the timeout: either way the wait raises :class:`ChannelError` naming it. A peer that
ended on an exception of its own left that exception's line in the shared memory first
(:mod:`fleet.runtime.last_words`), and the error names it ("worker 1 exited after an error:
RuntimeError: ..."): the cause, not its consequence on the survivors; one killed by a signal
is named with it where the kernel still shows its exit (an unreaped zombie). The first needs
the peer's pid to mean the same process here: only when every worker is in this process's pid
namespace (:meth:`LocalHost.connect` compares them); otherwise (containers that share
``/dev/shm`` but not their pids) a peer's pid is never looked up, and only the timeout applies.

Whether workers share a host is never guessed from an address or a host name: worker 0 makes a
segment under an unguessable name and writes a value into it, and the path is used only when
every worker maps that name and reads that value back (:meth:`LocalHost.connect`; docs/
architecture.md, "How fleet decides two processes share a host").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import time
from collections.abc import Callable

import torch

from fleet.errors import PeerError
from fleet.runtime import env, last_words
from fleet.runtime.job_files import SHM_DIR, exit_status, owner_tag, process_alive, shm_prefix

_SPINS = 50  # yields (tens of microseconds on idle cores) before sleeping in the kernel
# ... and at most this long: on busy cores each yield hands the core to another process for up to its time
# slice, so fifty of them were tens of milliseconds and as many context switches per wait (W6 PS: 60-75 a
# step per worker at a load of 10); past this the wait sleeps on the futex, which the peer's arrival wakes
_SPIN_S = 100e-6
_CHECK_PEERS_S = 0.5
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def spinning_pays(workers_here: int, environ: env.EnvReader | None = None) -> bool:
    """Whether a waiting worker may yield a few times (:data:`_SPINS`) before it sleeps on the futex.

    Only where every process of the job on this host has a core of its own: the workers here and, under
    fleetrun, its other processes (``FLEET_LOCAL_PROCESSES``: parameter servers too). Fewer cores than
    processes, each yield hands the core to a process that had it anyway, or, when none is runnable there,
    spins for nothing: W6's PS job (2 workers and a server on 2 cores) spent about a twentieth of each
    worker's time in these spins.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = (environ or env.current()).int(env.FLEET_LOCAL_PROCESSES, workers_here) or workers_here
    return cores >= max(processes, workers_here)


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` (in shared memory) is woken, changes, or the time is up.

    A waiting worker must not keep a core busy: on a machine whose cores all compute (W1),
    even polling slowed the worker still computing (by a fifth, measured) and it stayed behind.
    """
    whole = int(timeout_s)
    spec = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(spec), None, 0
    )


def _futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(1 << 30), None, None, 0)


class ChannelError(RuntimeError):
    def __init__(self, message: str, ranks: list[int]):
        super().__init__(message)
        self.ranks = ranks


class PeerGone(ChannelError):
    """Workers (``ranks``) whose process is gone: each named with its last words or its exit, where known."""


class ChannelLate(ChannelError):
    """Workers (``ranks``) did not arrive within the wait; their processes are alive. The exchange is still
    open: collecting it again goes on waiting for them."""


def create(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new, fully allocated, owner-only segment, mapped shared (a full /dev/shm fails here, never later)."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(size, 1))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return attach(path, numel, dtype)


def attach(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map an existing segment (torch.from_file would create a missing file: check first)."""
    size = numel * torch.empty((), dtype=dtype).element_size()
    if os.stat(path).st_size < size:
        raise OSError(f"{path} holds {os.stat(path).st_size} bytes, expected {size}")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class Channel:
    """Barriers and all-gathers of ``width`` int64 values among ``world`` workers on one host.

    ``table``: a shared int64 tensor of ``world x (2 + 2 * width)``: per worker its sequence
    number, its pid, then two value buffers. Each worker writes only its own row.
    """

    def __init__(
        self,
        table: torch.Tensor,
        rank: int,
        world: int,
        width: int,
        timeout_s: float,
        check_pids: bool = True,
        epitaph: Callable[[int], str | None] | None = None,
        spin: bool = True,
    ):
        """``epitaph``: a gone worker's last words, by rank (:meth:`LocalHost.last_words`), where kept.
        ``spin``: whether a wait yields a few times before it sleeps (a job's channels: :func:`spinning_pays`)."""
        self.table = table.view(world, 2 + 2 * width)
        self._spins = _SPINS if spin else 0
        self.epitaph = epitaph
        # The same memory as numpy, for the reads and writes of every exchange: a wait reads every worker's
        # sequence number at each of its spins, and torch's indexing costs microseconds per access, numpy's
        # a fraction of one (the waiting worker's CPU is taken from the peer it waits for on shared cores).
        self._np = self.table.numpy()
        self._seqs = self._np[:, 0]
        self._seq_addresses = [self.table[r, 0:1].data_ptr() for r in range(world)]
        self._own_seq_address = self._seq_addresses[rank]
        self.rank = rank
        self.world = world
        self.width = width
        self.timeout_s = timeout_s
        #: whether a late peer's pid is looked up here (only when every worker shares this pid namespace)
        self.check_pids = check_pids
        self.seq = int(self.table[rank, 0])
        self.table[rank, 1] = os.getpid()

    @staticmethod
    def numel(world: int, width: int) -> int:
        return world * (2 + 2 * width)

    def barrier(self) -> None:
        self.seq += 1
        self._arrive()
        self._wait(self.seq)

    def _arrive(self) -> None:
        self._np[self.rank, 0] = self.seq
        _futex_wake(self._own_seq_address)

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every worker's ``values`` (``width`` ints), by rank."""
        return self.collect(self.post(values))

    def post(self, values: list[int]) -> int:
        """The first half of :meth:`exchange`: publish ``values`` and return at once; :meth:`collect` the
        returned sequence before posting again (the double buffer holds for one exchange in flight)."""
        self.seq += 1
        start = 2 + (self.seq % 2) * self.width
        self._np[self.rank, start : start + len(values)] = values
        self._arrive()
        return self.seq

    def collect(self, seq: int, within_s: float | None = None) -> list[list[int]]:
        """The second half of :meth:`exchange`: wait for every worker's values of ``seq``, by rank.

        ``within_s``: wait at most this long (default: the channel's timeout); :class:`ChannelLate` then
        leaves the exchange open, so a caller may look at the peers' heartbeats and collect again."""
        assert seq == self.seq, "collect the exchange in flight before posting another"
        self._wait(seq, self.timeout_s if within_s is None else within_s)
        start = 2 + (seq % 2) * self.width
        return self._np[:, start : start + self.width].tolist()

    def _wait(self, seq: int, within_s: float | None = None) -> None:
        within_s = self.timeout_s if within_s is None else within_s
        started = time.monotonic()
        checked = started
        spins = 0
        while True:
            seqs = self._seqs.tolist()
            late = [r for r, s in enumerate(seqs) if s < seq]
            if not late:
                return
            spins += 1
            if spins < self._spins and time.monotonic() - started < _SPIN_S:
                time.sleep(0)
                continue
            # Sleep on the first late worker's sequence word; it wakes us when it arrives.
            _futex_wait(self._seq_addresses[late[0]], seqs[late[0]] & 0x7FFFFFFF, _CHECK_PEERS_S)
            now = time.monotonic()
            if self.check_pids and now - checked >= _CHECK_PEERS_S:
                checked = now
                # A pid of 0: the peer has mapped the table but not built its channel yet (connect's agreement
                # came first), so it is late, not dead: only the timeout applies to it.
                gone = [r for r in late if (pid := int(self.table[r, 1])) and not process_alive(pid)]
                if gone:
                    raise PeerGone("; ".join(self._obituary(r) for r in gone), gone)
            if now - started >= within_s:
                names = ", ".join(f"worker {r}" for r in late)
                raise ChannelLate(f"{names} did not arrive within {within_s:g} s", late)

    def _obituary(self, rank: int) -> str:
        """How worker ``rank``, whose process is gone, ended: its last words, else its exit where the kernel
        still shows it, else only that it is gone."""
        words = self.epitaph(rank) if self.epitaph is not None else None
        if words:
            return f"worker {rank} exited after an error: {words.rstrip('.')}"
        ended = exit_status(int(self.table[rank, 1]))
        return f"worker {rank} died (its process is gone)" + (f": {ended}" if ended else "")


class LocalHost:
    """The shared memory of a job whose workers all run on this host (:meth:`connect`).

    ``token`` names the job's segments (under :func:`fleet.runtime.job_files.shm_prefix`, which fleetrun cleans up); ``lockstep``, ``buckets`` and ``tables`` are three channels (the
    headers of :mod:`fleet.collective.lockstep`, the gradient transport's barriers, and the
    all-to-alls of sharded tables, :class:`fleet.collective.all_to_all.SharedMemoryAllToAll`), so that the training
    thread and the transport's thread never share a sequence, and each user's meetings alternate
    its double buffers alike on every worker.
    """

    LOCKSTEP_WIDTH = 6
    BUCKETS_WIDTH = 1
    TABLES_WIDTH = 1
    WORDS = 1 + (last_words.MAX_BYTES + 7) // 8  # a worker's last words: their length, then their UTF-8 bytes

    def __init__(
        self, token: str, table: torch.Tensor, rank: int, world: int, timeout_s: float, check_pids: bool = True
    ):
        self.token = token
        self.rank = rank
        self.world = world
        first = Channel.numel(world, self.LOCKSTEP_WIDTH)
        second = first + Channel.numel(world, self.BUCKETS_WIDTH)
        third = second + Channel.numel(world, self.TABLES_WIDTH)
        self._words = table[third : self.size(world)].view(world, self.WORDS)
        spin = spinning_pays(world)
        self.lockstep = Channel(
            table[:first], rank, world, self.LOCKSTEP_WIDTH, timeout_s, check_pids, epitaph=self.last_words, spin=spin
        )
        self.buckets = Channel(
            table[first:second], rank, world, self.BUCKETS_WIDTH, timeout_s, check_pids, epitaph=self.last_words,
            spin=spin,
        )  # fmt: skip
        self.tables = Channel(
            table[second:third], rank, world, self.TABLES_WIDTH, timeout_s, check_pids, epitaph=self.last_words,
            spin=spin,
        )  # fmt: skip
        last_words.listen(self.say)

    @staticmethod
    def size(world: int) -> int:
        """The channels' int64s and the workers' last words (the control segment holds one more: worker 0's
        proof value, :meth:`connect`)."""
        channels = sum(
            Channel.numel(world, width)
            for width in (LocalHost.LOCKSTEP_WIDTH, LocalHost.BUCKETS_WIDTH, LocalHost.TABLES_WIDTH)
        )
        return channels + world * LocalHost.WORDS

    def say(self, words: str) -> None:
        """This worker's last words (:mod:`fleet.runtime.last_words`), into its own row: the bytes, then their
        length, so a peer never reads a length ahead of its bytes (x86-64 keeps stores in order)."""
        data = last_words.clip(words).encode()
        padded = bytearray((self.WORDS - 1) * 8)
        padded[: len(data)] = data
        row = self._words[self.rank]
        row[1:] = torch.frombuffer(padded, dtype=torch.int64)
        row[0] = len(data)

    def last_words(self, rank: int) -> str | None:
        """Worker ``rank``'s last words, if it said any: text only, bounded, one printable line."""
        row = self._words[rank].clone()
        length = int(row[0])
        if not 0 < length <= (self.WORDS - 1) * 8:
            return None
        return last_words.clip(bytes(row[1:].view(torch.uint8)[:length].tolist()).decode(errors="replace"))

    @classmethod
    def connect(cls, group: object, timeout_s: float) -> LocalHost | None:
        """Collective over ``group``: a LocalHost when every worker proves it shares worker 0's /dev/shm, else None.

        The proof: worker 0 makes the control segment under a name nobody can guess (16 random bytes, sent
        over ``group``) and writes a value derived from them into it; each other worker maps that name and must
        read the value back. Only the same memory shows it (not a same-named file in another /dev/shm, nor
        one on a file system two kernels share). A worker on another host, in a container with its own
        /dev/shm, or without /dev/shm answers no, and every worker keeps the process group. Peers' pids are
        checked for liveness only when every worker is in the same pid namespace (:class:`Channel`).
        """
        import secrets

        import torch.distributed as dist

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        token = torch.zeros(16, dtype=torch.uint8)
        if rank == 0:
            token.copy_(torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8))
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
        # rank 0's owner tag in the name: the next fleet start on this host removes what a kill -9 left
        owner = torch.zeros(2, dtype=torch.int64)
        if rank == 0:
            owner.copy_(torch.tensor([int(part) for part in owner_tag().split(".")]))
        dist.broadcast(owner, src=dist.get_global_rank(group, 0), group=group)
        name = f"{shm_prefix()}-{int(owner[0])}.{int(owner[1])}-{bytes(token.tolist()).hex()}"
        path = os.path.join(SHM_DIR, f"{name}-control")
        proof = int.from_bytes(bytes(token[8:].tolist()), "little", signed=True) or 1
        size = cls.size(world)
        table = None
        if rank == 0 and supported():
            try:
                table = create(path, size + 1, torch.int64)
                table[size] = proof
            except OSError:
                table = None

        def everyone(ok: bool) -> bool:
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            return bool(flag.item())

        if not everyone(rank != 0 or table is not None):
            return None
        if rank != 0 and supported():
            try:
                table = attach(path, size + 1, torch.int64)
            except OSError:  # not there: another host, or another /dev/shm namespace
                table = None
            if table is not None and int(table[size]) != proof:
                table = None  # a file of that name, but not worker 0's memory
        # Everyone mapped it, and whether everyone shares one pid namespace (min == -max of the namespace ids).
        namespace = pid_namespace()
        agreed = torch.tensor([1 if table is not None else 0, namespace, -namespace], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        mapped, lowest, highest = int(agreed[0]) == 1, int(agreed[1]), -int(agreed[2])
        if rank == 0:
            os.unlink(path)  # every worker has it mapped (or gave up): nothing is left behind
        if not mapped:
            return None
        return cls(name, table, rank, world, timeout_s, check_pids=0 < lowest == highest)


def pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid); 0 when it cannot be read."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


SEGMENT_ALIGN = 4096  # segment halves are whole pages


class SharedSegments:
    """Each worker's own growing, double-buffered segment, and its peers' mapped here: the state and the
    meeting that the shared-memory collectives of a job share (sharding's all-gather and reduce-scatter,
    :mod:`fleet.sharding.shm_collectives`; sharded tables' all-to-all, :mod:`fleet.collective.all_to_all`).

    A worker that needs a larger segment makes the next generation (:meth:`_room`) and names it at the
    next meeting (:meth:`_meet`), where each peer maps it; its name is removed once every worker has mapped
    it. A worker whose ``/dev/shm`` refuses says so at the meeting, and every worker falls back together.
    ``channel``: the :class:`Channel` that carries the meetings; ``tag`` names the segments; ``doubling``:
    a segment grows at least twofold (sizes that grow step by step) rather than to the size asked.
    """

    def __init__(
        self,
        host: LocalHost,
        channel: Channel,
        tag: str,
        doubling: bool,
        diagnose: Callable[[], str | None] | None = None,
    ):
        self.rank = host.rank
        self.world = host.world
        self.channel = channel
        self.token = host.token
        self.diagnose = diagnose
        self.usable = True  # False once a worker could not get shared memory: every worker falls back
        self._tag = tag
        self._doubling = doubling
        self._mine = torch.empty(0, dtype=torch.uint8)  # this worker's segment: two halves of _half bytes
        self._half = 0
        self._generation = 0
        self._peers: list[torch.Tensor | None] = [None] * self.world  # every worker's segment, mapped here
        self._generations = [0] * self.world
        self._to_unlink: list[tuple[int, str]] = []  # (sequence from which every worker has mapped it, path)
        self._refused: OSError | None = None

    def _room(self, nbytes: int) -> bool:
        """Make each half hold ``nbytes``; False if ``/dev/shm`` refused (then this worker says so)."""
        if nbytes <= self._half:
            return True
        if self._refused is not None:
            return False
        wanted = max(nbytes, 2 * self._half) if self._doubling else nbytes
        half = -(-wanted // SEGMENT_ALIGN) * SEGMENT_ALIGN
        path = self._path(self.rank, self._generation + 1)
        try:
            segment = create(path, 2 * half, torch.uint8)
        except OSError as error:
            self._refused = error
            return False
        self._mine, self._half, self._generation = segment, half, self._generation + 1
        self._peers[self.rank] = segment
        self._generations[self.rank] = self._generation
        # The peers map it after the next meeting, before they arrive at the one after.
        self._to_unlink.append((self._clock() + 2, path))
        return True

    def _path(self, rank: int, generation: int) -> str:
        return os.path.join(SHM_DIR, f"{self.token}-{self._tag}-{rank}-{generation}")

    def _clock(self) -> int:
        """The meetings so far (the same on every worker): their parity picks the half an exchange uses."""
        return self.channel.seq

    def _meet(self, ok: bool, what: str, meet: Callable[[int], list[int]] | None = None) -> bool:
        """Arrive with this worker's segment generation (-1: no shared memory here) and wait for all; map the
        peers' new segments. False: someone had no shared memory, every worker falls back (:meth:`_fell_back`).
        ``meet``: another meeting that carries the generation (every worker's value back, by rank) and raises
        its own errors, instead of this channel's."""
        value = self._generation if ok else -1
        if meet is not None:
            generations = meet(value)
        else:
            try:
                generations = [row[0] for row in self.channel.exchange([value])]
            except ChannelError as error:
                gone = isinstance(error, PeerGone)
                diagnosis = None if gone or self.diagnose is None else self.diagnose()
                raise PeerError.from_collective(what, error, diagnosis, plain=gone) from None
        self._met()
        if min(generations) < 0:
            self.usable = False
            self._fell_back()
            return False
        for rank, generation in enumerate(generations):
            if rank != self.rank and generation != self._generations[rank]:
                path = self._path(rank, generation)
                self._peers[rank] = attach(path, os.stat(path).st_size, torch.uint8)
                self._generations[rank] = generation
        while self._to_unlink and self._to_unlink[0][0] <= self._clock():
            self._unlink(self._to_unlink.pop(0)[1])
        return True

    def _met(self) -> None:
        """A meeting just ended (a subclass that counts its own meetings counts it)."""

    def _fell_back(self) -> None:
        """Every worker has just given up shared memory (a subclass may say so)."""

    def close(self) -> None:
        """Remove the names of segments not yet removed (a job ending right after one was made)."""
        for _, path in self._to_unlink:
            self._unlink(path)
        self._to_unlink.clear()

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass
