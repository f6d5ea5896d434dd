"""W2 on PaddlePaddle 2.6.2's Fleet parameter server (static graph, C++ brpc runtime): the peer of
``benchmarks/w2_ctr.py --peers``. Runs in its own venv (``bash benchmarks/peers/setup.sh paddle``):

    benchmarks/peers/.venvs/paddle/bin/python benchmarks/peers/w2_paddle.py [--mode async|sync|geo]
        [--servers 1] [--steps 300] [--report FILE]

Without ``--role`` this is the driver: it picks free ports on 127.0.0.1 and runs
``python -m paddle.distributed.launch --servers ... --trainers ...`` (S servers, 2 trainers) on this
file, bounded by ``--timeout``; every process it started is killed on the way out. Each trainer
prints (and appends to ``--report``) one JSON line ``{"worker", "loss", "first_loss",
"samples_per_s"}``, as examples/single_to_multi/train_ctr.py does for fleet.

The workload is W2 (benchmarks/README.md): 26 slots of uniform ids in [0, 1e6) looked up in one
shared sparse table of dimension 16 (``paddle.static.nn.sparse_embedding``, rows created on first
touch on the servers), 13 dense features, MLP 429-400-400-400-1 with ReLU, BCE with logits, SGD lr
0.1 on the dense parameters and on the table (``SparseNaiveSGDRule``; Paddle's default rule for a
table would be Adam), batch 512 per worker, label = dense @ w_true > 0 with fleet's w_true
(``torch.randn(13, generator=torch.Generator().manual_seed(0))``, written out below since this venv
has no torch). Data comes from numpy's generator seeded 1 + worker, by the same rule as fleet's.
One intra-op thread per process (``OMP_NUM_THREADS=1``, ``CPU_NUM=1``), like fleet's workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from peer_procs import TimedWindow, kill_group, member_argv, read_report, report_result

SLOTS, DIM, DENSE, ID_SPACE = 26, 16, 13, 1_000_000
# torch.randn(13, generator=torch.Generator().manual_seed(0)).tolist()
W_TRUE = [
    1.5409960746765137,
    -0.293428897857666,
    -2.1787893772125244,
    0.5684312582015991,
    -1.0845223665237427,
    -1.3985954523086548,
    0.40334683656692505,
    0.8380263447761536,
    -0.7192575931549072,
    -0.40334352850914,
    -0.5966353416442871,
    0.18203648924827576,
    -0.8566746115684509,
]
WORKERS = 2


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ready(worker: int) -> None:
    """Past the warm-up: tell benchmarks/peers/profile_w2.py (W2_READY names a file prefix) it may sample now."""
    if os.environ.get("W2_READY"):
        with open(f"{os.environ['W2_READY']}.{worker}", "w") as f:
            f.write(str(os.getpid()))


# --------------------------------------------------------------------------- driver


def drive(args: argparse.Namespace) -> int:
    ports = free_ports(args.servers + WORKERS + 1)
    servers = ",".join(f"127.0.0.1:{p}" for p in ports[: args.servers])
    trainers = ",".join(f"127.0.0.1:{p}" for p in ports[args.servers : args.servers + WORKERS])
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="w2-paddle-")
    os.makedirs(log_dir, exist_ok=True)
    report = os.path.abspath(args.report or os.path.join(log_dir, "report.jsonl"))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CPU_NUM": "1",
        "GLOG_v": "0",
        "GLOG_minloglevel": "2",
        "FLAGS_call_stack_level": "0",
        "PYTHONUNBUFFERED": "1",
    }
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--servers",
        servers,
        "--trainers",
        trainers,
        "--gloo_port",
        str(ports[-1]),
        "--log_dir",
        log_dir,
        *member_argv(__file__, args, report, "--mode", args.mode, "--feed", args.feed),
    ]
    started = time.perf_counter()
    launcher_log = open(os.path.join(log_dir, "launcher.out"), "w+")
    # cwd: the launcher's http.log and the trainers' <id>_train_desc.prototxt land there
    proc = subprocess.Popen(
        cmd, env=env, cwd=log_dir, stdout=launcher_log, stderr=subprocess.STDOUT, start_new_session=True
    )
    rc, results, done_at = None, [], None
    try:
        # Paddle's launcher keeps the servers (and so itself) running after the trainers are done:
        # the job is over once both trainers have reported, with a short grace for their stop_worker().
        while rc is None:
            rc = proc.poll()
            results = read_report(report)
            if len(results) >= WORKERS and done_at is None:
                done_at = time.perf_counter()
            if done_at is not None and time.perf_counter() - done_at > args.grace:
                rc = 0
            elif time.perf_counter() - started > args.timeout:
                rc = 124
            time.sleep(0.2)
    finally:
        kill_group(proc, settle_s=0.5)
        launcher_log.seek(0)
        out = launcher_log.read()
        launcher_log.close()
    results = read_report(report)
    if rc != 0 or len(results) != WORKERS:
        logs = []
        for name in sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []:
            if name.startswith(("workerlog", "serverlog")):
                with open(os.path.join(log_dir, name), errors="replace") as f:
                    logs.append(f"--- {name} (tail)\n" + f.read()[-2500:])
        print(
            f"paddle {args.mode} servers={args.servers}: failed (rc {rc}, {len(results)} of {WORKERS} workers reported,"
            f" {time.perf_counter() - started:.0f} s)\n{(out or '')[-2000:]}\n" + "\n".join(logs),
            file=sys.stderr,
        )
        return rc or 1
    for r in results:
        print(json.dumps(r), flush=True)
    if not args.log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


# --------------------------------------------------------------------------- server / trainer


def build(lod_ids: bool):
    """The W2 network; ``lod_ids``: ids as one LoD slot of 26 ids per sample (the dataset readers' form)."""
    import paddle
    import paddle.nn.functional as F

    # batch x 26 ids flattened to [batch * 26, 1]: lookup_table wants a trailing 1
    ids = paddle.static.data("ids", [-1, 1], "int64", lod_level=1 if lod_ids else 0)
    dense = paddle.static.data("dense", [-1, DENSE], "float32")
    label = paddle.static.data("label", [-1, 1], "float32")
    emb = paddle.static.nn.sparse_embedding(
        input=ids,
        size=[ID_SPACE, DIM],
        param_attr=paddle.ParamAttr(name="emb", initializer=paddle.nn.initializer.Uniform(-0.01, 0.01)),
    )
    x = paddle.concat([paddle.reshape(emb, [-1, SLOTS * DIM]), dense], axis=1)
    width = SLOTS * DIM + DENSE
    for out in (400, 400, 400, 1):
        # torch.nn.Linear's default initialization (uniform in +-1/sqrt(fan_in), weights and bias), as fleet's
        bound = width**-0.5
        w, b = (paddle.ParamAttr(initializer=paddle.nn.initializer.Uniform(-bound, bound)) for _ in range(2))
        x = paddle.static.nn.fc(x, out, activation="relu" if out > 1 else None, weight_attr=w, bias_attr=b)
        width = out
    logit = x
    loss = paddle.mean(F.binary_cross_entropy_with_logits(logit, label))
    return [ids, dense, label], loss


def batches(worker: int, batch: int):
    """W2's data with numpy: uniform ids in [0, 1e6), standard normal dense, label = dense @ w_true > 0."""
    import numpy as np

    w_true = np.asarray(W_TRUE, dtype=np.float32)
    rng = np.random.default_rng(1 + worker)
    while True:
        ids = rng.integers(0, ID_SPACE, (batch * SLOTS, 1), dtype=np.int64)
        dense = rng.standard_normal((batch, DENSE), dtype=np.float32)
        yield ids, dense, (dense @ w_true > 0).astype(np.float32).reshape(-1, 1)


def write_slots(path: str, data, n_batches: int) -> None:
    """``n_batches`` of ``data`` as MultiSlot text lines: ``26 ids... 13 dense... 1 label`` per sample."""
    with open(path, "w") as f:
        for _ in range(n_batches):
            ids, dense, label = next(data)
            ids = ids.reshape(-1, SLOTS)
            f.writelines(
                f"{SLOTS} {' '.join(map(str, i))} {DENSE} {' '.join(f'{v:.6g}' for v in d)} 1 {int(y[0])}\n"
                for i, d, y in zip(ids.tolist(), dense.tolist(), label.tolist(), strict=True)
            )


def _dense_puller(fleet):
    """Pull every dense parameter from the servers into the global scope (one request per dense table).

    Paddle 2.6's CPU async PS pulls dense parameters only inside ``exe.train_from_dataset`` (its
    DistMultiTrainer's DownpourLite worker runs a pull-dense thread); ``exe.run`` sends the gradients
    (the program's ``send`` ops) but never refreshes the worker's copy, so without this the MLP
    never changes on the worker. The same call ``fleet.init_worker()`` makes once at the start.
    """
    import paddle
    from paddle.distributed.ps.utils.public import get_the_one_recv_context

    runtime = fleet.fleet._runtime_handle
    dense_map = get_the_one_recv_context(runtime.context, split_dense_table=runtime.is_heter_ps_mode)
    scopes = [paddle.static.global_scope()]
    return lambda: runtime._pull_all_dense(scopes, runtime._send_ctx, dense_map)


def _train_run(args, exe, program, loss, fleet, worker: int, window: TimedWindow) -> tuple[list[float], float]:
    """``exe.run`` with a feed per step, then a pull of the dense parameters: (losses, timed seconds)."""
    import numpy as np

    pull_dense = _dense_puller(fleet)
    data = batches(worker, args.batch)
    losses = []
    start = time.perf_counter()
    profiler = None
    for step in range(args.steps):
        if step == args.warmup:
            start = time.perf_counter()
            window.start()
            _ready(worker)
        if args.profile and worker == 0 and step == args.warmup:
            import paddle.profiler

            profiler = paddle.profiler.Profiler(targets=[paddle.profiler.ProfilerTarget.CPU])
            profiler.start()
            profiled_from, pull_s = time.perf_counter(), 0.0
        ids, dense, label = next(data)
        (value,) = exe.run(program, feed={"ids": ids, "dense": dense, "label": label}, fetch_list=[loss.name])
        pulled = time.perf_counter()
        pull_dense()
        if profiler is not None:
            pull_s += time.perf_counter() - pulled
            profiler.step()
            if step == args.warmup + args.profile_steps - 1:
                profiler.stop()
                _write_profile(args.profile, profiler, time.perf_counter() - profiled_from, pull_s, args.profile_steps)
                profiler = None
        losses.append(float(np.asarray(value).reshape(-1)[0]))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"worker {worker} step {step} loss {losses[-1]:.4f}", flush=True)
    window.stop()
    return losses, time.perf_counter() - start


def _write_profile(path: str, profiler, wall_s: float, pull_s: float, steps: int) -> None:
    """paddle.profiler's operator summary, with the wall time per step and the dense pulls' share."""
    import contextlib
    import io

    import paddle.profiler

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        profiler.summary(sorted_by=paddle.profiler.SortedKeys.CPUTotal, op_detail=True, time_unit="ms")
    head = (
        f"paddle.profiler, worker 0, {steps} steps, {1e3 * wall_s / steps:.1f} ms/step wall;"
        f" dense pull after each step (_pull_all_dense): {100 * pull_s / wall_s:.1f} % of the wall time\n"
    )
    with open(path, "w") as f:
        f.write(head + text.getvalue())
    print(head, flush=True)


def _train_dataset(args, exe, program, loss, feeds, worker: int, window: TimedWindow) -> tuple[list[float], float]:
    """``exe.train_from_dataset`` (DistMultiTrainer + DownpourLite, 1 thread) on a QueueDataset of
    MultiSlot text files written first (not timed): the warm-up batches, then the timed ones.
    The loss comes from the trainer's own printout (every ``print_period`` batches, on stdout)."""
    import re

    import paddle

    folder = tempfile.mkdtemp(prefix=f"w2-paddle-data-{worker}-")
    data = batches(worker, args.batch)
    warm, timed = os.path.join(folder, "warmup.txt"), os.path.join(folder, "timed.txt")
    write_slots(warm, data, args.warmup)
    write_slots(timed, data, args.steps - args.warmup)
    losses: list[float] = []
    elapsed = 0.0
    for path, is_timed in ((warm, False), (timed, True)):
        dataset = paddle.distributed.QueueDataset()
        dataset.init(batch_size=args.batch, thread_num=1, use_var=feeds, pipe_command="cat")
        dataset.set_filelist([path])
        out = os.path.join(folder, "out.txt")
        sys.stdout.flush()
        saved = os.dup(1)
        with open(out, "w") as f:
            os.dup2(f.fileno(), 1)  # the C++ trainer prints "loss: <value>" here
        try:
            if is_timed:
                _ready(worker)
            start = time.perf_counter()
            window.start()
            exe.train_from_dataset(program, dataset, fetch_list=[loss], fetch_info=["loss"], print_period=10)
            if is_timed:
                elapsed = time.perf_counter() - start
                window.stop()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        with open(out) as f:
            text = f.read()
        losses += [float(v) for v in re.findall(r"loss\[\d+\]:\[\s*([-+0-9.eEnaif]+)", text)]
    for i, value in enumerate(losses):
        print(f"worker {worker} loss {value:.4f} (printout {i})", flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return losses, elapsed


def member(args: argparse.Namespace) -> None:
    import paddle
    import paddle.distributed.fleet as fleet

    # protobuf 3.20.3 has no C extension for Python 3.11, and DistributedStrategy.__repr__ (formatted
    # eagerly for a debug log inside minimize) imports it: print the strategy without it.
    fleet.DistributedStrategy.__repr__ = lambda self: f"DistributedStrategy(a_sync={self.a_sync})"
    paddle.enable_static()
    paddle.seed(0)
    fleet.init()  # PaddleCloudRoleMaker from the launcher's environment (PADDLE_* / TRAINING_ROLE)
    feeds, loss = build(lod_ids=args.feed == "dataset")
    strategy = fleet.DistributedStrategy()
    strategy.a_sync = args.mode != "sync"
    if args.mode == "geo":
        strategy.a_sync_configs = {"k_steps": 100}
    # The table's update rule: plain SGD at W2's lr 0.1 (left unset, the_one_ps picks Adam for a table).
    naive = {"name": "SparseNaiveSGDRule", "naive.learning_rate": 0.1, "naive.initial_range": 0.01}
    strategy.sparse_table_configs = {
        "emb": {
            **{f"table_parameters.emb.accessor.embed_sgd_param.{k}": v for k, v in naive.items()},
            **{f"table_parameters.emb.accessor.embedx_sgd_param.{k}": v for k, v in naive.items()},
            "table_parameters.emb.accessor.embed_sgd_param.naive.weight_bounds": [-10.0, 10.0],
            "table_parameters.emb.accessor.embedx_sgd_param.naive.weight_bounds": [-10.0, 10.0],
        }
    }
    opt = fleet.distributed_optimizer(paddle.optimizer.SGD(learning_rate=0.1), strategy)
    opt.minimize(loss)

    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return

    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(paddle.static.default_startup_program())
    fleet.init_worker()
    worker = fleet.worker_index()
    program = paddle.static.default_main_program()
    window = TimedWindow()
    if args.feed == "dataset":
        losses, elapsed = _train_dataset(args, exe, program, loss, feeds, worker, window)
    else:
        losses, elapsed = _train_run(args, exe, program, loss, fleet, worker, window)
    report_result(args, worker, losses, elapsed, window, system="paddle", mode=args.mode, feed=args.feed)
    fleet.stop_worker()
    print(f"worker {worker} stopped", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["async", "sync", "geo"], default="async")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument(
        "--feed",
        choices=["run", "dataset"],
        default="run",
        help="run: exe.run with a numpy feed per step (+ a dense pull); dataset: exe.train_from_dataset on text files",
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--report", default=None, help="append each worker's JSON line here")
    parser.add_argument("--log-dir", default=None, help="Paddle's launcher logs (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the whole job is killed")
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds the job may take to stop once both trainers reported"
    )
    parser.add_argument("--profile", default=None, help="--feed run, worker 0: paddle.profiler's summary here")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--role", choices=["driver", "member"], default="driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "member":
        member(args)
    else:
        sys.exit(drive(args))


if __name__ == "__main__":
    main()
