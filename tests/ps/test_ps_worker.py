"""Worker-side pieces of the parameter-server optimizer, against a fake client (no processes)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from fleet.nn.sparse_embedding import SparseEmbedding
from fleet.ps.modes.rows import GeoRows, RemoteRows
from fleet.sparse.optim import OptimizerSpec


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class FakeClient:
    """Answers sparse pulls with rows ``id + version`` and records what was asked."""

    def __init__(self, dim: int, version: int = 0):
        self.dim = dim
        self.version = version
        self.pulled: list[torch.Tensor] = []

    def pull_sparse(self, table_id: int, ids: torch.Tensor, min_version: int = 0) -> Future:
        assert min_version <= self.version
        self.pulled.append(ids.clone())
        rows = ids.to(torch.float32).unsqueeze(1).expand(-1, self.dim).clone() + self.version
        rows.ps_version = self.version
        return _done(rows)

    def push_sparse_delta(self, table_id: int, ids: torch.Tensor, delta: torch.Tensor) -> Future:
        return _done(None)


@pytest.mark.timeout(30)
def test_geo_cache_fetches_each_id_once_and_keeps_local_updates() -> None:
    module = SparseEmbedding(2)
    client = FakeClient(2)
    rows = GeoRows(client, 0, module, OptimizerSpec.from_torch(torch.optim.SGD, {"lr": 1.0}))
    first = rows.pull(torch.tensor([5, -3, 2**62]))
    assert torch.equal(first[:, 0], torch.tensor([5.0, -3.0, float(2**62)]))
    rows.apply(torch.tensor([5]), torch.ones(1, 2), lr=1.0)  # a local step changes row 5
    again = rows.pull(torch.tensor([7, 5, -3]))
    assert [t.tolist() for t in client.pulled] == [sorted([5, -3, 2**62]), [7]]  # only the new id went out
    assert again[1].tolist() == [4.0, 4.0] and again[0].tolist() == [7.0, 7.0]
    for n in range(3):  # many batches: every one is checked against everything seen, in O(batch)
        rows.pull(torch.arange(n * 1000, n * 1000 + 1500))
    assert sum(t.numel() for t in client.pulled) == len(rows.known) == 3 + 1 + 3500 - 2  # 5 and 7 seen before


@pytest.mark.timeout(30)
def test_remote_rows_follow_a_shard_that_is_ahead() -> None:
    client = FakeClient(2, version=7)  # backup workers closed steps without this worker
    rows = RemoteRows(client, 0)
    rows.version = 3  # this worker's last step was 2
    rows.pull(torch.tensor([1, 2]))
    assert rows.version == 7  # its next push is for the shard's version, not a stale one
    async_rows = RemoteRows(client, 0, sync=False)
    async_rows.pull(torch.tensor([1, 2]))
    assert async_rows.version == 0  # async pulls never wait for a version


def test_hyperparameters_other_than_lr_may_not_change_after_the_tables_exist() -> None:
    from fleet.errors import FleetError
    from fleet.ps.worker.step_checks import HyperParameters

    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9)
    hyper = HyperParameters(opt)
    hyper.record(0)
    opt.param_groups[0]["lr"] = 0.01  # travels with every push
    hyper.check([0])
    opt.param_groups[0]["momentum"] = 0.5
    with pytest.raises(FleetError, match=r"param group 0's 'momentum' changed from 0.9 to 0.5 .*cycle_momentum=False"):
        hyper.check([0])
    hyper.check([])  # a group the servers do not step with its own settings (geo's dense groups)


def test_a_gradient_written_between_backward_and_step_is_refused_naming_the_parameter() -> None:
    from fleet.errors import FleetError
    from fleet.ps.worker.step_checks import GradWatch

    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    watch = GradWatch()
    watch.watch(params)
    names = {id(p): n for n, p in model.named_parameters()}.__getitem__

    def backward() -> None:
        model(torch.ones(4, 3)).pow(2).sum().backward()

    backward()
    backward()  # accumulation: still what backward left
    watch.check(params, lambda p: names(id(p)))
    model.bias.grad = torch.ones(2)  # set by hand with no backward into it since: this worker's gradient
    model.weight.grad = None  # takes no part, as in torch.optim
    watch.check(params, lambda p: names(id(p)))
    for clip in (
        lambda: torch.nn.utils.clip_grad_norm_(params, 1e9),  # rescales by 1.0: written all the same, on every worker
        lambda: torch.nn.utils.clip_grad_value_(params, 0.1),
        lambda: setattr(model.bias, "grad", model.bias.grad * 2),
    ):
        model.zero_grad()
        backward()
        clip()
        with pytest.raises(FleetError, match=r"gradient of '(weight|bias)' was changed between backward\(\) and"):
            watch.check(params, lambda p: names(id(p)))
    watch.check(params, lambda p: names(id(p)))  # forgotten after each check: the next step starts afresh
