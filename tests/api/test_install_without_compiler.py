"""fleet installs where there is no C++ compiler (a GPU node image without g++): without its native
sparse-table engine, with a warning that says what is missing, and collective jobs run there.

setup.py's build step is run with the compiler hidden (fast); the slow test pip-installs a copy of the
repository into a fresh venv with the compiler hidden, then runs a two-worker collective job under fleetrun
and checks that a sparse table and a parameter-server job name the command that builds the engine.
tests/sparse/test_native_optional.py covers the same in a source tree, by hiding the compiled module.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import fleet
from dist_harness import clean_env

ROOT = Path(fleet.__file__).resolve().parents[1]
WARNING = "fleet: WARNING: installing WITHOUT its native sparse-table engine (fleet/sparse/csrc)"
_IGNORE = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "build")


def _source_copy(into: Path) -> Path:
    """What pip builds fleet from, copied (the build writes next to its source)."""
    src = into / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "fleet", src / "fleet", ignore=_IGNORE)
    return src


def _no_compiler_env(tmp: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """An environment with no C++ compiler: CC and CXX name a program that does not exist, and PATH holds
    only ``bin_dir`` (no g++, c++, gcc or cc); no PYTHONPATH, so the installed fleet is the one imported."""
    missing = str(tmp / "no-compiler" / "c++")
    environ = clean_env(CC=missing, CXX=missing, PATH=str(bin_dir), NO_COLOR="1", COLUMNS="200", **extra)
    environ.pop("PYTHONPATH", None)
    for name in ("g++", "c++", "gcc", "cc", "clang++"):
        assert shutil.which(name, path=environ["PATH"]) is None, name
    return environ


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_setup_py_without_a_working_compiler_builds_without_the_engine_and_says_so(compiler, tmp_path) -> None:
    src = _source_copy(tmp_path)
    environ = _no_compiler_env(tmp_path, Path(sys.executable).parent)
    if compiler == "failing":  # there, but every compile fails (no Python headers, a broken toolchain)
        environ["CC"] = environ["CXX"] = shutil.which("false") or "/bin/false"
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--build-lib", "lib", "--build-temp", "tmp"],
        cwd=src,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert WARNING in done.stderr, done.stderr
    reason = "is not installed" if compiler == "missing" else "CompileError"
    assert reason in done.stderr.split(WARNING, 1)[1].splitlines()[0], done.stderr
    for line in ("Works without it: collective and sharding jobs", "apt-get install g++ python3-dev"):
        assert line in done.stderr, done.stderr
    assert not list((src / "lib").rglob("_native*")), "no engine was built, none may be installed"


def _in_a_terminal(cmd: list[str], environ: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as its controlling terminal and stdout/stderr, as a person at a
    shell would; what it printed there, and its exit status."""
    import fcntl
    import pty
    import termios

    main, child = pty.openpty()
    proc = subprocess.Popen(
        cmd,
        stdin=child,
        stdout=child,
        stderr=child,
        env=environ,
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # after setsid: the pty becomes /dev/tty
    )
    os.close(child)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # EIO: every process holding the terminal is gone
                break
            if not chunk:
                break
            out += chunk
        else:
            proc.kill()
            raise AssertionError(f"{cmd} did not finish in {timeout} s: {out.decode(errors='replace')[-3000:]}")
        return proc.wait(timeout=30), out.decode(errors="replace").replace("\r\n", "\n")
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()


_CHECKS = textwrap.dedent(
    """
    import importlib.util
    import sys

    import fleet
    import fleet.nn
    from fleet.sparse.native import NativeEngineError

    assert fleet.__file__.startswith(sys.prefix), (fleet.__file__, sys.prefix)  # the venv's copy, not the source
    assert importlib.util.find_spec("fleet.sparse._native") is None, "the install holds an engine"
    for build in (lambda: fleet.nn.SparseEmbedding(8), lambda: fleet.init(strategy=fleet.DistributedStrategy(mode="ps"))):
        try:
            build()
        except NativeEngineError as error:
            print("REFUSED:", error)
        else:
            raise AssertionError("built without the engine")
    """
)

_JOB = textwrap.dedent(
    """
    import copy

    import torch

    import fleet

    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    reference = copy.deepcopy(model)  # one process on the union of the workers' batches
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    me, n = fleet.worker_index(), fleet.worker_num()
    for _ in range(3):
        x, y = torch.randn(8 * n, 4), torch.randn(8 * n, 1)
        for m, o, part in ((model, opt, slice(8 * me, 8 * me + 8)), (reference, ref_opt, slice(None))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x[part]), y[part]).backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
    print(f"TRAINED as worker {me} of {n}")
    """
)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_pip_install_without_a_compiler_then_a_collective_job(tmp_path) -> None:
    src = _source_copy(tmp_path)
    venv = tmp_path / "venv"
    # --without-pip: this interpreter's pip and setuptools build it (no download); the .pth line makes this
    # environment's packages (torch, ...) visible even where it is itself a venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(purelib, "outer-environment.pth").write_text("\n".join(p for p in sys.path if p.endswith("-packages")))
    environ = _no_compiler_env(tmp_path, venv / "bin")

    status, shown = _in_a_terminal(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
        environ,
        timeout=600,
    )
    assert status == 0, shown
    assert WARNING in shown, shown  # pip hides a successful build's output: the build writes to the terminal
    assert "is not installed" in shown.split(WARNING, 1)[1].splitlines()[0], shown
    assert "Successfully installed fleet" in shown, shown
    assert not list(Path(purelib, "fleet").rglob("_native*")), "the install holds an engine"

    (tmp_path / "checks.py").write_text(_CHECKS)
    checks = subprocess.run(
        [python, "checks.py"], cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=300
    )
    assert checks.returncode == 0, checks.stdout + checks.stderr
    refused = [line for line in checks.stdout.splitlines() if line.startswith("REFUSED: ")]
    assert [line.split(" needs ")[0] for line in refused] == [
        "REFUSED: fleet.nn.SparseEmbedding",
        "REFUSED: A parameter-server job (mode='ps')",
    ], checks.stdout
    for line in refused:  # the command that builds it, for this installation: reinstall from where it came
        assert f"then run `pip install --force-reinstall --no-deps {src}`" in line, line
        assert "apt-get install g++ python3-dev" in line, line

    (tmp_path / "job.py").write_text(_JOB)
    job = subprocess.run(
        [python, "-m", "fleet.launch", "--workers", "2", "job.py"],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert job.returncode == 0, job.stdout + job.stderr
    for rank in range(2):
        assert f"[worker {rank}] TRAINED as worker {rank} of 2" in job.stdout, job.stdout
