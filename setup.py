"""Builds fleet's native sparse-table kernels (``fleet/sparse/csrc``); the rest is in pyproject.toml.

A few C++17 translation units on the raw CPython API: no build dependency but setuptools and a
compiler. ``pip install -e .`` and ``pip wheel .`` build it; in a source tree run with
``PYTHONPATH=$PWD``, rebuild it in place with ``python setup.py build_ext --inplace``
(docs/development.md). ``FLEET_NATIVE_SANITIZE=1`` builds it with AddressSanitizer and UBSan.

The engine is optional: without a working compiler fleet installs without it and says so (a GPU
node image often has no g++, and collective and sharding jobs do not need it); sparse tables and
parameter-server jobs then raise ``fleet.sparse.native.NativeEngineError`` naming the command that
builds it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_NO_COMPILER = """
fleet: WARNING: installing WITHOUT its native sparse-table engine (fleet/sparse/csrc): {reason}

  Works without it: collective and sharding jobs without sparse tables.
  Needs it: sparse tables (fleet.nn.SparseEmbedding, SparseEmbeddingBag, SparseFeatureCollection) and
  parameter-server jobs; they raise NativeEngineError saying how to build it.

  It needs a C++17 compiler (g++ 8 or later, or clang++ 7 or later) and the Python headers:
    Debian/Ubuntu:  apt-get install g++ python3-dev
    Fedora/RHEL:    dnf install gcc-c++ python3-devel
    macOS:          xcode-select --install
  then reinstall fleet: pip install --force-reinstall --no-deps <this source tree>
  (editable: pip install --force-reinstall --no-deps -e <this source tree>). CXX=... picks another compiler.
"""


def _flags() -> tuple[list[str], list[str]]:
    # No C++ exceptions (errors are Python exceptions set by hand): their cleanup regions kept GCC from
    # vectorising the optimizers' element loops. No errno from sqrt: its vector form needs that.
    compile_args = [
        "-std=c++17",
        "-O3",
        "-fno-math-errno",
        "-ffp-contract=off",  # no FMA contraction: the same bits as torch on every CPU (see csrc/common.h)
        "-fno-exceptions",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
    ]
    link_args: list[str] = []
    if os.environ.get("FLEET_NATIVE_SANITIZE"):
        # Run with the sanitizer runtime preloaded (docs/development.md: "Sanitizer build").
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
        compile_args = [a for a in compile_args if a != "-O3"] + ["-O1", *sanitize]
        link_args += sanitize
    return compile_args, link_args


class BuildNative(build_ext):
    """build_ext that installs fleet without its native engine, loudly, when the engine cannot be built."""

    def build_extension(self, ext: Extension) -> None:
        cxx = self.compiler.compiler_so[0] if getattr(self.compiler, "compiler_so", None) else None
        if cxx is not None and shutil.which(cxx) is None:
            self._without(f"the compiler '{cxx}' is not installed")
            return
        try:
            super().build_extension(ext)
        except Exception as err:  # CompileError, LinkError, DistutilsExecError: the message says what failed
            self._without(f"{type(err).__name__}: {err}")

    def _without(self, reason: str) -> None:
        # pip hides a successful build's output (-v shows it): so the warning goes to stderr (pip -v, build
        # logs, setup.py runs) and also straight to the terminal of a person running pip, if there is one.
        message = _NO_COMPILER.format(reason=reason)
        print(message, file=sys.stderr, flush=True)
        try:
            with open("/dev/tty", "w") as tty:
                tty.write(message)
        except OSError:
            pass  # no terminal (CI, a container build): stderr above is the record

    def copy_extensions_to_source(self) -> None:
        # A new file rather than the old one overwritten: a process that has the old one loaded keeps
        # its copy (writing over a loaded .so crashes the processes using it).
        for ext in self.extensions:
            target = os.path.join(os.path.dirname(os.path.abspath(__file__)), self.get_ext_filename(ext.name))
            if os.path.exists(target):
                os.unlink(target)
        super().copy_extensions_to_source()


_compile_args, _link_args = _flags()
setup(
    ext_modules=[
        Extension(
            "fleet.sparse._native",
            sources=sorted(str(p) for p in Path("fleet/sparse/csrc").glob("*.cpp")),
            depends=sorted(str(p) for p in Path("fleet/sparse/csrc").glob("*.h")),  # a header changed: rebuild
            language="c++",
            optional=True,  # BuildNative says what is missing; editable installs then skip its copy
            extra_compile_args=_compile_args,
            extra_link_args=_link_args,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
