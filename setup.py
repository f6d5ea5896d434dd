"""Builds fleet's native sparse-table kernels (``fleet/sparse/csrc``); the rest is in pyproject.toml.

A few C++17 translation units on the raw CPython API: no build dependency but setuptools and a
compiler. ``pip install -e .`` and ``pip wheel .`` build it; in a source tree run with
``PYTHONPATH=$PWD``, rebuild it in place with ``python setup.py build_ext --inplace``
(docs/development.md). ``FLEET_NATIVE_SANITIZE=1`` builds it with AddressSanitizer and UBSan.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_NO_COMPILER = """
fleet: cannot build its native sparse-table engine (fleet/sparse/csrc): {reason}

It needs a C++17 compiler (g++ 8 or later, or clang++ 7 or later) and the Python headers:
  Debian/Ubuntu:  apt-get install g++ python3-dev
  Fedora/RHEL:    dnf install gcc-c++ python3-devel
  macOS:          xcode-select --install
then run the install again. (CXX=... picks another compiler.)
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
    """build_ext that says what to install when there is no working compiler."""

    def build_extension(self, ext: Extension) -> None:
        cxx = self.compiler.compiler_so[0] if getattr(self.compiler, "compiler_so", None) else None
        if cxx is not None and shutil.which(cxx) is None:
            raise SystemExit(_NO_COMPILER.format(reason=f"the compiler '{cxx}' is not installed"))
        try:
            super().build_extension(ext)
        except Exception as err:  # CompileError, LinkError, DistutilsExecError: the message says what failed
            raise SystemExit(_NO_COMPILER.format(reason=f"{type(err).__name__}: {err}")) from err

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
            extra_compile_args=_compile_args,
            extra_link_args=_link_args,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
