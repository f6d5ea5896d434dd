"""Parameter-server tables are named after their modules in the model, not by creation number.

Unit tests of the naming (which name a worker sends, how a conflicting create is explained, how
a server's error names its tables) and one PS job whose workers build the same two tables in a
different order, which without names would agree on every config and train each other's rows.
The same job checks that a worker's own process group (torch.distributed.init_process_group after
fleet.init) is refused at the next step and at distributed_optimizer.
"""

from __future__ import annotations

import pytest
import torch

import fleet
from dist_harness import free_port
from fleet.errors import UserProcessGroupError
from fleet.ps.protocol.errors import UNNAMED_TABLES, PSRemoteError, name_tables
from fleet.ps.worker.table_names import SAME_MODEL, TableNames, dense_name, explain_conflict
from ps_jobs import run_job
from ps_servers import SGD, client, servers


class TwoTables(torch.nn.Module):
    """Two equal tables; ``swapped`` defines them the other way round (their table numbers swap)."""

    def __init__(self, swapped: bool = False) -> None:
        super().__init__()
        order = ("item", "user") if swapped else ("user", "item")
        for name in order:
            self.add_module(name, fleet.nn.SparseEmbedding(4))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.user(ids), self.item(ids)], -1)).squeeze(-1)


class Tower(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb_l = torch.nn.ModuleList([fleet.nn.SparseEmbedding(4) for _ in range(2)])
        self.mlp = torch.nn.Linear(4, 1)


# --- which names a worker finds ---------------------------------------------------------------------------


def test_names_come_from_the_model_given_to_fleet_or_from_the_modules_holding_the_parameters():
    tower = Tower()
    params = list(tower.parameters())
    for names in (TableNames(params, tower), TableNames(params)):  # given, then found without it
        assert [names.module(m) for m in tower.emb_l] == ["emb_l.0", "emb_l.1"]
        assert names.params([tower.mlp.weight, tower.mlp.bias]) == ["mlp.weight", "mlp.bias"]
    wrapper = torch.nn.Sequential(tower)  # a wrapper one worker made (to log, to compile) changes no name
    assert TableNames(params).module(tower.emb_l[0]) == "emb_l.0" and wrapper[0] is tower
    bare = fleet.nn.SparseEmbedding(4)  # held by no model: no name, the number stays
    assert TableNames(list(bare.parameters())).module(bare) is None
    # a parameter no model holds: the table goes unnamed (names would depend on what each worker keeps alive)
    assert TableNames([torch.nn.Parameter(torch.ones(2))]).params([torch.ones(1)]) is None


def test_two_models_in_one_optimizer_are_told_apart_by_class():
    a, b = Tower(), TwoTables()
    names = TableNames([*a.parameters(), *b.parameters()])
    assert names.module(a.emb_l[1]) == "Tower.emb_l.1" and names.module(b.user) == "TwoTables.user"
    assert dense_name(0, ["a.weight", "b.bias"]) == "param group 0 (a.weight ... b.bias, 2 parameters)"
    assert dense_name(1, ["w"]) == "param group 1 (w)" and dense_name(2, []) == "param group 2"


# --- a conflicting create in the model's terms --------------------------------------------------------------


def _conflict(existing: dict, requested: dict, kinds=("sparse", "sparse")) -> dict:
    return {
        "code": "conflicting_create",
        "table": 3,
        "existing": {"kind": kinds[0], "config": existing},
        "requested": {"kind": kinds[1], "config": requested},
    }


def test_a_conflicting_create_names_both_modules():
    sparse = {"dim": 4, "optimizer": SGD, "seed": 0}
    error = explain_conflict(_conflict({**sparse, "name": "emb_l.3"}, {**sparse, "name": "emb_l.5"}), worker=1)
    assert "table 3 is the sparse table 'emb_l.5' on worker 1 but the sparse table 'emb_l.3'" in str(error)
    assert SAME_MODEL in str(error) and "migrating-from-ddp.md" in str(error)
    # the same module with another setting: the setting, on both sides
    error = explain_conflict(_conflict({**sparse, "name": "emb"}, {**sparse, "dim": 8, "name": "emb"}), worker=1)
    assert "the sparse table 'emb'" in str(error) and "dim=8 on worker 1 but 4 there" in str(error)
    # a dense table where the other worker has a sparse one
    dense = {"name": "param group 1 (mlp.weight ... mlp.bias, 2 parameters)", "names": ["mlp.weight", "mlp.bias"]}
    error = explain_conflict(_conflict({**sparse, "name": "emb"}, dense, ("sparse", "dense")), worker=0)
    assert "the dense table of param group 1 (mlp.weight ... mlp.bias, 2 parameters) on worker 0" in str(error)
    # unnamed tables: say how to get names
    error = explain_conflict(_conflict({**sparse, "name": "emb"}, sparse), worker=1)
    assert "a sparse table held by no model (give the model to fleet.distributed_model" in str(error)
    assert explain_conflict({"code": "conflicting_create", "table": 3}, worker=1) is None


def test_a_dense_conflict_names_the_parameter_that_differs():
    base = {"optimizer": SGD, "name": "param group 0 (a.weight ... b.weight, 2 parameters)"}
    shapes = _conflict(
        {**base, "shapes": [[2], [3]], "names": ["a.weight", "b.weight"]},
        {**base, "shapes": [[2], [4]], "names": ["a.weight", "b.weight"]},
        ("dense", "dense"),
    )
    assert "'b.weight' has shape [4] on worker 1 but [3]" in str(explain_conflict(shapes, worker=1))
    swapped = _conflict(  # equal shapes, parameters in another order: only the names tell
        {**base, "shapes": [[2], [2]], "names": ["a.weight", "b.weight"]},
        {**base, "shapes": [[2], [2]], "names": ["b.weight", "a.weight"]},
        ("dense", "dense"),
    )
    message = str(explain_conflict(swapped, worker=1))
    assert "holds 'b.weight' on worker 1 where" in message and "holds 'a.weight' (position 0)" in message


# --- the servers' errors name tables as this worker's model does ---------------------------------------------


def test_server_errors_name_the_tables_of_this_workers_model():
    named = name_tables("unknown table 3 (this server has [0])", {3: "emb_l.3"})
    assert named == "unknown table 3 ('emb_l.3' in this worker's model) (this server has [0])"
    both = "conflicting create of table 3 ('emb_l.3'; this create is for 'emb_l.5'): ..."
    assert name_tables(both, {3: "emb_l.5"}) == both  # already named: not repeated
    assert name_tables("table 7 is dense", {}) == f"table 7 is dense ({UNNAMED_TABLES})"
    assert name_tables("no table here", {}) == "no table here"


@pytest.mark.timeout(60)
def test_the_server_reports_a_create_for_another_module_naming_both(tmp_path):
    config = {"dim": 2, "optimizer": SGD, "update": "async"}
    with servers(1, 2) as srvs, client(srvs, 0) as first, client(srvs, 1) as second:
        first.create_sparse(3, {**config, "name": "user"}).result()
        first.create_sparse(4, config).result()  # saved without a name, as saves before names were
        first.save(str(tmp_path / "save")).result()
        with pytest.raises(PSRemoteError) as error:
            second.create_sparse(3, {**config, "name": "item"}).result()
        assert "conflicting create of table 3 ('user'; this create is for 'item')" in str(error.value)
        assert str(error.value).count("'item'") == 1  # the client does not name it twice
        assert error.value.details["existing"]["config"]["name"] == "user"
    with servers(1, 1) as srvs, client(srvs, 0) as fresh:  # a save made without names loads into named tables
        fresh.create_sparse(3, {**config, "name": "user"}).result()
        fresh.create_sparse(4, {**config, "name": "item"}).result()
        fresh.load(str(tmp_path / "save")).result()


# --- one PS job: tables in another order, then a process group of the workers' own ---------------------------


def _job_worker(rank: int, port: int) -> dict:
    import torch.distributed as dist

    try:
        fleet.init()
    except SystemExit as stop:
        return {"served": stop.code}
    out: dict = {}
    model = TwoTables()
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.zero_grad()
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()  # the same model on every worker trains, its tables named
    swapped = TwoTables(swapped=rank == 1)
    try:
        fleet.distributed_optimizer(torch.optim.SGD(swapped.parameters(), lr=0.1))
    except fleet.ModelMismatchError as error:
        out["mismatch"] = str(error)
    fleet.barrier_worker()
    # The script's own distributed mode, switched on after fleet.init(): refused at the next step
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    for name, call in (
        ("step", opt.step),
        ("wrap", lambda: fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))),
    ):
        try:
            call()
        except UserProcessGroupError as error:
            out[name] = str(error)
    dist.destroy_process_group()
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ps_job_names_tables_in_another_order_and_refuses_the_workers_own_group():
    results = run_job(_job_worker, 1, 2, {"update": "async"}, free_port(), timeout=100)
    mismatches = [r["mismatch"] for r in results if "mismatch" in r]
    assert mismatches, results  # the worker whose create came second (or both, one table each)
    for message in mismatches:
        # tables 0-2: the first model (dense head, user, item); 3-5: the swapped one
        assert "parameter-server table 4" in message or "parameter-server table 5" in message
        assert "'user'" in message and "'item'" in message and "Every worker must build the same model" in message
    for result in results:
        for name in ("step", "wrap"):
            message = result[name]
            assert "torch.distributed.init_process_group was called after fleet.init()" in message, message
            assert "parameter-server job (mode='ps', update='async'" in message
            assert "world size 2" in message and "Remove the init_process_group call" in message
            assert "migrating-from-ddp.md" in message


def test_a_name_only_one_create_carries_is_no_conflict() -> None:
    """One worker's model holds a group's parameters, another's does not (it kept only the parameters): the
    tables are the same unless both carry names and they differ."""
    from fleet.ps.server.table_ops import _same_table

    base = {"dim": 4, "optimizer": {"kind": "sgd", "lr": 0.1}}
    assert _same_table({**base, "name": "emb"}, base)
    assert _same_table(base, {**base, "name": "emb"})
    assert _same_table({**base, "name": "emb"}, {**base, "name": "emb"})
    assert not _same_table({**base, "name": "emb"}, {**base, "name": "user"})
    assert not _same_table({**base, "name": "emb"}, {**base, "dim": 8})
