"""fleet's torch.autograd.backward/grad stand in for torch's only while a sharding strategy holds them:
torch's own are back after fleet.stop_worker() (issue 37: they were replaced for the whole process, for good)."""

from __future__ import annotations

import gc

import pytest
import torch

from dist_harness import run_workers
from fleet.sharding import autograd as sharded_autograd

TORCH_BACKWARD, TORCH_GRAD = torch.autograd.backward, torch.autograd.grad


def _torchs_own() -> bool:
    return torch.autograd.backward is TORCH_BACKWARD and torch.autograd.grad is TORCH_GRAD


def _sharding_worker(rank: int) -> dict:
    import fleet

    before = _torchs_own()
    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    strategy = fleet.DistributedStrategy(mode="sharding")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    during = _torchs_own()
    loss = model(torch.randn(2, 4)).sum()
    loss.backward(inputs=list(model[1].parameters()))  # translated: the sharded parameters get gradients
    named_only = model[1].weight.grad is not None and model[0].weight.grad is None
    opt.step()
    fleet.stop_worker()
    after = _torchs_own()
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()  # torch's own, with no job left
    return {"before": before, "during": during, "named_only": named_only, "after": after, "grad": x.grad.tolist()}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_sharding_job_puts_torchs_autograd_back_at_stop_worker() -> None:
    for result in run_workers(_sharding_worker, 2):
        assert result["before"] and not result["during"] and result["after"]
        assert result["named_only"] and result["grad"] == [3.0, 3.0]


class _Listener:
    def __init__(self) -> None:
        self.calls: list[object] = []

    def before(self, how: int) -> None:
        self.calls.append(how)

    def after(self) -> None:
        self.calls.append("after")


def test_holds_put_torchs_back_when_the_last_closes_or_is_collected() -> None:
    assert _torchs_own()
    first, second = sharded_autograd.EntryPoints(), sharded_autograd.EntryPoints()
    listener = _Listener()
    first.before_backward(listener.before)
    first.after_backward(listener.after)
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    torch.autograd.grad((x * 2).sum(), x)
    assert listener.calls == [sharded_autograd.BACKWARD, "after", sharded_autograd.AUTOGRAD_GRAD]
    first.close()
    assert not _torchs_own()  # the second still holds them
    (x * 2).sum().backward()
    assert listener.calls == [sharded_autograd.BACKWARD, "after", sharded_autograd.AUTOGRAD_GRAD]  # closed: not called
    del second  # a strategy gone without shutdown lets go too
    gc.collect()
    assert _torchs_own()


def test_a_wrapper_put_over_fleets_is_left_in_place() -> None:
    """Someone who wrapped fleet's backward keeps their wrapper: fleet's, inside it, then passes calls through."""
    hold = sharded_autograd.EntryPoints()
    fleets = torch.autograd.backward
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return fleets(*args, **kwargs)

    torch.autograd.backward = theirs
    try:
        hold.close()
        assert torch.autograd.backward is theirs and torch.autograd.grad is TORCH_GRAD
        x = torch.ones(2, requires_grad=True)
        (x * 2).sum().backward()
        assert calls == [1] and x.grad.tolist() == [2.0, 2.0]
        again = sharded_autograd.EntryPoints()  # fleet's is still inside theirs: not wrapped a second time
        assert torch.autograd.backward is theirs
        again.close()
    finally:
        torch.autograd.backward = TORCH_BACKWARD  # they take theirs out, fleet's with it
        hold.close()
    later = sharded_autograd.EntryPoints()  # fleet's stands in again
    assert torch.autograd.backward is not TORCH_BACKWARD and torch.autograd.grad is not TORCH_GRAD
    later.close()
    assert _torchs_own()
