"""The native row optimizers against the torch math they replaced (ServerOptimizer's row-wise path on rows
gathered by slot, duplicates summed by ``torch.unique`` + ``index_add_``): rows, state and steps agree within
float32 rounding, for every optimizer kind and option; a bad call raises and writes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fleet.sparse.id_index import as_ids
from fleet.sparse.native import buf, kernels, native_hyper
from fleet.sparse.optim import OptimizerSpec, ServerOptimizer
from fleet.sparse.table import SparseTable

SPECS = [
    {"kind": "sgd", "lr": 0.1},
    {"kind": "sgd", "lr": 0.1, "weight_decay": 0.01, "maximize": True},
    {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "dampening": 0.1},
    {"kind": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
    {"kind": "adagrad", "lr": 0.1},
    {"kind": "adagrad", "lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
    {"kind": "rowwise_adagrad", "lr": 0.1},
    {"kind": "rowwise_adagrad", "lr": 0.1, "lr_decay": 0.05, "eps": 1e-6, "maximize": True},
    {"kind": "adam", "lr": 0.01},
    {"kind": "adam", "lr": 0.01, "weight_decay": 0.01, "betas": (0.8, 0.99)},
    {"kind": "adamw", "lr": 0.01, "weight_decay": 0.1},
    {"kind": "adamw", "lr": 0.01, "betas": (0.3, 0.9), "eps": 1e-6, "maximize": True},  # lerp's other branch
]


def _fields(table: SparseTable) -> dict[str, torch.Tensor]:
    return table.copy_rows(slice(None))


def _reference_step(opt: ServerOptimizer, fields: dict, slots: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    """Today's torch math on the per-row fields (as copy_rows names them), in place."""
    uniq, inverse = torch.unique(slots, return_inverse=True)
    g = torch.zeros(uniq.numel(), grads.shape[1]).index_add_(0, inverse, grads)  # batch order per slot
    rows = fields["rows"].index_select(0, uniq)
    state = {name: fields[f"state.{name}"].index_select(0, uniq) for name in opt.state_names}
    count: int | torch.Tensor = 1
    if opt.needs_step:
        count = fields["steps"].index_select(0, uniq) + 1
        fields["steps"].index_copy_(0, uniq, count)
    opt.update(rows, g, state, count, lr)
    fields["rows"].index_copy_(0, uniq, rows)
    for name in opt.state_names:
        fields[f"state.{name}"].index_copy_(0, uniq, state[name])


@pytest.mark.parametrize("dim", [1, 8, 33])
@pytest.mark.parametrize("config", SPECS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "lr"))
def test_native_step_is_the_torch_step(config: dict, dim: int) -> None:
    spec = OptimizerSpec(**config)
    gen = torch.Generator().manual_seed(dim)
    table = SparseTable(dim, spec, seed=1)
    ids = torch.randint(-(2**40), 2**40, (600,), generator=gen).unique()
    table.pull(ids)
    want = _fields(table)
    opt = ServerOptimizer(spec)
    for step in range(12):
        # repeats within a batch (a small pool), rows untouched for a while, lr changing as a scheduler does
        batch = ids[torch.randint(0, ids.numel() if step % 3 else 40, (300,), generator=gen)]
        grads = torch.randn(batch.numel(), dim, generator=gen)
        lr = config["lr"] * (1 + 0.1 * step)
        table.apply_gradient(batch, grads, lr)
        _reference_step(opt, want, table._index.lookup(batch), grads, lr)
        got = _fields(table)
        for name, value in want.items():
            if value.dtype.is_floating_point:
                torch.testing.assert_close(got[name], value, rtol=2e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            else:
                assert torch.equal(got[name], value), name


def test_sgd_without_options_is_exact() -> None:
    """Same operation order as torch (one multiply-add per element): bit for bit."""
    table = SparseTable(16, OptimizerSpec(kind="sgd", lr=0.5))
    ids = torch.arange(1000)
    table.pull(ids)
    want = _fields(table)
    grads = torch.randn(3000, 16, generator=torch.Generator().manual_seed(0))
    batch = ids[torch.randint(0, 1000, (3000,), generator=torch.Generator().manual_seed(1))]
    table.apply_gradient(batch, grads, 0.5)
    _reference_step(ServerOptimizer(table.optimizer), want, table._index.lookup(batch), grads, 0.5)
    assert torch.equal(_fields(table)["rows"], want["rows"])


def _args(n: int = 4, cap: int = 8, dim: int = 2, slots: list[int] | None = None) -> list:
    spec = OptimizerSpec(kind="adam", lr=0.1)
    sl = np.array(slots if slots is not None else list(range(n)), dtype=np.int64)
    n = sl.size
    f32 = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
    return [
        native_hyper(spec, 0.1),
        f32(cap, dim),
        f32(cap, dim),
        f32(cap, dim),
        np.zeros(cap, dtype=np.int64),
        np.zeros(cap, dtype=np.bool_),  # dirty flags
        sl,
        np.ones((n, dim), dtype=np.float32),
        cap,
        f32(n, dim),
        f32(n, dim),
        f32(n, dim),
        np.zeros(n, dtype=np.int64),
    ]


def test_apply_rows_checks_before_writing() -> None:
    args = _args()
    kernels.apply_rows(*args)
    assert args[1][:4].any() and args[4][:4].tolist() == [1, 1, 1, 1]
    args = _args(slots=[0, 3, 5, 1])
    args[8] = 5  # 5 live rows: slot 5 is out
    with pytest.raises(IndexError, match="slot 5 .* outside the 5 live rows"):
        kernels.apply_rows(*args)
    assert not args[1].any() and not args[4].any()
    args = _args(slots=[0, -2])
    with pytest.raises(IndexError, match="slot -2"):
        kernels.apply_rows(*args)
    args = _args()
    args[8] = 9
    with pytest.raises(ValueError, match="live rows 9"):
        kernels.apply_rows(*args)
    args = _args()
    args[3] = None
    with pytest.raises(ValueError, match="two state tensors"):
        kernels.apply_rows(*args)
    args = _args()
    args[7] = np.ones((4, 3), dtype=np.float32)
    with pytest.raises(ValueError, match="grads must be 2-D with the expected width"):
        kernels.apply_rows(*args)
    args = _args()
    args[9] = args[9][:3]
    with pytest.raises(ValueError, match="old rows 3"):
        kernels.apply_rows(*args)
    args = _args()
    args[0] = (9, *args[0][1:])
    with pytest.raises(ValueError, match="unknown optimizer kind 9"):
        kernels.apply_rows(*args)
    args = _args()
    args[1] = args[1].astype(np.float64)
    with pytest.raises(TypeError, match="rows must hold float32"):
        kernels.apply_rows(*args)


def test_apply_rows_without_an_undo_record_writes_the_same() -> None:
    """old_* all None: the same update, nothing recorded; some None and some given is refused."""
    args = _args(slots=[0, 3, 0, 1])
    kernels.apply_rows(*args)
    bare = _args(slots=[0, 3, 0, 1])
    bare[9:] = [None] * 4
    kernels.apply_rows(*bare)
    for k in (1, 2, 3, 4, 5):
        assert np.array_equal(args[k], bare[k])
    assert bare[5].tolist() == [True, True, False, True, False, False, False, False]  # the rows changed
    refused = _args(slots=[0, 3, 5, 1])
    refused[8] = 5
    with pytest.raises(IndexError, match="slot 5"):
        kernels.apply_rows(*refused)
    assert not refused[5].any() and not refused[1].any()
    mixed = _args()
    mixed[9] = None
    with pytest.raises(ValueError, match="all or none"):
        kernels.apply_rows(*mixed)
    assert not mixed[1].any()


def test_apply_rows_on_strided_record_fields_writes_the_same() -> None:
    """rows, state, steps and dirty flags as fields of one record array (fleet.sparse.records): the same update
    as on separate arrays, the flags set in their record byte only; a row whose elements are not adjacent is refused."""
    cap, dim, slots = 8, 3, [0, 3, 0, 1]
    plain = _args(cap=cap, dim=dim, slots=slots)
    plain[1][:] = np.arange(cap * dim, dtype=np.float32).reshape(cap, dim) / 7
    plain[9:] = [None] * 4
    words = 2 + 3 * dim + 1  # step (int64), row, two states, a word holding the flag: 12 words, 48 bytes
    records = np.zeros((cap, words // 2), dtype=np.int64)
    as_f32 = records.view(np.float32)
    rows, s0, s1 = (as_f32[:, 2 + k * dim : 2 + (k + 1) * dim] for k in range(3))
    rows[:] = plain[1]
    steps = records[:, 0]
    dirty = records.view(np.bool_)[:, 4 * (words - 1)]
    strided = [plain[0], rows, s0, s1, steps, dirty, *plain[6:9], None, None, None, None]
    kernels.apply_rows(*plain)
    kernels.apply_rows(*strided)
    for k in (1, 2, 3, 4, 5):
        assert np.array_equal(plain[k], strided[k]), k
    assert dirty.tolist() == [True, True, False, True, False, False, False, False]
    assert not records.view(np.bool_)[:, 4 * (words - 1) + 1 :].any()  # the flag's neighbours untouched
    bad = list(strided)
    bad[1] = as_f32[:, 2 : 2 + 2 * dim : 2]  # every other element: not a row of adjacent elements
    with pytest.raises(ValueError, match="rows must have rows of adjacent elements"):
        kernels.apply_rows(*bad)


def test_a_push_inside_an_enclosing_transaction_goes_back_with_it() -> None:
    """Only an outermost push skips the undo record: inside a larger transaction that fails later, it is undone."""
    table = SparseTable(8, OptimizerSpec(kind="adam", lr=0.1), seed=3)
    ids = torch.arange(500) * 11
    table.pull(ids)
    table.apply_gradient(ids[:100], torch.randn(100, 8), 0.1)
    before = _fields(table)
    dirty = table.changed_slots()
    batch = torch.cat([ids[50:300], ids[60:70], torch.tensor([10**9])])  # repeats, and a new row
    with pytest.raises(RuntimeError, match="later failure"), table.transaction():
        table.apply_gradient(batch, torch.randn(batch.numel(), 8), 0.1)
        raise RuntimeError("a later failure")
    after = _fields(table)
    assert len(table) == 500 and torch.equal(table.changed_slots(), dirty)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_finite_checks_every_value_natively_and_otherwise() -> None:
    """fleet.sparse.nonfinite.finite: the native pass (float32, CPU, contiguous) and torch's agree, NaN and both infs."""
    from fleet.sparse.nonfinite import finite

    base = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0))
    base[3, 4] = torch.finfo(torch.float32).max  # large and tiny values are finite
    base[5, 6] = torch.finfo(torch.float32).tiny / 4
    assert finite(base, base.t(), base.double(), base.requires_grad_(False), 0.1)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (500, 7), (999, 15)):
            x = base.clone()
            x[where] = bad
            assert not kernels.all_finite(x.reshape(-1).numpy())
            assert not finite(x) and not finite(x.t()) and not finite(x.double()) and not finite(x.requires_grad_())
    assert finite(torch.empty(0)) and not finite(base, float("nan"))


def test_buf_hands_kernels_views_and_names_what_does_not_fit():
    """The common case goes a short way (fleet.sparse.native.buf): it must still be a view, and every tensor the
    long way refuses is still refused with its message."""
    rows = torch.zeros(4, 3)
    buf(rows, "rows", torch.float32, 2)[1, 2] = 5.0
    assert rows[1, 2] == 5.0  # the kernel writes the tensor's own memory
    records = torch.zeros(4, 5)
    buf(records[:, 1:4], "rows", torch.float32, 2, strided=True)[2, 0] = 7.0  # rows apart, elements adjacent
    assert records[2, 1] == 7.0
    learnt = torch.zeros(2, 3, requires_grad=True)
    assert buf(learnt, "rows", torch.float32, 2).shape == (2, 3)
    with pytest.raises(ValueError, match="rows must have rows of adjacent elements"):
        buf(records.t(), "rows", torch.float32, 2, strided=True)
    with pytest.raises(ValueError, match="grads must be contiguous"):
        buf(records[:, 1:4], "grads", torch.float32, 2)
    with pytest.raises(ValueError, match="rows must be torch.float32, got torch.float64"):
        buf(rows.double(), "rows", torch.float32, 2)
    with pytest.raises(ValueError, match="rows must be 2-D"):
        buf(rows[0], "rows", torch.float32, 2)


def test_as_ids_returns_good_ids_as_they_are_and_converts_or_refuses_the_rest():
    ids = torch.arange(5)
    assert as_ids(ids) is ids
    assert as_ids(torch.arange(5, dtype=torch.int32)).dtype == torch.int64
    assert torch.equal(as_ids(torch.arange(10)[::2]), torch.arange(0, 10, 2))  # strided: a contiguous copy
    with pytest.raises(ValueError, match="ids must be 1-D"):
        as_ids(ids.view(1, 5))
    with pytest.raises(ValueError, match="ids must be an integer tensor"):
        as_ids(ids.float())
