"""The one-process lookup's kernels (fleet/sparse/csrc/bags.cpp) against the torch code they replace, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fleet.nn import bag_kernels
from fleet.nn.bag_kernels import sum_bags, unique_inverse
from fleet.sparse import nonfinite
from fleet.sparse.native import kernels
from fleet.sparse.optim import InitializerSpec, _uniform_rows_torch, initial_rows


@pytest.mark.parametrize("n", [0, 1, 7, 64, 5000])
@pytest.mark.parametrize("span", [3, 1000, 1 << 62, 1 << 63])
def test_unique_inverse_is_torch_unique(n: int, span: int) -> None:
    ids = torch.randint(-span, span - 1, (n,), generator=torch.Generator().manual_seed(n + span))
    unique, inverse = unique_inverse(ids)
    ref_unique, ref_inverse = torch.unique(ids, sorted=True, return_inverse=True)
    assert torch.equal(unique, ref_unique)
    assert torch.equal(inverse, ref_inverse)


@pytest.mark.parametrize("dim", [1, 16, 33, 64])
@pytest.mark.parametrize("seed", [0, 7, -3])
@pytest.mark.parametrize(("low", "high"), [(-0.01, 0.01), (-1.5, 3.25), (0.5, 0.5)])
def test_uniform_rows_are_the_torch_definition(dim: int, seed: int, low: float, high: float) -> None:
    ids = torch.randint(-(1 << 62), 1 << 62, (500,), generator=torch.Generator().manual_seed(dim))
    ids[:3] = torch.tensor([0, -1, (1 << 63) - 1])
    init = InitializerSpec(kind="uniform", low=low, high=high)
    native = initial_rows(ids, dim, init, seed)
    assert native.dtype == torch.float32 and native.shape == (500, dim)
    assert torch.equal(native, _uniform_rows_torch(ids, dim, init, seed))
    assert initial_rows(ids[:0], dim, init, seed).shape == (0, dim)


@pytest.mark.parametrize(
    "init",
    [
        InitializerSpec(kind="uniform", low=-0.5, high=0.25),
        InitializerSpec(kind="normal", mean=0.1, std=0.3),
        InitializerSpec(kind="constant", value=0.7),
        InitializerSpec(kind="zeros"),
    ],
    ids=lambda init: init.kind,
)
def test_initial_rows_written_in_place_into_rows_that_lie_apart(init: InitializerSpec) -> None:
    # A table writes its new rows straight into the row field of its records (rows further apart than dim).
    ids = torch.randint(-(1 << 40), 1 << 40, (300,), generator=torch.Generator().manual_seed(1))
    records = torch.full((300, 24), -9.0)
    out = records[:, 3:19]
    assert initial_rows(ids, 16, init, 5, out=out) is out
    assert torch.equal(out, initial_rows(ids, 16, init, 5))
    assert bool((records[:, :3] == -9.0).all()) and bool((records[:, 19:] == -9.0).all())  # nothing else written
    column_major = torch.empty(16, 300).t()  # elements of a row apart: written through a copy
    assert torch.equal(initial_rows(ids, 16, init, 5, out=column_major), initial_rows(ids, 16, init, 5))
    with pytest.raises(ValueError, match="out must be float32"):
        initial_rows(ids, 16, init, 5, out=torch.empty(300, 8))


def test_all_finite_finds_nan_and_inf_anywhere() -> None:
    values = torch.randn(1001)
    values[7] = 3e38  # large but finite
    assert kernels.all_finite(values.numpy()) and nonfinite.finite(values.view(7, 143))
    for bad in (math.nan, math.inf, -math.inf):
        for at in (0, 500, 1000):
            broken = values.clone()
            broken[at] = bad
            assert not kernels.all_finite(broken.numpy())
            assert not nonfinite.finite(broken.view(7, 143))
            assert not nonfinite.finite(broken.view(143, 7).t())  # non-contiguous: torch's check


@pytest.mark.parametrize("trial", range(12))
def test_sum_bags_matches_embedding_bag_and_its_gradient(trial: int) -> None:
    g = torch.Generator().manual_seed(trial)
    rows_n = int(torch.randint(1, 800, (), generator=g))
    n = int(torch.randint(0, 4000, (), generator=g))
    bags = int(torch.randint(1, 300, (), generator=g))
    dim = (1, 3, 16, 32, 64, 8)[trial % 6]
    inverse = torch.randint(0, rows_n, (n,), generator=g)
    cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([n])])  # empty bags too
    grad_out = torch.randn(bags, dim, generator=g) * torch.rand(bags, 1, generator=g) * 100
    ref_rows = torch.randn(rows_n, dim, generator=g, requires_grad=True)
    rows = ref_rows.detach().clone().requires_grad_(True)
    ref = F.embedding_bag(inverse, ref_rows, offsets, mode="sum", include_last_offset=True)
    ref.backward(grad_out)
    out = sum_bags(rows, inverse, offsets)
    out.backward(grad_out)
    assert torch.equal(out, ref)
    assert torch.equal(rows.grad, ref_rows.grad)


@pytest.mark.parametrize("offsets", [[0], [0, 0, 0]])
def test_sum_bags_of_no_ids(offsets: list[int]) -> None:
    rows = torch.zeros(0, 4, requires_grad=True)
    out = sum_bags(rows, torch.empty(0, dtype=torch.int64), torch.tensor(offsets))
    assert torch.equal(out, torch.zeros(len(offsets) - 1, 4))
    out.sum().backward()
    assert rows.grad.shape == (0, 4)
    unique, inverse = unique_inverse(torch.empty(0, dtype=torch.int64))
    assert unique.numel() == 0 and inverse.numel() == 0


def test_bag_kernel_refuses_bad_offsets_and_indices() -> None:
    grad, out = torch.zeros(2, 4), torch.zeros(3, 4)
    inverse = torch.tensor([0, 1, 2])
    order = inverse.sort().indices
    with pytest.raises(ValueError, match="first offset"):
        kernels.bag_sum_backward(
            grad.numpy(), torch.tensor([1, 2, 3]).numpy(), inverse.numpy(), order.numpy(), out.numpy()
        )
    with pytest.raises(ValueError, match="non-decreasing"):
        kernels.bag_sum_backward(
            grad.numpy(), torch.tensor([0, 2, 1]).numpy(), inverse.numpy(), order.numpy(), out.numpy()
        )
    with pytest.raises(ValueError, match="out of range"):
        kernels.bag_sum_backward(
            grad.numpy(), torch.tensor([0, 1, 3]).numpy(), torch.tensor([0, 1, 3]).numpy(), order.numpy(), out.numpy()
        )
    assert torch.equal(out, torch.zeros(3, 4))  # nothing written
    for given in (None, order.numpy()):  # the kernel's own order checks the inverse index before it writes
        with pytest.raises(ValueError, match="out of range"):
            kernels.bag_sum_backward(
                grad.numpy(), torch.tensor([0, 1, 3]).numpy(), torch.tensor([0, 5, 1]).numpy(), given, out.numpy()
            )
    assert torch.equal(out, torch.zeros(3, 4))


def _tied_keys(case: int, g: torch.Generator) -> torch.Tensor:
    """Keys with many ties: uniform over few or many values, or skewed (a few values take most entries)."""
    n = int(torch.randint(0, 40 if case % 5 == 0 else 6000, (), generator=g))
    span = int(torch.randint(1, (3, 40, 2000)[case % 3], (), generator=g))
    if case % 2:
        return (torch.rand(n, generator=g) ** 4 * span).to(torch.int64)
    return torch.randint(0, span, (n,), generator=g)


def test_ties_order_is_torch_sort_where_the_bag_backward_uses_it() -> None:
    """The backward sums each row's entries in the kernel's order only where it is torch's sort() permutation,
    ties included (float sums depend on their order); elsewhere it takes torch's sort() itself."""
    if not bag_kernels.native_order_is_torchs():
        pytest.skip("this torch sorts otherwise than libstdc++'s std::sort: the backward takes inverse.sort()")
    g = torch.Generator().manual_seed(11)
    for case in range(300):
        keys = _tied_keys(case, g)
        mine = torch.empty_like(keys)
        kernels.ties_order(keys.numpy(), mine.numpy())
        assert torch.equal(mine, keys.sort().indices), f"case {case}: {keys.numel()} keys"
    with pytest.raises(ValueError, match="outside"):
        kernels.ties_order(torch.tensor([0, -1]).numpy(), torch.empty(2, dtype=torch.int64).numpy())


@pytest.mark.parametrize("n", [6000, bag_kernels._TIES_LIMIT - 1, bag_kernels._TIES_LIMIT + 5])
def test_sum_bags_gradient_is_torch_with_heavy_duplicates(n: int) -> None:
    """Rows hit hundreds of times, gradients of very different magnitudes (so that each sum's order shows in
    its bits), on both sides of the size where torch's sort may change algorithm."""
    g = torch.Generator().manual_seed(n)
    for trial in range(8 if n < bag_kernels._TIES_LIMIT else 2):
        rows_n = (2, 9, 50, 700)[trial % 4]
        inverse = (torch.rand(n, generator=g) ** 3 * rows_n).to(torch.int64)
        bags = int(torch.randint(1, 700, (), generator=g))
        cuts = torch.sort(torch.randint(0, n + 1, (bags - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([n])])
        grad_out = torch.randn(bags, 8, generator=g) * torch.exp(torch.randn(bags, 8, generator=g) * 5)
        ref_rows = torch.randn(rows_n, 8, generator=g, requires_grad=True)
        rows = ref_rows.detach().clone().requires_grad_(True)
        F.embedding_bag(inverse, ref_rows, offsets, mode="sum", include_last_offset=True).backward(grad_out)
        sum_bags(rows, inverse, offsets).backward(grad_out)
        assert torch.equal(rows.grad.view(torch.int32), ref_rows.grad.view(torch.int32)), f"trial {trial}"


def test_bag_kernel_writes_every_row_and_checks_the_order() -> None:
    # out need not be zeroed: rows without an entry come out as zeros, first entries as 0.0 + gradient (-0.0 too)
    grad = torch.tensor([[-0.0, 1.0], [2.0, -0.0]])
    offsets, inverse = torch.tensor([0, 2, 3]), torch.tensor([3, 1, 3])
    want = torch.zeros(5, 2).index_add_(0, inverse, grad[torch.tensor([0, 0, 1])])
    for given in (None, inverse.sort().indices.numpy()):
        out = torch.full((5, 2), float("nan"))
        kernels.bag_sum_backward(grad.numpy(), offsets.numpy(), inverse.numpy(), given, out.numpy())
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    with pytest.raises(ValueError, match="does not sort"):
        kernels.bag_sum_backward(
            grad.numpy(), offsets.numpy(), inverse.numpy(), torch.tensor([0, 1, 2]).numpy(), torch.empty(5, 2).numpy()
        )


@pytest.mark.parametrize("workers", [2, 3, 7])
def test_bag_gradient_divided_in_the_kernel_is_div_after_it(workers: int) -> None:
    """A table-wise holder's mean over the workers, divided in the kernel's pass: bit for bit the gradient torch's
    backward gives, then ``.div_(workers)`` (both orders: the kernel's own and a given one; rows hit hundreds of
    times, rows without entries, empty bags)."""
    g = torch.Generator().manual_seed(workers)
    n, rows_n = 3000, 400
    inverse = (torch.rand(n, generator=g) ** 3 * rows_n).to(torch.int64)
    offsets = torch.cat([torch.zeros(2, dtype=torch.int64), torch.arange(5, n, 7), torch.tensor([n])])
    bags = offsets.numel() - 1
    grad = torch.randn(bags, 16, generator=g) * torch.exp(torch.randn(bags, 16, generator=g) * 5)
    ref_rows = torch.zeros(rows_n, 16, requires_grad=True)
    F.embedding_bag(inverse, ref_rows, offsets, mode="sum", include_last_offset=True).backward(grad)
    want = ref_rows.grad.div_(workers)
    for given in (None, inverse.sort().indices.numpy()):
        out = torch.full((rows_n, 16), float("nan"))
        kernels.bag_sum_backward(grad.numpy(), offsets.numpy(), inverse.numpy(), given, out.numpy(), workers)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    got = bag_kernels.sum_bags_gradient(grad, inverse, offsets, rows_n, workers)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_bag_gradient_refuses_a_divisor_out_of_range() -> None:
    grad, out = torch.ones(1, 2), torch.zeros(1, 2)
    args = (grad.numpy(), torch.tensor([0, 1]).numpy(), torch.tensor([0]).numpy(), None, out.numpy())
    for bad in (0, -2, (1 << 24) + 1):
        with pytest.raises(ValueError, match="divisor"):
            kernels.bag_sum_backward(*args, bad)
    assert torch.equal(out, torch.zeros(1, 2))  # nothing written
    with pytest.raises(TypeError):
        kernels.bag_sum_backward(*args, 2.5)


def test_all_finite_each_names_the_first_array_with_nan_or_inf() -> None:
    arrays = [torch.randn(3, 5), torch.randn(7), torch.empty(0, 4), torch.randn(2, 2, 2)]
    assert kernels.all_finite_each([a.numpy() for a in arrays]) == -1
    assert kernels.all_finite_each(()) == -1 and kernels.all_finite_each([]) == -1
    for bad in (math.nan, math.inf, -math.inf):
        broken = [a.clone() for a in arrays]
        broken[1][6] = bad
        broken[3][1, 1, 1] = bad
        assert kernels.all_finite_each([a.numpy() for a in broken]) == 1
        assert kernels.all_finite_each(tuple(a.numpy() for a in broken[2:])) == 1


def test_all_finite_each_refuses_what_it_cannot_read() -> None:
    with pytest.raises(TypeError, match="list or tuple"):
        kernels.all_finite_each(torch.randn(3).numpy())
    with pytest.raises(TypeError, match="array 1 must hold float32"):
        kernels.all_finite_each([torch.randn(3).numpy(), torch.zeros(3, dtype=torch.float64).numpy()])
    with pytest.raises(TypeError, match="array 0 must be a C-contiguous"):
        kernels.all_finite_each([torch.randn(3, 4).t().numpy()])
    with pytest.raises(TypeError, match="array 0 must be a C-contiguous"):
        kernels.all_finite_each([3.0])
