"""A model built on the meta device trains under mode="sharding": each worker materialises only its shards,
initialised as a whole build with the same seed would be, or loaded from a checkpoint."""

from __future__ import annotations

import pytest
import torch
from tiny_gpt import VOCAB, TinyGPT
from torch import nn

from dist_harness import run_workers

BLOCKS, SEQ, BATCH, STEPS = 2, 6, 4, 3


def gpt_init(module: nn.Module) -> None:
    """nanoGPT's _init_weights: applied to every module."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, 0.02)


def build(meta: bool, seed: int) -> TinyGPT:
    torch.manual_seed(seed)
    if not meta:
        return TinyGPT(BLOCKS)
    with torch.device("meta"):
        return TinyGPT(BLOCKS)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(10 * step + rank))


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def meta_worker(rank: int, ckpt: str) -> dict:
    import fleet

    fleet.init()
    strategy = fleet.DistributedStrategy(mode="sharding")
    # Pairs trained side by side: a meta build and a whole build with the same seed.
    meta = build(True, 1)
    meta_opt = torch.optim.AdamW(meta.parameters(), lr=0.01)  # built on meta parameters
    meta_opt = fleet.distributed_optimizer(meta_opt, strategy)
    held_by_optimizer = all(
        p is q and not p.is_meta for p, q in zip(meta_opt.param_groups[0]["params"], meta.parameters(), strict=True)
    )
    ref = build(False, 1)
    ref_opt = fleet.distributed_optimizer(torch.optim.AdamW(ref.parameters(), lr=0.01), strategy)
    custom = fleet.distributed_model(build(True, 2), strategy, init=gpt_init)  # reset_parameters, then init
    custom_ref = build(False, 2)
    custom_ref.apply(gpt_init)
    custom_ref = fleet.distributed_model(custom_ref, strategy)
    custom_opt = torch.optim.SGD(custom.parameters(), lr=0.1)
    initial = {"meta": whole(meta), "ref": whole(ref), "custom": whole(custom), "custom_ref": whole(custom_ref)}
    losses: dict[str, list[float]] = {"meta": [], "ref": []}
    for step in range(STEPS):
        for name, model, opt in (("meta", meta, meta_opt), ("ref", ref, ref_opt)):
            opt.zero_grad()
            loss = loss_of(model, batch(step, rank))
            loss.backward()
            opt.step()
            losses[name].append(float(loss))
    custom_opt.zero_grad()
    loss_of(custom, batch(0, rank)).backward()
    custom_opt.step()
    fleet.save_checkpoint(ckpt, ref, ref_opt, STEPS)
    # A meta build loaded from that checkpoint: no values of its own needed (init does nothing).
    loaded = build(True, 3)
    loaded_opt = fleet.distributed_optimizer(torch.optim.AdamW(loaded.parameters(), lr=0.01), strategy,
                                             init=lambda module: None)  # fmt: skip
    fleet.load_checkpoint(ckpt, loaded, loaded_opt)
    result = {
        "held_by_optimizer": held_by_optimizer,
        "initial": initial,
        "losses": losses,
        "final": {"meta": whole(meta), "ref": whole(ref), "loaded": whole(loaded)},
        "trained_custom": whole(custom),
    }
    fleet.stop_worker()
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_meta_model_equals_the_whole_build_sharded_and_loads_a_checkpoint(tmp_path) -> None:
    results = run_workers(meta_worker, 2, str(tmp_path / "ckpt"), timeout=130)
    for result in results:
        assert result["held_by_optimizer"]
        initial = result["initial"]
        for name, value in initial["ref"].items():
            assert torch.equal(initial["meta"][name], value), name  # reset_parameters as the constructors ran them
        for name, value in initial["custom_ref"].items():
            assert torch.equal(initial["custom"][name], value), name
        # a shard of a random tensor is not a copy of the other shard (DTensor's CPU random would make it one)
        assert not torch.equal(
            initial["meta"]["head.weight"][: VOCAB // 2], initial["meta"]["head.weight"][VOCAB // 2 :]
        )
        assert result["losses"]["meta"] == pytest.approx(result["losses"]["ref"], abs=1e-5)
        for name, value in result["final"]["ref"].items():
            assert torch.allclose(result["final"]["meta"][name], value, atol=1e-5), name
            assert torch.equal(result["final"]["loaded"][name], value), name
    # the same on both workers, and equal to one process trained on the union of the batches
    model = build(False, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        (sum(loss_of(model, batch(step, r)) for r in range(2)) / 2).backward()
        opt.step()
    for name, value in model.state_dict().items():
        for result in results:
            assert torch.allclose(result["final"]["meta"][name], value, atol=1e-5), name
    assert torch.equal(results[0]["trained_custom"]["head.weight"], results[1]["trained_custom"]["head.weight"])


def test_one_process_materialises_a_meta_model_and_refuses_what_it_cannot(fresh_fleet) -> None:
    import fleet
    from fleet.errors import FleetError

    meta = build(True, 1)
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(meta.parameters(), lr=0.1), fleet.DistributedStrategy(mode="sharding")
    )
    ref = build(False, 1)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], meta.parameters(), strict=True))
    for (name, value), theirs in zip(ref.state_dict().items(), meta.state_dict().values(), strict=True):
        assert torch.equal(value, theirs), name
    opt.zero_grad()
    loss_of(meta, batch(0, 0)).backward()
    opt.step()

    class Scaled(nn.Module):  # a parameter no reset_parameters() sets
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        bare = Scaled()
    with pytest.raises(FleetError, match=r"parameter 'scale' of the meta-device model has no initial value.*init="):
        fleet.distributed_model(bare)
    with pytest.raises(FleetError, match="init= initialises a model built on the meta device, but"):
        fleet.distributed_model(nn.Linear(2, 2), init=gpt_init)


def test_collective_mode_refuses_a_meta_model(fresh_fleet) -> None:
    import fleet
    from fleet.errors import FleetError

    with torch.device("meta"):
        model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        FleetError, match=r"parameter 'weight' is on the meta device.*mode='collective'.*mode='sharding'"
    ):
        fleet.distributed_optimizer(opt)
