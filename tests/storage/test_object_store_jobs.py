"""A sharding checkpoint in an S3 bucket (moto's server, tests/s3_server.py) saved by two workers and loaded by
three: torch.distributed.checkpoint's shards reshard through the bucket as through a local folder."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # two jobs beside an S3 server: the slow set


def sharded_job(rank: int, endpoint: str, ckpt: str, save: bool) -> dict:
    import fleet
    from s3_server import configure

    configure(endpoint)
    fleet.init()
    torch.manual_seed(rank)  # different on every worker: worker 0's values (or the checkpoint's) win
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = fleet.distributed_optimizer(
        torch.optim.Adam(model.parameters(), lr=0.05), fleet.DistributedStrategy(mode="sharding")
    )
    step = 0
    if save:
        for step in range(1, 3):
            opt.zero_grad()
            generator = torch.Generator().manual_seed(100 * step + rank)
            model(torch.randn(4, 8, generator=generator)).square().mean().backward()
            opt.step()
        fleet.save_checkpoint(ckpt, model, opt, step)
    else:
        step = fleet.load_checkpoint(ckpt, model, opt, missing_ok=False).step
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]
    fleet.stop_worker()
    return {"step": step, "params": params}


@pytest.mark.timeout(240)
def test_a_sharding_checkpoint_in_a_bucket_saved_by_two_workers_loads_with_three(bucket: str, s3_endpoint: str):
    ckpt = f"{bucket}/sharded"
    saved = run_workers(sharded_job, 2, s3_endpoint, ckpt, True, timeout=200)
    loaded = run_workers(sharded_job, 3, s3_endpoint, ckpt, False, timeout=200)
    want = saved[0]["params"]
    for result in loaded:
        assert result["step"] == 2
        for got, expected in zip(result["params"], want, strict=True):
            assert torch.equal(got, expected)
