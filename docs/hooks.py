"""MkDocs hooks: pages generated at build time, so they never drift from their sources.

- ``api.md``: one mkdocstrings block per public name, read from ``fleet.__all__``,
  ``fleet.nn.__all__`` and ``fleet.metrics.__all__`` (the names are read statically with ``ast``,
  so the build imports neither fleet nor torch; mkdocstrings then reads the docstrings).
- ``benchmarks/results.md``: the tables of ``benchmarks/results/**/*.json`` rendered by
  ``benchmarks/history.py``.

Both replace a marker comment in their page, so the pages' own prose stays in Markdown.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API_MARKER = "<!-- api-reference -->"
RESULTS_MARKER = "<!-- benchmark-results -->"

# Public modules and how their names are documented: (module, file defining __all__).
API_MODULES = [
    ("fleet", "fleet/__init__.py"),
    ("fleet.nn", "fleet/nn/__init__.py"),
    ("fleet.metrics", "fleet/metrics.py"),
]


def public_names(path: Path) -> list[str]:
    """A module's ``__all__``: a list of strings, ``sorted(<dict literal>)``, and ``+=`` lists."""
    tree = ast.parse(path.read_text())
    literals: dict[str, Any] = {}
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
            if target == "__all__":
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "sorted":
                    value = value.args[0]
                    if isinstance(value, ast.Name):
                        value = literals[value.id]
                names = (
                    sorted(ast.literal_eval(value)) if isinstance(value, ast.Dict) else list(ast.literal_eval(value))
                )
            else:
                literals[target] = value
        elif isinstance(node, ast.AugAssign) and getattr(node.target, "id", "") == "__all__":
            names += list(ast.literal_eval(node.value))
    if not names:
        raise ValueError(f"{path}: no __all__ found to document")
    return names


def api_reference() -> str:
    parts = []
    for module, file in API_MODULES:
        parts += [f"## `{module}`", ""]
        for name in public_names(ROOT / file):
            parts += [f"::: {module}.{name}", ""]
    return "\n".join(parts)


def _history():
    spec = importlib.util.spec_from_file_location("fleet_bench_history", ROOT / "benchmarks" / "history.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, api_reference())
    if RESULTS_MARKER in markdown:
        history = _history()
        markdown = markdown.replace(RESULTS_MARKER, history.results_page(history.load()))
    return markdown


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    server.watch(str(ROOT / "benchmarks" / "results"))
    server.watch(str(ROOT / "fleet"))
    return server
