"""A SparseEmbedding's rows in ``state_dict`` (one process), given rows, and the dense view of an id range."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import fleet
import fleet.api
from fleet.nn import SparseEmbedding
from fleet.nn.rows_state import table_rows
from fleet.sparse.optim import OptimizerSpec
from fleet.sparse.table import SparseTable
from ps_jobs import all_ids, batch, make_model, make_optimizer


def _step(model, opt, step: int) -> float:
    ids, dense, label = batch(step, 0)
    opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(ids, dense), label)
    loss.backward()
    if model.emb.lifecycle.active:
        model.emb.record_clicks(label)
    opt.step()
    return loss.item()


def _same(a, b) -> bool:
    """Equal nested state (dicts, lists, tensors bit for bit, plain values)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _saved(obj) -> dict:
    """Through torch.save / torch.load(weights_only=True), as a user's checkpoint goes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("opt_name", ["adam", "sgd+adagrad_rows", "sgd+life+cap"])
def test_torch_save_round_trip_trains_identically(opt_name: str) -> None:
    torch.manual_seed(0)
    model = make_model(opt_name)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(4):
        _step(model, opt, step)
    saved = _saved({"model": model.state_dict(), "opt": opt.state_dict()})
    rows = table_rows(saved["model"], "emb")
    assert all(isinstance(v, torch.Tensor) for v in saved["model"].values())  # as code walking it expects
    assert rows["ids"].numel() == model.emb.num_rows() > 0
    held = model.emb.local.table
    order = torch.argsort(rows["ids"])
    want_ids, want_rows = held.export()
    assert torch.equal(rows["ids"][order], torch.sort(want_ids).values)
    assert torch.equal(rows["rows"][order], want_rows[torch.argsort(want_ids)])
    assert all(f"state.{n}" in rows for n in held.state_names)

    torch.manual_seed(1)  # other initial values, every one overwritten by the load
    fresh = make_model(opt_name)
    fresh_opt = make_optimizer(opt_name, fresh.parameters())
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for step in range(4, 9):
        assert _step(fresh, fresh_opt, step) == _step(model, opt, step)
    assert torch.equal(fresh.emb.dense_weight(10), model.emb.dense_weight(10))
    assert _same(fresh.state_dict(), model.state_dict())


def test_a_state_dict_before_any_step_round_trips_to_no_rows() -> None:
    model = make_model("adam")
    state = _saved(model.state_dict())
    assert table_rows(state, "emb")["ids"].numel() == 0
    fresh = make_model("adam")
    fresh.emb.load_rows(torch.tensor([3]), torch.ones(1, 4))
    fresh.load_state_dict(state)  # replaces: the given row goes
    assert fresh.emb.num_rows() == 0


def test_opting_out_leaves_a_marker_that_refuses_to_load() -> None:
    model = torch.nn.Sequential(SparseEmbedding(4, state_dict_rows=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).sum().backward()
    opt.step()
    state = _saved(model.state_dict())
    assert set(state) == {"0.placeholder", "0.rows.meta"} and table_rows(state, "0")["rows_left_out"]
    with pytest.raises(fleet.FleetError, match=r"'0'.*state_dict_rows=False.*save_persistables.*save_checkpoint"):
        torch.nn.Sequential(SparseEmbedding(4)).load_state_dict(state)


def test_save_checkpoint_keeps_the_rows_of_a_table_that_opted_out(tmp_path, monkeypatch) -> None:
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    try:
        fleet.init()
        model = torch.nn.Sequential(SparseEmbedding(4, state_dict_rows=False, seed=1))
        opt = fleet.distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
        model(torch.tensor([1, 2, 5])).sum().backward()
        opt.step()
        fleet.save_checkpoint(str(tmp_path), model, opt, 1)
        fresh = torch.nn.Sequential(SparseEmbedding(4, state_dict_rows=False, seed=1))
        fresh_opt = fleet.distributed_optimizer(torch.optim.Adam(fresh.parameters(), lr=0.1))
        assert fleet.load_checkpoint(str(tmp_path), fresh, fresh_opt).step == 1
        assert torch.equal(fresh[0].dense_weight(6), model[0].dense_weight(6))
        assert fresh[0].num_rows() == 3
    finally:
        fleet.api._reset_for_tests()


def test_a_state_dict_from_before_rows_were_saved_loads_with_a_warning() -> None:
    model = make_model("adam")
    old = {k: v for k, v in model.state_dict().items() if ".rows." not in k}
    assert "emb.placeholder" in old
    fresh = make_model("adam")
    fresh.emb.load_rows(torch.tensor([7]), torch.full((1, 4), 2.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_state_dict(old)  # strict, as before
    assert any("has no rows" in str(w.message) for w in caught)
    assert torch.equal(fresh.emb(torch.tensor([7])), torch.full((1, 4), 2.0))  # kept


def test_from_pretrained_trains_like_nn_embedding_from_pretrained() -> None:
    weight = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    ours = SparseEmbedding.from_pretrained(weight)
    ref = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False)
    assert torch.equal(ours(torch.arange(20)), weight)
    assert torch.equal(ours.dense_weight(20), weight)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=0.05)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randperm(20, generator=g).reshape(5, 4)  # every row each step: Adam on rows is lazy
        scale = torch.randn(5, 4, 1, generator=g)
        for module, opt in ((ours, opt_ours), (ref, opt_ref)):
            opt.zero_grad()
            (module(ids) ** 2 * scale).sum().backward()
            opt.step()
    assert torch.allclose(ours.dense_weight(20), ref.weight, atol=1e-6)
    assert not torch.allclose(ours.dense_weight(20), weight)


def test_load_rows_sets_given_values_and_checks_them() -> None:
    module = SparseEmbedding(3, seed=5)
    ids, values = torch.tensor([10, -4, 2**40]), torch.randn(3, 3)
    module.load_rows(ids, values)
    assert torch.equal(module(ids), values)
    assert module.num_rows() == 3
    weight = module.dense_weight(12)
    assert torch.equal(weight[10], values[0])
    assert torch.equal(weight[:10], SparseEmbedding(3, seed=5)(torch.arange(10)))  # untouched ids: initial values
    with pytest.raises(ValueError, match="unique"):
        module.load_rows(torch.tensor([1, 1]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \(2, 4\), expected \(2, 3\)"):
        module.load_rows(torch.tensor([1, 2]), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="dense_weight"):
        module.dense_weight(-1)


def test_dense_weight_reads_zeros_for_ids_an_entry_has_not_admitted() -> None:
    module = SparseEmbedding(2, entry=fleet.CountFilterEntry(3))
    module.load_rows(torch.tensor([1]), torch.ones(1, 2))
    assert torch.equal(module.dense_weight(3), torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))


def test_written_rows_are_in_the_next_delta_save_and_pages_are_bounded() -> None:
    table = SparseTable(2, OptimizerSpec(kind="adam", lr=0.1))
    table.apply_gradient(all_ids()[:6], torch.ones(6, 2), 0.1)
    table.mark_saved()
    table.write_rows(torch.tensor([99, all_ids()[0].item()]), {"rows": torch.zeros(2, 2)})
    delta = table.state_dict(delta=True)
    assert sorted(delta["ids"].tolist()) == sorted([99, all_ids()[0].item()])
    assert torch.equal(delta["state.exp_avg"], torch.zeros(2, 2))  # given rows start fresh
    table.write_rows(torch.tensor([5]), {"rows": torch.ones(1, 2)}, replace=True)
    assert table.slot_ids().tolist() == [5]
    assert len(table.state_dict(delta=True)["deleted"]) == 7  # the replaced rows go in the next delta too
    table.write_rows(torch.arange(10), {"rows": torch.randn(10, 2)}, replace=True)
    pages = [table.rows_page(start, 4) for start in range(0, 12, 4)]
    assert [p[0].numel() for p in pages] == [4, 4, 2]
    assert torch.equal(torch.cat([p[0] for p in pages]), table.slot_ids())
    table.write_rows(torch.tensor([50, -3]), {"rows": torch.full((2, 2), 7.0)})
    before = table.pull(torch.tensor([50, -3, 4]))
    table.sort_by_id()  # what a state dict does first: rows move with their ids
    assert table.slot_ids().tolist() == [-3, *range(10), 50]
    assert torch.equal(table.pull(torch.tensor([50, -3, 4])), before)
    with pytest.raises(ValueError, match="duplicates"):
        table.write_rows(torch.tensor([1, 1]), {"rows": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="write_rows takes 'rows'"):
        table.write_rows(torch.tensor([1]), {"bogus": torch.zeros(1, 2)})


def test_given_rows_of_a_rowwise_adagrad_table_start_with_one_accumulator_each() -> None:
    table = SparseTable(4, OptimizerSpec(kind="rowwise_adagrad", lr=0.1, initial_accumulator_value=0.5))
    table.write_rows(torch.tensor([3, 1]), {"rows": torch.ones(2, 4)})
    assert torch.equal(table.state_dict()["state.sum"], torch.full((2, 1), 0.5))
    table.write_rows(torch.tensor([1]), {"rows": torch.zeros(1, 4), "state.sum": torch.full((1, 1), 2.0)})
    state = table.state_dict()
    assert state["state.sum"][state["ids"] == 1].item() == 2.0
    with pytest.raises(ValueError, match=r"expected \(1, 1\)"):
        table.write_rows(torch.tensor([1]), {"rows": torch.zeros(1, 4), "state.sum": torch.zeros(1, 4)})
    module = SparseEmbedding.from_pretrained(torch.randn(5, 4))
    opt = fleet.nn.RowWiseAdagrad(module.parameters(), lr=0.1)
    module(torch.tensor([1, 2])).sum().backward()
    opt.step()  # the given rows move under row-wise Adagrad
    assert module.backend().table.state_dict()["state.sum"].shape == (5, 1)
