"""With no shard_modules, sharding picks the repeated blocks: a transformer whose blocks sit in an nn.ModuleList
(GPT-, Llama-, ViT-style; FSDP2 cannot shard a ModuleList, which has no forward) shards block by block and
trains as one process does on the union of the workers' batches."""

from __future__ import annotations

import pytest
import torch
from tiny_gpt import VOCAB, TinyGPT
from torch import nn

from dist_harness import run_workers

BLOCKS, SEQ, BATCH, STEPS = 3, 6, 4, 3


def gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(BLOCKS)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank))


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def test_the_default_units_are_the_blocks_inside_containers() -> None:
    from fleet.strategies.sharding import _default_units

    model = gpt()
    units = _default_units(model)
    assert units == [model.tok, *model.layers, model.head]


def gpt_worker(rank: int) -> dict:
    import fleet

    fleet.init()
    model = gpt()
    opt = fleet.distributed_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                      fleet.DistributedStrategy(mode="sharding"))  # fmt: skip
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_of(model, batch(step, rank))
        loss.backward()
        opt.step()
        losses.append(float(loss))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    fleet.stop_worker()
    return {"losses": losses, "state": state}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_model_of_blocks_in_a_module_list_shards_and_equals_one_process() -> None:
    results = run_workers(gpt_worker, 2, timeout=100)
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        parts = [batch(step, r) for r in range(2)]
        losses = [loss_of(model, ids) for ids in parts]
        (sum(losses) / 2).backward()  # the mean over the union: both halves are the same size
        opt.step()
        for rank, result in enumerate(results):
            assert result["losses"][step] == pytest.approx(float(losses[rank].detach()), abs=1e-5), (rank, step)
    for name, value in model.state_dict().items():
        for result in results:
            assert torch.allclose(result["state"][name], value, atol=1e-5), name
