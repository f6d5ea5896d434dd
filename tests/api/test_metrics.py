"""fleet.metrics: global metrics equal the single-process value on the union of the workers' data.

In-process: each metric's math against a direct computation (AUC against an exact,
sort-based AUC with ties), Paddle's functional forms, input errors, and server 0's
ALL_REDUCE (servers in threads, workers as PSClients). Multi-process: a collective (and
sharding) job and a parameter-server job whose workers hold different, uneven data, and
a collective job whose workers disagree about what comes next.
"""

from __future__ import annotations

import math

import pytest
import torch
import zmq

import fleet
import fleet.api
from fleet import metrics
from fleet.ps.client.client import PSClient
from fleet.ps.protocol.errors import PSRemoteError
from fleet.ps.protocol.wire import Message, Op, Status, decode, encode
from fleet.ps.server.loop import ParameterServer
from ps_servers import servers

AUC_TOLERANCE = 2e-3  # bucketed against exact (the requirement); measured errors are printed with -s
TOLERANCE = 1e-6


def exact_auc(preds: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney: the share of (positive, negative) pairs ranked right, ties counting half (average ranks)."""
    p, y = preds.reshape(-1).double(), labels.reshape(-1) != 0
    _, inverse, counts = torch.unique(p, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = ((ends - counts + 1 + ends) / 2)[inverse]  # 1-based, ties averaged
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def shard(rank: int) -> dict[str, torch.Tensor]:
    """Worker ``rank``'s evaluation data: uneven sizes, different label rates and score ranges, ties on worker 1."""
    g = torch.Generator().manual_seed(10 + rank)
    n = (1500, 700, 400)[rank]
    labels = (torch.rand(n, generator=g) < (0.3, 0.6, 0.5)[rank]).to(torch.int64)
    scores = torch.randn(n, generator=g) + 1.2 * labels + 0.4 * rank
    probs = torch.sigmoid(scores)
    if rank == 1:
        probs = (probs * 40).round() / 40  # many ties, also across the workers
    return {
        "labels": labels,
        "scores": scores,
        "probs": probs,
        "target": scores.double() * 0.5 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64),
        "logits": torch.randn(n, 3, generator=g) + torch.nn.functional.one_hot(labels, 3) * 0.8,
    }


def union(ranks: range) -> dict[str, torch.Tensor]:
    shards = [shard(r) for r in ranks]
    return {key: torch.cat([s[key] for s in shards]) for key in shards[0]}


def compute_all(rank: int) -> dict[str, float]:
    """Every metric, classes and functions, on this worker's shard; updates in uneven chunks."""
    data = shard(rank)
    auc, auc2, total, mean, high, low = (
        metrics.AUC(), metrics.AUC(), metrics.Sum(), metrics.Mean(), metrics.Max(), metrics.Min()
    )  # fmt: skip
    mae, rmse, acc, acc_binary = metrics.MAE(), metrics.RMSE(), metrics.Accuracy(), metrics.Accuracy()
    cut = len(data["labels"]) // 3
    for part in (slice(0, cut), slice(cut, None)):
        labels, probs, scores = data["labels"][part], data["probs"][part], data["scores"][part]
        auc.update(probs, labels)
        auc2.update(torch.stack([1 - probs, probs], 1), labels.reshape(-1, 1))  # Paddle's [N, 2] form
        for m in (total, mean, high, low):
            m.update(scores)
        mae.update(data["target"][part], scores)
        rmse.update(data["target"][part].reshape(-1, 1), scores)
        acc.update(data["logits"][part], labels)
        acc_binary.update(probs, labels)
    named = {"auc": auc, "auc2": auc2, "total": total, "mean": mean, "high": high, "low": low, "mae": mae}
    named.update(rmse=rmse, acc=acc, acc_binary=acc_binary)
    out = {name: m.compute() for name, m in named.items()}  # every worker, in the same order
    # Paddle's functional forms over statistics the script accumulated itself.
    stat_pos = torch.bincount((data["probs"] * 4095).long()[data["labels"] == 1], minlength=4096).reshape(1, -1)
    stat_neg = torch.bincount((data["probs"] * 4095).long()[data["labels"] == 0], minlength=4096).reshape(1, -1)
    err = data["target"] - data["scores"].double()
    n = len(data["labels"])
    correct = float((data["logits"].argmax(1) == data["labels"]).sum())
    out.update(
        f_auc=metrics.auc(stat_pos, stat_neg),
        f_mae=metrics.mae(err.abs().sum().reshape(1), torch.tensor([n])),
        f_mse=metrics.mse(float((err * err).sum()), n),
        f_rmse=metrics.rmse((err * err).sum().numpy(), n),
        f_acc=metrics.acc(correct, n),
    )
    vector = torch.tensor([1.0, -2.0, 3.5]) * (rank + 1)
    out["f_sum"] = metrics.sum(vector)
    out["f_max"] = metrics.max(vector)
    out["f_min"] = metrics.min(vector.numpy())
    out["f_count"] = metrics.sum(torch.tensor([n]))  # int64 in, int64 out
    return out


def check_against_union(results: list[dict], workers: int) -> float:
    """Every worker got the single-process value on the union; returns the AUC's error against the exact one."""
    data = union(range(workers))
    s, t, y = data["scores"].double(), data["target"], data["labels"]
    expected = {
        "total": float(s.sum()),
        "mean": float(s.mean()),
        "high": float(s.max()),
        "low": float(s.min()),
        "mae": float((t - s).abs().mean()),
        "rmse": math.sqrt(float(((t - s) ** 2).mean())),
        "acc": float((data["logits"].argmax(1) == y).double().mean()),
        "acc_binary": float(((data["probs"] >= 0.5).long() == y).double().mean()),
    }
    expected.update(f_mae=expected["mae"], f_mse=expected["rmse"] ** 2, f_rmse=expected["rmse"], f_acc=expected["acc"])
    single = metrics.AUC()
    single.update(data["probs"], y)
    exact = exact_auc(data["probs"], y)
    vector = torch.tensor([1.0, -2.0, 3.5]) * torch.arange(1, workers + 1).reshape(-1, 1)
    for result in results:
        for name, value in expected.items():
            assert abs(result[name] - value) <= TOLERANCE, (name, result[name], value)
        for name in ("auc", "auc2", "f_auc"):
            assert abs(result[name] - single.compute()) <= 1e-12, name  # the summed histograms are the union's
            assert abs(result[name] - exact) <= AUC_TOLERANCE, (name, result[name], exact)
        assert torch.allclose(result["f_sum"], vector.sum(0), rtol=0, atol=TOLERANCE)
        assert torch.equal(result["f_max"], vector.amax(0)) and result["f_min"].tolist() == vector.amin(0).tolist()
        assert result["f_count"].dtype == torch.int64 and result["f_count"].tolist() == [len(y)]
    return abs(results[0]["auc"] - exact)


# --- the math, in one process ----------------------------------------------------------------


@pytest.fixture
def no_job(monkeypatch):
    for name in ("FLEET_ROLE", "RANK", "WORLD_SIZE", "PADDLE_TRAINER_ID", "TRAINING_ROLE", "FLEET_STRATEGY"):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


def test_every_metric_in_one_process_equals_the_direct_computation(no_job) -> None:
    error = check_against_union([compute_all(0)], 1)
    print(f"AUC error against the exact AUC, one process: {error:.2e}")
    fleet.init()  # one worker: the strategy reduces nothing
    check_against_union([compute_all(0)], 1)
    fleet.stop_worker()


def test_exact_auc_reference_agrees_with_counting_pairs() -> None:
    g = torch.Generator().manual_seed(3)
    preds, labels = (torch.randint(0, 6, (60,), generator=g) / 5), torch.randint(0, 2, (60,), generator=g)
    pos, neg = preds[labels == 1], preds[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert exact_auc(preds, labels) == pytest.approx(float(pairs.mean()), abs=1e-12)
    auc = metrics.AUC(num_thresholds=5)  # every prediction on a bucket edge: bucketing loses nothing
    auc.update(preds, labels)
    assert auc.compute() == pytest.approx(float(pairs.mean()), abs=1e-12)


@pytest.mark.parametrize("spread", ["uniform", "narrow"])
def test_auc_within_tolerance_of_the_exact_auc(spread: str) -> None:
    g = torch.Generator().manual_seed(5)
    labels = (torch.rand(50_000, generator=g) < 0.1).long()
    logits = torch.randn(50_000, generator=g) + labels
    probs = torch.sigmoid(logits) if spread == "uniform" else torch.sigmoid(logits * 0.3 - 3.5)  # CTR-like: ~0.03
    auc = metrics.AUC()
    auc.update(probs, labels)
    error = abs(auc.compute() - exact_auc(probs, labels))
    print(f"AUC error against the exact AUC ({spread}): {error:.2e}")
    assert error <= AUC_TOLERANCE


def test_empty_metrics_reset_and_repr() -> None:
    assert metrics.AUC().compute() == 0.5  # one class only (none here): Paddle's value
    for m in (metrics.Mean(), metrics.Max(), metrics.Min(), metrics.MAE(), metrics.RMSE(), metrics.Accuracy()):
        assert math.isnan(m.compute()), m
    assert metrics.Sum().compute() == 0.0
    high = metrics.Max()
    high.update(torch.tensor([-3.0, -7.0]))
    high.update([])
    assert high.compute() == -3.0
    high.reset()
    assert math.isnan(high.compute())
    low = metrics.Min()
    low.update(4)
    low.update(torch.tensor([[9.0, 5.0]]))
    assert low.compute() == 4.0
    assert repr(metrics.AUC(99)) == "AUC(num_thresholds=99)" and "0.0" in repr(metrics.Accuracy(threshold=0.0))


def test_accuracy_forms() -> None:
    labels = torch.tensor([0, 1, 2, 1])
    acc = metrics.Accuracy()
    acc.update(torch.tensor([[3.0, 1, 0], [0, 2, 1], [0, 5, 1], [1, 2, 0]]), labels.reshape(-1, 1))  # argmax
    assert acc.compute() == 0.75
    acc.reset()
    acc.update(torch.tensor([0, 1, 1, 0]), labels)  # classes as they are
    assert acc.compute() == 0.5
    logits = metrics.Accuracy(threshold=0.0)
    logits.update(torch.tensor([-1.0, 2.0, 0.5, -0.2]), torch.tensor([0, 1, 0, 1]))  # binary scores (logits)
    assert logits.compute() == 0.5
    with pytest.raises(ValueError, match="3 predictions .* for 4 labels"):
        acc.update(torch.tensor([0, 1, 1]), labels)


def test_input_errors_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="probabilities in \\[0, 1\\].*sigmoid"):
        metrics.AUC().update(torch.tensor([0.2, 1.5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="nan"):
        metrics.AUC().update(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        metrics.MAE().update(torch.ones(3), torch.ones(2))
    with pytest.raises(ValueError, match="num_thresholds=0"):
        metrics.AUC(0)
    with pytest.raises(ValueError, match="\\[B\\] or \\[1, B\\]"):
        metrics.auc(torch.ones(2, 3), torch.ones(2, 3))
    from fleet.strategies.base import check_reduce

    with pytest.raises(ValueError, match="float64"):
        check_reduce(torch.ones(2), "sum")
    with pytest.raises(ValueError, match="op='mean'"):
        check_reduce(torch.ones(2, dtype=torch.float64), "mean")


def test_functional_forms_keep_the_input_kind() -> None:
    import numpy as np

    assert metrics.sum(3) == 3.0 and isinstance(metrics.sum(3), float)
    array = metrics.max(np.array([[1, 5]], dtype=np.int32))
    assert isinstance(array, np.ndarray) and array.dtype == np.int32 and array.tolist() == [[1, 5]]
    t = metrics.min(torch.tensor([2.5], dtype=torch.float32))
    assert t.dtype == torch.float32 and t.tolist() == [2.5]
    assert metrics.auc(np.array([0, 3]), np.array([2, 0])) == 1.0 and metrics.auc([0, 0], [1, 1]) == 0.5
    assert math.isnan(metrics.acc(0, 0))


def test_the_reductions_are_named_alike_everywhere() -> None:
    from fleet.collective import lockstep
    from fleet.ps.protocol import wire
    from fleet.strategies.base import REDUCE_OPS

    assert REDUCE_OPS == lockstep.REDUCE_OPS == wire.REDUCE_OPS


# --- ALL_REDUCE on parameter server 0 (threads) ---------------------------------------------

SECRET = b"test-secret-0123"


def client(srvs: list[ParameterServer], worker: int, timeout_s: float = 3.0) -> PSClient:
    return PSClient([s.endpoint for s in srvs], SECRET, worker, timeout_s)


def test_all_reduce_on_server_zero_sums_and_skips_stopped_workers() -> None:
    with servers(2, 3) as srvs:
        clients = [client(srvs, w) for w in range(3)]
        vectors = [torch.tensor([1.0, -2.0, w + 0.5], dtype=torch.float64) for w in range(3)]
        for op, expected in (("sum", [3.0, -6.0, 4.5]), ("max", [1.0, -2.0, 2.5]), ("min", [1.0, -2.0, 0.5])):
            futures = [c.all_reduce(v, op) for c, v in zip(clients, vectors, strict=True)]
            assert [f.result().tolist() for f in futures] == [expected] * 3
        clients[2].close()  # a stopped worker is not waited for
        futures = [c.all_reduce(v) for c, v in zip(clients[:2], vectors[:2], strict=True)]
        assert [f.result().tolist() for f in futures] == [[2.0, -4.0, 2.0]] * 2
        stats = clients[0].stats().result()
        assert stats[0]["ops"]["ALL_REDUCE"] == 11 and "ALL_REDUCE" not in stats[1]["ops"]
        for c in clients[:2]:
            c.close()


def test_all_reduce_disagreements_and_timeouts_name_the_workers() -> None:
    with servers(1, 2) as srvs, client(srvs, 0, timeout_s=1.5) as w0, client(srvs, 1, timeout_s=1.5) as w1:
        first = w0.all_reduce(torch.zeros(4097, dtype=torch.float64))
        second = w1.all_reduce(torch.zeros(1, dtype=torch.float64))
        for future in (first, second):
            with pytest.raises(PSRemoteError, match="worker 0 sent 4097 values to sum; worker 1 sent 1 value to sum"):
                future.result()
        first = w0.all_reduce(torch.ones(2, dtype=torch.float64))
        with pytest.raises(PSRemoteError, match="all-reduce .* timed out after .* waiting for workers \\[1\\]"):
            first.result()
        first = w0.all_reduce(torch.ones(2, dtype=torch.float64))
        second = w1.barrier()
        for future in (first, second):
            with pytest.raises(PSRemoteError, match="worker 0 all-reduce .* while worker 1 wait"):
                future.result()
        # after the errors the server still pairs a well-formed round
        futures = [w0.all_reduce(torch.ones(2)), w1.all_reduce(torch.ones(2))]
        assert [f.result().tolist() for f in futures] == [[2.0, 2.0]] * 2


def test_malformed_all_reduce_gets_an_error_reply() -> None:
    ctx = zmq.Context()
    with servers(2, 1) as srvs:
        cases = [
            (0, Message(Op.ALL_REDUCE, tensors=[torch.ones(3)]), "got torch.float32 of shape [3]"),
            (0, Message(Op.ALL_REDUCE, tensors=[torch.ones(2, 2, dtype=torch.float64)]), "shape [2, 2]"),
            (0, Message(Op.ALL_REDUCE, tensors=[torch.ones(1, dtype=torch.float64)] * 2), "got 2 tensors"),
            (0, Message(Op.ALL_REDUCE), "got 0 tensors"),
            (0, Message(Op.ALL_REDUCE, arg=7, tensors=[torch.ones(1, dtype=torch.float64)]), "unknown reduction 7"),
            (1, Message(Op.ALL_REDUCE, tensors=[torch.ones(1, dtype=torch.float64)]), "goes to parameter server 0"),
        ]
        from fleet.ps.protocol import auth

        for server, msg, needle in cases:
            sock = ctx.socket(zmq.DEALER)
            auth.configure_client(sock, SECRET, "raw")
            sock.connect(f"tcp://{srvs[server].endpoint}")
            sock.send_multipart(encode(msg))
            assert sock.poll(3000), "the server did not answer"
            reply = decode(sock.recv_multipart(copy=False))
            assert reply.status == Status.ERROR and reply.op == Op.ALL_REDUCE and needle in reply.text(), reply.text()
            sock.close(linger=0)
        with client(srvs, 0) as good:  # the server is still serving
            assert good.all_reduce(torch.tensor([2.0]), "max").result().tolist() == [2.0]
    ctx.term()


# --- real jobs --------------------------------------------------------------------------------


def collective_worker(rank: int) -> dict:
    """The same metrics under a sharding strategy (the process group), then under collective (announced)."""
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(mode="sharding", timeout_s=30))
    sharded = compute_all(rank)
    model = torch.nn.Linear(4, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy())
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step + 10 * rank))).sum().backward()
        opt.step()
    collective = compute_all(rank)
    fleet.stop_worker()
    return {"sharding": sharded, "collective": collective}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collective_and_sharding_jobs_compute_the_union_s_metrics() -> None:
    from dist_harness import run_workers

    results = run_workers(collective_worker, 2, timeout=90)
    for mode in ("sharding", "collective"):
        error = check_against_union([r[mode] for r in results], 2)
        print(f"AUC error against the exact AUC, {mode} job of 2 workers: {error:.2e}")


def ps_worker(rank: int) -> dict:
    import fleet

    try:
        fleet.init()
    except SystemExit as stop:  # a server: fleet.init served, then exited the process
        return {"served": stop.code}
    model = torch.nn.Linear(4, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step + 10 * rank))).sum().backward()
        opt.step()
    values = compute_all(fleet.worker_index())
    fleet.stop_worker()
    return values


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_parameter_server_job_computes_the_union_s_metrics_through_server_zero() -> None:
    from ps_jobs import run_job

    results = run_job(ps_worker, 1, 2, {"update": "async"}, timeout=90)
    error = check_against_union(results, 2)
    print(f"AUC error against the exact AUC, parameter-server job of 2 workers: {error:.2e}")


def disagreeing_worker(rank: int) -> tuple[list[str], float]:
    import fleet

    fleet.init(strategy=fleet.DistributedStrategy(timeout_s=20))
    model = torch.nn.Linear(4, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    errors = []
    try:  # worker 0 computes a metric while worker 1 trains
        if rank == 0:
            metrics.Sum().compute()
        else:
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    except fleet.PeerError as error:
        errors.append(str(error))
    try:  # different metrics: different lengths
        (metrics.AUC() if rank == 0 else metrics.Mean()).compute()
    except fleet.PeerError as error:
        errors.append(str(error))
    total = metrics.Sum()  # agreeing again, the job goes on
    total.update(torch.tensor([rank + 1.0]))
    value = total.compute()
    fleet.stop_worker()
    return errors, value


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_collective_workers_that_disagree_about_a_metric_fail_naming_both() -> None:
    from dist_harness import run_workers

    results = run_workers(disagreeing_worker, 2, timeout=90)
    for errors, value in results:
        assert len(errors) == 2, errors
        assert "worker 0 about to all-reduce a global metric" in errors[0], errors[0]
        assert "worker 1 about to all-reduce gradients" in errors[0], errors[0]
        assert "worker 0 reducing 8192 values by sum, worker 1 reducing 2 values by sum" in errors[1], errors[1]
        assert value == 3.0
