"""Benchmark history as data: read ``benchmarks/results/**/*.json`` and render it.

Every benchmark script writes its results through ``benchmarks/_common.py``'s ``record_result``
(one JSON file per result); the figures published before that are transcribed into the same format
(``"source": "transcribed from README history"``). This module turns the files into

- the docs' results page (``docs/benchmarks/results.md``'s body, filled in at build time by
  ``docs/hooks.py``): per benchmark, its latest headline result and a table of every result;
- the README's headline lines (one per benchmark: the newest result marked ``headline``), which
  ``python benchmarks/history.py --readme`` writes between the README's ``results`` markers and
  ``tests/api/test_docs.py`` checks are current.

Output depends only on the files (sorted by date, then file name), never on the clock, so the
build is deterministic. Standard library only: the docs build must not need torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
RESULTS_PAGE = "docs/benchmarks/results.md"

# Page order and titles; a benchmark not listed here still appears, after these, by name.
TITLES = {
    "w1_collective": "W1: collective sync vs DistributedDataParallel",
    "w2_ctr": "W2: CTR model on the parameter server",
    "w2_peers": "W2 against TorchRec and PaddlePaddle",
    "w3_transport": "W3: parameter-server transport vs raw TCP",
    "w3_sparse_table": "W3: sparse table pulls and pushes",
    "w3_server_threads": "W3: one server's table threads, 1 vs 2",
    "ps_hardening": "PS fairness: a huge batch beside a normal worker",
    "sparse_rows": "Bytes per sparse row",
    "bag_pooling": "Multi-hot pooling: SparseEmbeddingBag vs rows per looked-up id",
    "w5_lifecycle": "W5: sparse-table life cycle on a drifting stream",
    "w6_dlrm": "W6: DLRM-shaped model vs PyTorch and TorchRec",
    "stragglers": "W4: stragglers, sync + backup worker vs sync",
    "scaling": "Scaling: measured vs fleet.plan's prediction",
    "scaling_sim": "Simulation of W4 and beyond",
    "fanout": "Fan-out of synchronous steps",
    "sharding_memory": "Sharding (FSDP2) memory per worker",
    "sharding_vs_fsdp2": "Sharding vs raw FSDP2 step time",
    "slot_data": "SlotDataset parse rate",
    "rendezvous_join": "Authenticated rendezvous cost",
}


def load(results: Path = RESULTS) -> list[dict[str, Any]]:
    """Every result, oldest first (undated transcriptions first, then by date, then by file name)."""
    records = []
    for path in sorted(results.glob("*/*.json")):
        record = json.loads(path.read_text())
        record["_file"] = path.relative_to(results).as_posix()
        records.append(record)
    return sorted(records, key=lambda r: (r.get("date") or "", r["_file"]))


def by_benchmark(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records grouped per benchmark, in the page's order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(record["benchmark"], []).append(record)
    order = [b for b in TITLES if b in groups] + sorted(b for b in groups if b not in TITLES)
    return {b: groups[b] for b in order}


def latest(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The newest headline record of one benchmark (the newest record when none is marked)."""
    marked = [r for r in records if r.get("headline", True)]
    return (marked or records)[-1]


def _anchor(benchmark: str) -> str:
    return benchmark.replace("_", "-")


def _number(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        text = f"{value:.4g}"
        return text if "." in text or "e" in text else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _load(record: dict[str, Any]) -> str:
    load = record.get("load") or {}
    if "as_written" in load:
        return str(load["as_written"])
    before, after = load.get("before"), load.get("after")
    if before and after:
        return f"{before[0]:.1f} -> {after[0]:.1f}"
    return ""


def _date(record: dict[str, Any]) -> str:
    return (record.get("date") or "undated")[:10]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def title(benchmark: str) -> str:
    return TITLES.get(benchmark, benchmark)


def results_page(records: list[dict[str, Any]]) -> str:
    """The results page's body in Markdown: per benchmark its latest line, then every result."""
    out = []
    for benchmark, group in by_benchmark(records).items():
        head = latest(group)
        out += [f"## {title(benchmark)} {{#{_anchor(benchmark)}}}", ""]
        out += [f"**Latest** ({_date(head)}, {head['variant']}): {head['summary']}", ""]
        out += [f"Command: `{head['command']}`" + (f"; target: {head['target']}" if head.get("target") else ""), ""]
        out += [
            "| date | variant | fleet | peer | ratio | units | load | summary |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in reversed(group):
            peer = r.get("peer") or {}
            peer_cell = f"{peer.get('name', '')} {_number(peer.get('value'))}".strip()
            row = [_date(r), r["variant"], _number(r.get("fleet")), peer_cell, _number(r.get("ratio"))]
            row += [r.get("units", ""), _load(r), r["summary"]]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
        out.append("")
        commands = sorted({r["command"] for r in group})
        out += ["Commands: " + "; ".join(f"`{c}`" for c in commands), ""]
        for r in reversed(group):  # the wording a transcribed run was published with, kept whole
            if r.get("note"):
                out += [f"> As published ({_date(r)}, {r['variant']}): {r['note']}", ""]
    return "\n".join(out)


def readme_lines(records: list[dict[str, Any]]) -> str:
    """One line per benchmark for the README: its newest headline result, linking to the page."""
    lines = []
    for benchmark, group in by_benchmark(records).items():
        head = latest(group)
        link = f"{RESULTS_PAGE}#{_anchor(benchmark)}"
        lines.append(f"- **{title(benchmark)}**: {head['summary']} ({_date(head)}; [all runs]({link}))")
    return "\n".join(lines)


def readme_block(readme: str) -> str:
    """The text between the README's results markers."""
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[start:end].strip("\n")


def write_readme(readme_path: Path = README, records: list[dict[str, Any]] | None = None) -> bool:
    """Rewrite the README's results block from the files; True when it changed."""
    text = readme_path.read_text()
    new = readme_lines(load() if records is None else records)
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    updated = text[:start] + "\n" + new + "\n" + text[end:]
    if updated != text:
        readme_path.write_text(updated)
    return updated != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="update the README's headline lines")
    args = parser.parse_args(argv)
    records = load()
    if args.readme:
        print("README.md updated" if write_readme(records=records) else "README.md already current")
    else:
        sys.stdout.write(results_page(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
