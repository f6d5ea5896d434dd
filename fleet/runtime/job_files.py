"""Files a job's workers leave behind for the launcher (no torch here).

``<log dir>/joined/worker-<i>``: worker ``i`` called ``fleet.init()``. fleetrun's summary
names the workers of a multi-worker job that finished without it: they trained on their
own, not as one job, and would otherwise look like a success.

``/dev/shm/<prefix>-<owner>-*``: the shared-memory segments of workers on one host
(:mod:`fleet.collective.shm`). Workers unlink them as soon as every worker has mapped
them; a process killed in that moment would leave one, so fleetrun removes what is left
under the job's prefix when the job ends (a segment whose creator still runs belongs to a concurrent job with the
same secret, and stays). The prefix is derived from the job's secret,
without revealing it.

Files that only a ``kill -9`` of everything (fleetrun included) can leave behind -- such a
segment, or the on-host secret file of a job without fleetrun (:mod:`fleet.runtime.job_secret`)
-- carry their creator in their name (``<owner>``: its pid and start time, :func:`owner_tag`),
and the next ``fleet.init()`` or fleetrun on the host removes those of this user whose creator
is gone (:func:`remove_orphaned`).

``<temp dir>/fleet-ps-<16 hex>/``: the parameter servers' Unix sockets for workers on their
host (:mod:`fleet.ps.protocol.local`), named the same way. A server removes its socket when it
closes; fleetrun removes what a killed one left, and the directory, when the job ends.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import os
import re
import signal
import stat
import tempfile
from pathlib import Path

from fleet.runtime import env

SHM_DIR = "/dev/shm"

JOINED = "joined"
_NAME = re.compile(r"^worker-(\d+)$")


def mark_joined(log_dir: str | Path, worker_index: int) -> None:
    path = Path(log_dir, JOINED, f"worker-{worker_index}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(str(os.getpid()))
    except OSError:
        pass  # only the summary's note depends on it


def joined_workers(log_dir: str | Path) -> set[int]:
    try:
        names = os.listdir(Path(log_dir, JOINED))
    except OSError:
        return set()
    return {int(m.group(1)) for m in map(_NAME.match, names) if m}


def clear_joined(log_dir: str | Path) -> None:
    for index in joined_workers(log_dir):
        Path(log_dir, JOINED, f"worker-{index}").unlink(missing_ok=True)


_OWNER = re.compile(r"(\d+)\.(\d+)")
#: names that carry an owner: a job's shared-memory segment, an on-host secret file
_OWNED = re.compile(
    r"^fleet-(?:[0-9a-f]{16}|local)-(?P<owner>\d+\.\d+)-[0-9a-f]+(?:-.*)?$|^(?P<secret>\d+\.\d+)-[0-9a-f]{32}\.secret$"
)


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ..., start time at index 19); None
    when the process is gone. The name may hold spaces and parentheses, so the split is after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited, even if nobody reaped it yet)."""
    fields = proc_stat(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def exit_status(pid: int) -> str | None:
    """How an exited process that nobody has reaped yet (a zombie) ended: "killed by SIGKILL", "exited with
    status 1"; None when it runs, is gone, or the kernel does not say (its wait status is field 52 of
    /proc/<pid>/stat, since Linux 3.5, readable by its user)."""
    fields = proc_stat(pid)
    if not fields or fields[0] != "Z" or len(fields) < 50 or not fields[49].isdigit():
        return None
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        try:
            return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        except ValueError:
            return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot; None when it is gone."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 and fields[0] not in ("Z", "X") else None


def owner_tag(pid: int | None = None) -> str:
    """``<pid>.<start time>``: names a process uniquely on this host (a reused pid has another start time)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_time(pid) or 0}"


def owner_alive(tag: str) -> bool:
    """Whether the process a :func:`owner_tag` names still runs."""
    match = _OWNER.fullmatch(tag)
    return match is not None and _start_time(int(match.group(1))) == int(match.group(2))


def remove_orphaned(*folders: str) -> list[str]:
    """Remove this user's owner-tagged files in ``folders`` (default: /dev/shm) whose creator is gone."""
    removed = []
    for folder in folders or (SHM_DIR,):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            match = _OWNED.match(name)
            if match is None:
                continue
            path = os.path.join(folder, name)
            try:
                if os.lstat(path).st_uid != os.geteuid() or owner_alive(match.group("owner") or match.group("secret")):
                    continue
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue  # gone meanwhile, or not ours to remove
    return removed


def secret_dir() -> str:
    """Where on-host secret files go (:mod:`fleet.runtime.job_secret`): $XDG_RUNTIME_DIR/fleet/secrets (a tmpfs)
    or the user's state directory; not created here."""
    runtime = env.current().str(env.XDG_RUNTIME_DIR)
    base = runtime if runtime and os.path.isdir(runtime) else env.user_state_dir()
    return os.path.join(base, "fleet", "secrets")


def remove_orphaned_files() -> list[str]:
    """This user's on-host secret files and shared-memory segments whose creator is gone (a kill -9), removed.

    Cheap (two directory listings) and never raises: run at every ``fleet.init()`` and fleetrun start.
    """
    try:
        return remove_orphaned(secret_dir(), SHM_DIR) + remove_dead_ps_sockets()
    except Exception:  # noqa: BLE001 - a cleanup must not stop a job from starting
        return []


def shm_prefix(secret_hex: str | None = None) -> str:
    """``fleet-<16 hex>``: this job's shared-memory names (a fixed ``fleet-local`` without a secret)."""
    secret_hex = secret_hex if secret_hex is not None else env.current().str(env.FLEET_SECRET)
    if not secret_hex:
        return "fleet-local"
    digest = hmac.new(secret_hex.encode(), b"fleet-shared-memory", hashlib.sha256).hexdigest()
    return f"fleet-{digest[:16]}"


def remove_shm(secret_hex: str) -> list[str]:
    """Remove the segments of this job left in /dev/shm whose creator has ended; return their paths.

    Why not every segment under the prefix: the prefix is derived from the secret, which concurrent jobs may share
    (a FLEET_SECRET set for every job of a user); a job that ended must not unlink a running job's segment, whose
    creator still runs. This job's creators have all exited when fleetrun cleans up, so its own segments go.
    """
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{shm_prefix(secret_hex)}-*")):
        match = _OWNED.match(os.path.basename(path))
        if match is not None and match.group("owner") and owner_alive(match.group("owner")):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def ps_socket_dir(secret_hex: str) -> str:
    """The private directory of this job's parameter-server sockets (short enough for a socket's path)."""
    digest = hmac.new(bytes.fromhex(secret_hex).hex().encode(), b"fleet-ps-sockets", hashlib.sha256).hexdigest()
    base = tempfile.gettempdir()
    if len(base) > 48:  # sockaddr_un holds ~107 bytes: keep room for the name below
        base = "/tmp"
    return os.path.join(base, f"fleet-ps-{digest[:16]}")


def remove_ps_sockets(secret_hex: str) -> bool:
    """Remove the sockets of this job's directory that no server listens on (a server was killed), and the
    directory once empty; True when one was removed.

    Why not the whole directory: it is named by the secret, and jobs that share one (a FLEET_SECRET set for every
    job of a user) share it; a job that ended must not take a running job's sockets with it.
    """
    return bool(_remove_dead_sockets(ps_socket_dir(secret_hex)))


# A server's ZeroMQ ipc:// socket (fleet.ps.protocol.local) and its direct socket (fleet.ps.protocol.unix).
_PS_SOCKET_SUFFIXES = (".sock", ".direct")


def remove_dead_ps_sockets(base: str | None = None) -> list[str]:
    """This user's parameter-server Unix sockets (``<temp dir>/fleet-ps-*/*.sock`` and ``*.direct``) that no
    server listens on (a connection is refused: its server was killed), removed, and their directories once empty."""
    base = base or os.path.dirname(ps_socket_dir("00"))
    try:
        folders = [d for d in os.listdir(base) if d.startswith("fleet-ps-")]
    except OSError:
        return []
    return [path for folder in folders for path in _remove_dead_sockets(os.path.join(base, folder))]


def _remove_dead_sockets(directory: str) -> list[str]:
    """The sockets in ``directory`` (one of this user's) that no server listens on, removed, and the directory
    once empty; their paths."""
    try:
        info = os.lstat(directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return []  # not one this user made: leave it
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(_PS_SOCKET_SUFFIXES) and not _listening(path):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    try:
        os.rmdir(directory)  # only once empty: a live server's socket keeps it
    except OSError:
        pass
    return removed


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path`` (anything but a refusal counts as yes)."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # not ours to judge (a timeout, a permission): keep it
    finally:
        probe.close()
    return True
