"""Run the user's training script for a short while as one worker and record what the cost model needs.

    fleetrun --workers 1 fleet/plan/probe.py --out probe.json [--steps 30 --seconds 20] -- script.py [args]

(``fleetrun --plan`` starts it; it is a script so that fleetrun launches it like any other.)
The user's script runs unchanged in this process (``runpy``, as ``__main__``, with its own
``sys.argv`` and directory on ``sys.path``). What is recorded, without touching the script:

- per-step computation, from fleet's own step recorder (:mod:`fleet.telemetry.timing`): every wrapped
  optimizer closes each step there, so each step's (wall, computation, communication) is read
  as it is recorded; a script that does not use fleet is timed from torch's global
  optimizer-step hook instead (the time between consecutive steps);
- the gradient bytes of a step (parameters that have a dense gradient at ``step()``), the
  sparse rows of a step (unique ids through every ``fleet.nn.SparseEmbedding``) and their
  width, the device of the parameters, the optimizer class, torch's intra-op threads, the
  batch size fleet knows (``distributed_loader`` or ``fleet.telemetry.timing.set_batch_size``).

After ``--warmup`` + ``--steps`` steps, or ``--seconds`` of timed steps, the result is written
and the process ends at once with status 0 (``os._exit``: the script's remaining epochs are
not wanted). If the script ends earlier by itself, what was recorded is written at exit.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run as a file: this package's own directory must not shadow top-level modules

import argparse
import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any


class Probe:
    def __init__(self, out: Path, warmup: int, steps: int, seconds: float):
        self.out, self.warmup, self.steps, self.seconds = out, warmup, steps, seconds
        self.compute: list[float] = []
        self.wall: list[float] = []
        self.seen = 0
        self.first_timed: float | None = None
        self.dense_bytes = 0
        self.optimizer = ""
        self.device = "cpu"
        self.sparse_rows: list[int] = []  # unique ids per step (summed over the step's lookups)
        self.sparse_new: list[int] = []  # of those, ids no earlier step looked up (a server creates their rows)
        self._rows_now = self._new_now = 0
        self.sparse_s: list[float] = []  # seconds inside SparseEmbedding forwards per step (the local table's lookups)
        self._sparse_now = 0.0
        self._entered: list[float] = []
        self._seen: dict[int, Any] = {}  # per table: an IdIndex of the ids looked up so far
        self._table_now: dict[int, int] = {}  # per table: unique ids of this step
        self._lookups_now: dict[int, int] = {}  # per table: ids of this step, repeats included
        self.tables: dict[int, dict[str, Any]] = {}  # per table: its width, cap and unique ids per timed step
        self._hook_s = 0.0  # this step's time in the probe's own hooks, taken out of its computation
        self.sparse_dim = 0
        self.params: dict[int, Any] = {}  # parameters of modules seen in forward, until the bytes are known
        self.excluded: set[int] = set()  # a SparseEmbedding's own parameters: its rows travel as sparse
        self.from_fleet = False
        self._last_hook: float | None = None
        self.written = False

    # --- what the hooks feed ------------------------------------------------------

    def on_fleet_boundary(self, timed: tuple[float, float, float] | None) -> None:
        """A step boundary in fleet's step recorder (a listener of it): ``timed`` is the step's
        ``(wall, compute, comm)``, None at the first boundary, which only starts the clock."""
        self.from_fleet = True  # fleet times the steps; torch's hook only names the optimizer
        if timed is not None:
            wall, compute, _ = timed
            self._inspect_modules()
            self._step(wall, compute)

    def on_torch_step(self, optimizer: Any) -> None:
        if not self.optimizer:
            self.optimizer = type(optimizer).__name__.lower()
        if self.from_fleet:
            return
        self._inspect_modules()
        now = time.perf_counter()
        if self._last_hook is not None:
            self._step(now - self._last_hook, now - self._last_hook)
        self._last_hook = now

    def on_forward(self, module: Any, sparse: bool) -> None:
        if self.dense_bytes:
            return
        for p in module.parameters(recurse=False):
            if sparse:
                self.excluded.add(id(p))
            self.params[id(p)] = p

    def on_lookup(self, module: Any, ids: Any, kind: str = "embedding", features: int = 1) -> None:
        # Runs inside the timed forward: O(batch) (a hash index, not isin over every id seen, which
        # grew to ~10 ms per step by W2's 30th step), and its time is taken out of the step's computation.
        from fleet.sparse.id_index import IdIndex

        started = time.perf_counter()
        self.sparse_dim = int(module.embedding_dim)
        unique = ids.detach().reshape(-1).unique()
        self._rows_now += int(unique.numel())
        self._table_now[id(module)] = self._table_now.get(id(module), 0) + int(unique.numel())
        self._lookups_now[id(module)] = self._lookups_now.get(id(module), 0) + int(ids.numel())
        if id(module) not in self.tables:
            cap = getattr(module, "max_rows", None)
            self.tables[id(module)] = {
                "dim": self.sparse_dim,
                "max_rows": cap if isinstance(cap, int) else None,
                "kind": kind,  # how the script looks it up: the placement's measurement mimics it
                "features": features,
            }
        seen = self._seen.setdefault(id(module), IdIndex())
        new = unique[seen.lookup(unique) < 0]
        seen.insert_new(new)
        self._new_now += int(new.numel())
        self._hook_s += time.perf_counter() - started

    def _inspect_modules(self) -> None:
        """Dense gradient bytes: parameters of the modules that ran forward and now hold a dense gradient."""
        if self.dense_bytes:
            return
        total, device = 0, None
        for key, p in self.params.items():
            if key not in self.excluded and p.grad is not None and not p.grad.is_sparse:
                total += p.numel() * p.element_size()
                device = device or p.device.type
        if total:
            self.dense_bytes, self.device = total, device or "cpu"
            self.params.clear()

    def _step(self, wall: float, compute: float) -> None:
        self.seen += 1
        rows, self._rows_now = self._rows_now, 0
        new, self._new_now = self._new_now, 0
        inside, self._sparse_now = self._sparse_now, 0.0
        hooks, self._hook_s = self._hook_s, 0.0
        per_table, self._table_now = self._table_now, {}
        lookups, self._lookups_now = self._lookups_now, {}
        if self.seen <= self.warmup:
            return
        for key, table in self.tables.items():
            table.setdefault("ids", []).append(per_table.get(key, 0))
            table.setdefault("lookups", []).append(lookups.get(key, 0))
        now = time.perf_counter()
        if self.first_timed is None:
            self.first_timed = now - wall
        wall, compute = wall - hooks, max(0.0, compute - hooks)
        self.wall.append(wall)
        self.compute.append(compute)
        self.sparse_rows.append(rows)
        self.sparse_new.append(new)
        self.sparse_s.append(inside)
        if len(self.compute) >= self.steps or now - self.first_timed >= self.seconds:
            self.write()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the calibration has what it needs; the rest of the training is not wanted

    # --- the result ---------------------------------------------------------------

    def result(self) -> dict[str, Any]:
        import torch

        batch = None
        try:
            from fleet.telemetry import timing

            batch = timing.recorder().batch_size
        except Exception:  # noqa: BLE001 - a batch size is optional
            batch = None
        return {
            "steps": len(self.compute),
            "warmup": self.warmup,
            "compute_s": self.compute,
            "wall_s": self.wall,
            "timed_by": "fleet.telemetry.timing" if self.from_fleet else "torch optimizer hook",
            "dense_bytes": self.dense_bytes,
            "optimizer": self.optimizer,
            "device": self.device,
            "sparse_rows": self.sparse_rows,
            "sparse_new_rows": self.sparse_new,
            "sparse_s": self.sparse_s,
            "sparse_dim": self.sparse_dim,
            # the placement's tables: rows_seen is what the run touched, a lower bound of the table's size
            "tables": [
                {**t, "ids": t.get("ids", []), "lookups": t.get("lookups", []), "rows_seen": len(self._seen[k])}
                for k, t in self.tables.items()
            ],
            "batch": batch,
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0],
        }

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result()))
        os.replace(tmp, self.out)


def install(probe: Probe) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from fleet.nn import SparseEmbedding, SparseFeatureCollection
    from fleet.telemetry import timing

    # Fleet's own recorder is where every strategy reports a step; listening to it sees them all
    # without changing any strategy.
    timing.recorder().subscribe(probe.on_fleet_boundary)
    register_optimizer_step_post_hook(lambda opt, args, kwargs: probe.on_torch_step(opt))

    def before(module: Any, args: tuple) -> None:
        if isinstance(module, (SparseEmbedding, SparseFeatureCollection)):
            probe._entered.append(time.perf_counter())

    def forward(module: Any, args: tuple, output: Any) -> None:
        collection = isinstance(module, SparseFeatureCollection)
        sparse = collection or isinstance(module, SparseEmbedding)
        probe.on_forward(module, sparse)
        if sparse:
            if probe._entered:
                probe._sparse_now += time.perf_counter() - probe._entered.pop()
            if collection and args:
                # its tables look their rows up without being called as modules: each table's ids, here
                started = time.perf_counter()
                by_table = module.ids_by_table(args[0])
                probe._hook_s += time.perf_counter() - started  # the probe's own work, not the step's
                for name, ids in by_table.items():
                    probe.on_lookup(module.tables[name], ids, "collection", len(module.features_of(name)))
            elif args:
                probe.on_lookup(module, args[0], "bag" if hasattr(module, "mode") else "embedding")

    torch.nn.modules.module.register_module_forward_pre_hook(before)
    torch.nn.modules.module.register_module_forward_hook(forward)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out (allocation, caches)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps wanted")
    parser.add_argument("--seconds", type=float, default=20.0, help="stop after this long of timed steps")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    script = args.script.resolve()
    probe = Probe(args.out, args.warmup, args.steps, args.seconds)
    install(probe)
    atexit.register(probe.write)
    sys.argv = [str(script), *args.args]
    sys.path[0] = str(script.parent)  # as `python script.py` would have it, not this file's directory
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
