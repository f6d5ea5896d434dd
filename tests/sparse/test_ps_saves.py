"""Delta saves of a parameter-server job: a base, then deltas, load to exactly the tables that were saved."""

from __future__ import annotations

import os

import pytest
import torch

from fleet.ps.server import shard_io
from fleet.sparse.table import SparseTable
from ps_jobs import run_job, train_with_saves

pytestmark = pytest.mark.multiprocess

SERVERS, WORKERS, MODEL = 2, 2, "adam+life+cap"


def _sparse_from(config: dict, states: list[dict]) -> SparseTable:
    table = SparseTable.from_config({k: v for k, v in config.items() if k in SparseTable.CONFIG_KEYS})
    table.load_state_dict(states[0]["table"])
    for state in states[1:]:
        table.apply_delta(state["table"])
    return table


def _by_id(state: dict) -> dict:
    order = torch.argsort(state["ids"])
    n = state["ids"].numel()
    return {k: v[order] for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n}


def _assert_same_tables(chained_dir: str, full_dir: str) -> int:
    """Every server's tables loaded through a delta chain equal a base saved at the same moment; rows compared."""
    rows = 0
    for server in range(SERVERS):
        full = {t: (kind, config, states) for t, kind, config, states in shard_io.load_shards(full_dir, server)}
        chained = list(shard_io.load_shards(chained_dir, server))
        assert sorted(t for t, *_ in chained) == sorted(full)
        for table, kind, config, states in chained:
            assert len(states) == (3 if kind == "sparse" else 1), "sparse: base, delta 1, delta 2; dense: whole"
            want = full[table][2][-1]
            assert states[-1]["version"] == want["version"]
            if kind == "dense":
                assert torch.equal(states[-1]["table"]["values"], want["table"]["values"])
                continue
            got = _sparse_from(config, states).state_dict()
            expected = _sparse_from(config, [want]).state_dict()
            assert got["clock"] == expected["clock"] and got["counts"] == expected["counts"]
            a, b = _by_id(got), _by_id(expected)
            assert a.keys() == b.keys()
            for key in a:
                assert torch.equal(a[key], b[key]), (server, table, key)
            rows += a["ids"].numel()
            # the deltas hold only what changed
            assert states[1]["table"]["ids"].numel() < a["ids"].numel() + states[1]["table"]["deleted"].numel()
    return rows


@pytest.mark.timeout(150)
@pytest.mark.parametrize("update", ["sync", "async", "geo"])
def test_base_and_deltas_load_to_exactly_the_saved_tables(tmp_path, update: str) -> None:
    d = {name: str(tmp_path / name) for name in ("base", "delta1", "delta2", "full")}
    saves = {
        4: [(d["base"], "base")],
        8: [(d["delta1"], "delta")],
        12: [(d["delta2"], "delta"), (d["full"], "base")],
    }
    strategy = {"update": update, **({"k_steps": 3} if update == "geo" else {})}
    trained = run_job(train_with_saves, SERVERS, WORKERS, strategy, MODEL, 12, saves)
    rows = _assert_same_tables(d["delta2"], d["full"])
    assert rows == int(trained[0]["snapshot"]["num_rows"]) > 0
    if update == "sync":  # and a job that loads the delta chain holds what the saving job held
        loaded = run_job(train_with_saves, SERVERS, WORKERS, strategy, MODEL, 0, {}, d["delta2"])
        for name, want in trained[0]["snapshot"].items():
            assert torch.equal(loaded[0]["snapshot"][name], want), name


@pytest.mark.timeout(60)
def test_a_delta_needs_a_base_first(tmp_path) -> None:
    (result,) = run_job(train_with_saves, 1, 1, {"update": "sync"}, MODEL, 2, {1: [(str(tmp_path / "d"), "delta")]})
    assert "save a base first" in result["error"], result
    assert not os.path.exists(tmp_path / "d" / "ps-server-0")
