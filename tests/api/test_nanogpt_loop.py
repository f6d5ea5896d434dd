"""nanoGPT's training loop under fleet and under DDP, side by side: gradient accumulation by
``model.require_backward_grad_sync``, AdamW, a GradScaler with unscale and clipping. Equal losses and
parameters, and as many gradient reductions as DDP (counted on both sides); the other accumulation
idioms (``no_sync()``, ``grad_accumulation_steps``) reduce once per step too, and a DDP-style loop under
``grad_accumulation_steps`` is refused instead of training differently."""

from __future__ import annotations

import pytest
import torch
from tiny_gpt import VOCAB, TinyGPT

from dist_harness import free_port, run_workers

WORKERS, STEPS, MICRO, BATCH, SEQ = 2, 3, 4, 2, 8


def _batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * micro + rank)  # the same batches every step: the loss must fall
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _train(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, flag_on: torch.nn.Module, mark) -> list:
    """nanoGPT's train.py loop (its names), one process's part of it."""
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        for micro_step in range(MICRO):
            mark(step, micro_step)
            # nanoGPT: "the official way to do this is with model.no_sync() context manager, but I really
            # dislike that this bloats the code and forces us to repeat code"
            flag_on.require_backward_grad_sync = micro_step == MICRO - 1
            x, y = _batch(rank, step, micro_step)
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / MICRO
            losses.append(loss.item())
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return losses


def _make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(2)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _ddp(rank: int, port: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS)
    raw, opt = _make()
    model = DDP(raw)
    reduced: set[tuple[int, int]] = set()  # the backward passes whose gradients DDP all-reduced
    where = [(0, 0)]

    def count(state, bucket):
        reduced.add(where[0])
        return allreduce_hook(dist.group.WORLD, bucket)

    model.register_comm_hook(None, count)
    losses = _train(rank, model, opt, model, lambda s, m: where.__setitem__(0, (s, m)))
    out = {"losses": losses, "params": [p.detach().clone() for p in raw.parameters()], "reductions": len(reduced)}
    del model  # DDP's reducer goes before its process group, on both ranks before either tears the store down
    dist.barrier()
    dist.destroy_process_group()
    return out


def _fleet(rank: int, where: str) -> dict:
    import fleet
    from fleet.telemetry import timing

    fleet.init()
    raw, inner = _make()
    model = fleet.distributed_model(raw) if where == "model" else raw
    opt = fleet.distributed_optimizer(inner)
    losses = _train(fleet.worker_index(), model, opt, model, lambda s, m: None)
    out = {"losses": losses, "params": [p.detach().clone() for p in raw.parameters()]}
    out["reductions"] = timing.recorder().all_reductions
    fleet.stop_worker()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["model", "optimizer"])  # flag on distributed_model's result, or on the raw model
def test_nanogpt_accumulation_by_the_flag_equals_ddp_and_reduces_as_often(where):
    ddp = run_workers(_ddp, WORKERS, free_port(), timeout=120)
    ours = run_workers(_fleet, WORKERS, where, timeout=120)
    assert ddp[0]["reductions"] == STEPS  # DDP: once per optimizer step
    for theirs, mine in zip(ddp, ours, strict=True):
        assert mine["reductions"] == theirs["reductions"], (mine["reductions"], theirs["reductions"])
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5, abs=1e-6)
        for a, b in zip(mine["params"], theirs["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    first, last = sum(ours[0]["losses"][:MICRO]), sum(ours[0]["losses"][-MICRO:])
    assert last < first  # it trains


def _idiom(rank: int, idiom: str) -> dict:
    import fleet
    from fleet.telemetry import timing

    accumulation = MICRO if idiom in ("field", "field_ddp_loop") else 1
    fleet.init(strategy=fleet.DistributedStrategy(grad_accumulation_steps=accumulation, timeout_s=30))
    raw, inner = _make()
    model = fleet.distributed_model(raw)
    opt = fleet.distributed_optimizer(inner)
    try:
        for step in range(STEPS):
            for micro in range(MICRO):
                x, y = _batch(fleet.worker_index(), step, micro)
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)) / MICRO
                if idiom == "no_sync" and micro < MICRO - 1:
                    with model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                if idiom == "field":  # Paddle's gradient merge: step() on every micro-batch
                    opt.step()
                    opt.zero_grad()
            if idiom != "field":
                opt.step()
                opt.zero_grad()
    except fleet.FleetError as error:
        return {"error": str(error)}
    finally:
        fleet.stop_worker()
    summary = timing.recorder().summary()
    return {"reductions": summary["reductions"], "steps": summary["steps"], "bytes": summary["reduced_bytes"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("idiom", ["no_sync", "field"])
def test_every_accumulation_idiom_reduces_once_per_step(idiom):
    for result in run_workers(_idiom, WORKERS, idiom, timeout=120):
        # the first step only starts the clock: the summary covers the STEPS - 1 steps after it
        assert result["reductions"] == result["steps"] == STEPS - 1, result
        params = sum(p.numel() for p in TinyGPT(2).parameters())
        assert result["bytes"] >= (STEPS - 1) * params * 4  # float32 gradients, once per step


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_ddp_style_loop_under_grad_accumulation_steps_is_refused_naming_both_fixes():
    for result in run_workers(_idiom, WORKERS, "field_ddp_loop", timeout=90):
        message = result["error"]
        assert f"grad_accumulation_steps={MICRO}" in message and f"ran {MICRO} backward passes" in message
        assert "require_backward_grad_sync = False" in message and "drop grad_accumulation_steps" in message
        assert "call optimizer.step() (and zero_grad()) after every backward()" in message
