"""The public face: exports, single-process runs, optimizer surface, loaders, custom strategies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import fleet
import fleet.api
from dist_harness import run_workers
from fleet.training.optimizer import WrappedOptimizer

PUBLIC = {
    "DistributedStrategy",
    "DiskFullError",
    "EnvError",
    "FleetError",
    "ModelMismatchError",
    "PaddleCloudRoleMaker",
    "PeerError",
    "StoreTamperedError",
    "Role",
    "RoleInfo",
    "SlotDataset",
    "Strategy",
    "StrategyError",
    "UserDefinedRoleMaker",
    "barrier_worker",
    "distributed_loader",
    "distributed_model",
    "distributed_optimizer",
    "file_shard",
    "init",
    "init_server",
    "is_first_worker",
    "is_server",
    "is_worker",
    "join",
    "load_checkpoint",
    "load_persistables",
    "progress",
    "register_strategy",
    "report",
    "role_info",
    "run_server",
    "save",
    "save_checkpoint",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "shrink",
    "export_for_inference",
    "load_for_inference",
    "CountFilterEntry",
    "ProbabilityEntry",
    "stop_worker",
    "worker_index",
    "local_rank",
    "worker_num",
}


@pytest.fixture(autouse=True)
def fresh_context(monkeypatch):
    for name in (
        "FLEET_ROLE",
        "RANK",
        "WORLD_SIZE",
        "PADDLE_TRAINER_ID",
        "TRAINING_ROLE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
        "FLEET_STRATEGY",
        "FLEET_STRATEGY_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    fleet.api._reset_for_tests()
    yield
    fleet.api._reset_for_tests()


# The public functions' parameters (names, kinds, defaults): changing one breaks users' scripts.
SIGNATURES = {
    "barrier_worker": "()",
    "distributed_loader": "(loader, *, split_batches=None)",
    "distributed_model": "(model, strategy=None, *, init=None)",
    "distributed_optimizer": "(optimizer, strategy=None, *, init=None)",
    "file_shard": "(files)",
    "init": "(role_maker=None, strategy=None, is_collective=None)",
    "init_server": "(dirname=None)",
    "is_first_worker": "()",
    "is_server": "()",
    "is_worker": "()",
    "join": "()",
    "load_checkpoint": "(dirname, model, optimizer, *, missing_ok=True)",
    "load_persistables": "(dirname)",
    "progress": "(iterable, total=None, description='working', *, every_s=10.0, stream=None)",
    "report": "(label=None)",
    "register_strategy": "(name, cls, override=False)",
    "role_info": "()",
    "run_server": "()",
    "save": "(obj, path)",
    "save_checkpoint": "(dirname, model, optimizer, step, **extra)",
    "save_persistables": "(dirname, mode='base')",
    "server_endpoints": "()",
    "server_index": "()",
    "server_num": "()",
    "shrink": "(threshold=None)",
    "export_for_inference": "(dirname, model)",
    "load_for_inference": "(dirname, model)",
    "stop_worker": "()",
    "worker_index": "()",
    "local_rank": "()",
    "worker_num": "()",
}


def _shape(function) -> str:
    import inspect

    return str(
        inspect.signature(function).replace(
            parameters=[
                p.replace(annotation=inspect.Parameter.empty) for p in inspect.signature(function).parameters.values()
            ],
            return_annotation=inspect.Signature.empty,
        )
    )


def test_public_api_is_frozen():
    import inspect

    assert set(fleet.__all__) == PUBLIC
    functions = {name: getattr(fleet, name) for name in sorted(PUBLIC)}  # every exported name resolves
    assert {name for name, obj in functions.items() if inspect.isfunction(obj)} == set(SIGNATURES)
    for name, expected in SIGNATURES.items():
        assert _shape(functions[name]) == expected, name


# fleet.metrics (a submodule, Paddle's fleet.metrics): classes by constructor, Paddle's functions.
METRICS_SIGNATURES = {
    "AUC": "(num_thresholds=4095)",
    "Accuracy": "(threshold=0.5)",
    "MAE": "()",
    "Max": "()",
    "Mean": "()",
    "Metric": "()",
    "Min": "()",
    "RMSE": "()",
    "Sum": "()",
    "acc": "(correct, total)",
    "auc": "(stat_pos, stat_neg)",
    "mae": "(abserr, total_ins_num)",
    "max": "(input)",
    "min": "(input)",
    "mse": "(sqrerr, total_ins_num)",
    "rmse": "(sqrerr, total_ins_num)",
    "sum": "(input)",
}


def test_metrics_api_is_frozen():
    metrics = fleet.metrics
    assert set(metrics.__all__) == set(METRICS_SIGNATURES)
    for name, expected in METRICS_SIGNATURES.items():
        assert _shape(getattr(metrics, name)) == expected, name
    for name in ("AUC", "Accuracy", "MAE", "Max", "Mean", "Min", "RMSE", "Sum"):
        cls = getattr(metrics, name)
        assert all(callable(getattr(cls, method, None)) for method in ("update", "compute", "reset")), name


def test_exported_names_survive_importing_every_submodule():
    """``import fleet.<module>`` binds the module on the package: no module may share an exported name."""
    import importlib
    import pkgutil

    for module in pkgutil.walk_packages(fleet.__path__, "fleet."):
        if ".launch" not in module.name:
            importlib.import_module(module.name)
    for name in PUBLIC:
        assert not inspect_is_module(getattr(fleet, name)), f"fleet.{name} is a module, not the exported object"
    assert callable(fleet.progress) and list(fleet.progress(range(3))) == [0, 1, 2]


def inspect_is_module(obj) -> bool:
    import types

    return isinstance(obj, types.ModuleType)


def test_plain_python_is_worker_zero_of_one():
    fleet.init()
    assert (fleet.worker_index(), fleet.worker_num(), fleet.is_worker(), fleet.is_server()) == (0, 1, True, False)
    assert fleet.is_first_worker() and fleet.server_num() == 0 and fleet.server_index() == -1
    fleet.barrier_worker()
    fleet.stop_worker()


def test_wrapped_optimizer_keeps_the_optimizer_surface():
    fleet.init()
    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    opt = fleet.distributed_optimizer(inner)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.125)
    saved = opt.state_dict()
    assert saved["state"] and saved["param_groups"][0]["lr"] == pytest.approx(0.125)
    fresh = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9))
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.125)
    assert torch.equal(fresh.state[model.weight]["momentum_buffer"], inner.state[model.weight]["momentum_buffer"])


def test_grad_scaler_steps_through_the_wrapper():
    fleet.init()
    model = torch.nn.Linear(4, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = model.weight.detach().clone()
    loss = model(torch.randn(5, 4)).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grad = model.weight.grad.clone()
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(model.weight.detach(), before - 0.1 * grad)


def test_wrapping_twice_is_refused():
    fleet.init()
    opt = fleet.distributed_optimizer(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already wrapped"):
        fleet.distributed_optimizer(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        fleet.distributed_optimizer(object())


def test_single_process_gradient_accumulation_averages_micro_batches():
    fleet.init()
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    opt = fleet.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(grad_accumulation_steps=2)
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    xs = torch.randn(2, 4, 3)
    for x in xs:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    ref_opt.zero_grad()
    reference(xs.reshape(8, 3)).pow(2).mean().backward()
    ref_opt.step()
    assert torch.allclose(model.weight, reference.weight, atol=1e-6)


def test_distributed_loader_shards_and_reshuffles():
    dataset = TensorDataset(torch.arange(20))
    loader = DataLoader(dataset, batch_size=3, shuffle=True)
    shards = [fleet.data.loader.shard_loader(loader, 2, rank) for rank in range(2)]
    seen = [torch.cat([b[0] for b in shard]).tolist() for shard in shards]
    assert sorted(seen[0] + seen[1]) == list(range(20)) and not set(seen[0]) & set(seen[1])
    second = [b[0].tolist() for b in shards[0]]  # a new pass is a new epoch, as with DataLoader(shuffle=True)
    assert second != [b[0].tolist() for b in shards[0]]
    shards[0].set_epoch(1)  # set_epoch wins and gives the epoch's own order
    assert [b[0].tolist() for b in shards[0]] == second
    assert len(shards[0]) == 4
    with pytest.raises(TypeError, match="DataLoader"):
        fleet.distributed_loader([1, 2, 3])


# --- multi-process ------------------------------------------------------------------------


class NaiveAllReduce(fleet.Strategy):
    """A user's own strategy: average gradients in step(), one all-reduce per parameter."""

    name = "naive"

    def wrap_optimizer(self, optimizer):
        group = self.runtime.process_group(self.config.timeout_s)
        outer = self

        class Naive(WrappedOptimizer):
            def step(self, closure=None):
                for p in self.parameters():
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= dist.get_world_size(group)
                outer.steps += 1
                return super().step(closure)

        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p in params:
            dist.broadcast(p.data, src=0, group=group)
        self.steps = 0
        return Naive(optimizer)


def custom_strategy_worker(rank):
    fleet.register_strategy("naive", NaiveAllReduce)
    fleet.init()
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 1)
    strategy = fleet.DistributedStrategy(mode="naive")
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    x = torch.full((2, 3), float(rank + 1))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    return torch.cat([model.weight.detach().reshape(-1), model.bias.detach()])


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_user_registered_strategy_trains():
    results = run_workers(custom_strategy_worker, 2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    # union of both workers' batches: gradient of the sum per worker, averaged
    x = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    (model(x).sum() / 2).backward()
    expected = torch.cat(
        [
            model.weight.detach().reshape(-1) - 0.1 * model.weight.grad.reshape(-1),
            model.bias.detach() - 0.1 * model.bias.grad,
        ]
    )
    assert torch.equal(results[0], results[1])
    assert torch.allclose(results[0], expected, atol=1e-6)


def mismatch_worker(rank, how):
    fleet.init()
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2 + rank))
    if how == "distributed_model":
        fleet.distributed_model(model, fleet.DistributedStrategy(timeout_s=20))
    else:  # the model is never given to fleet: its name is found from the optimizer's parameters
        fleet.distributed_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(timeout_s=20)
        )
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["distributed_model", "distributed_optimizer"])
def test_different_models_are_named_not_hung(how):
    with pytest.raises(AssertionError) as error:
        run_workers(mismatch_worker, 2, how)
    message = str(error.value)
    assert "ModelMismatchError" in message and "'1.weight'" in message and "worker 1" in message


def model_worker(rank):
    fleet.init()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3) + rank).sum().backward()
        opt.step()
    fleet.barrier_worker()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fleet.stop_worker()
    return state


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_distributed_model_keeps_parameters_and_buffers_identical():
    a, b = run_workers(model_worker, 2)
    assert a.keys() == b.keys() and "1.running_mean" in a
    for key in a:
        if key.endswith("running_mean") or key.endswith("running_var"):
            continue  # updated by each worker's own forward after the broadcast, as with DDP
        assert torch.equal(a[key], b[key]), key


# --- fleet.init: is_collective, called twice, one strategy per job ------------------------------------


def _ps_worker_env(monkeypatch, workers=1, servers=1):
    for key, value in {
        "FLEET_ROLE": "worker",
        "FLEET_WORKER_INDEX": "0",
        "FLEET_WORKER_NUM": str(workers),
        "FLEET_SERVER_NUM": str(servers),
        "FLEET_SERVER_ENDPOINTS": ",".join(["127.0.0.1:1"] * servers),
        "FLEET_MASTER": "127.0.0.1:1",
    }.items():
        monkeypatch.setenv(key, value)


def test_is_collective_true_refuses_a_launch_with_servers(monkeypatch):
    _ps_worker_env(monkeypatch)
    with pytest.raises(
        fleet.StrategyError, match=r"is_collective=True\) asks for collective training, but the launch started 1"
    ):
        fleet.init(is_collective=True)


def test_is_collective_true_refuses_a_ps_strategy():
    with pytest.raises(fleet.StrategyError, match=r"is_collective=True.*mode='ps'"):
        fleet.init(strategy=fleet.DistributedStrategy(mode="ps"), is_collective=True)


def test_is_collective_false_needs_servers_when_there_are_several_workers(monkeypatch):
    _ps_worker_env(monkeypatch, workers=2, servers=0)
    monkeypatch.delenv("FLEET_SERVER_ENDPOINTS")
    with pytest.raises(
        fleet.StrategyError,
        match=r"is_collective=False\) asks for a parameter-server job, but the launch started 2 workers and no parameter server",
    ):
        fleet.init(is_collective=False)


def test_is_collective_false_refuses_an_explicit_collective_strategy():
    with pytest.raises(fleet.StrategyError, match=r"is_collective=False.*mode='collective'"):
        fleet.init(strategy=fleet.DistributedStrategy(mode="collective"), is_collective=False)


def test_is_collective_false_means_a_parameter_server_job():
    from fleet.api import _honour_is_collective

    chosen = _honour_is_collective(fleet.DistributedStrategy(timeout_s=7), is_collective=False)
    assert (chosen.mode, chosen.update, chosen.timeout_s) == ("ps", "async", 7)
    kept = _honour_is_collective(fleet.DistributedStrategy(mode="ps", update="sync"), is_collective=False)
    assert (kept.mode, kept.update) == ("ps", "sync")


def test_is_collective_false_in_one_process_trains_locally():
    fleet.init(is_collective=False)
    model = torch.nn.Linear(2, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    before = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert torch.allclose(model.weight.detach(), before - 0.1)


def test_a_second_init_must_ask_for_the_same_job():
    fleet.init(strategy=fleet.DistributedStrategy(bucket_mb=5))
    fleet.init()  # nothing asked: the job as it is
    fleet.init(strategy=fleet.DistributedStrategy(bucket_mb=5))  # the same strategy, by value
    with pytest.raises(
        fleet.FleetError,
        match=r"already called with DistributedStrategy\(bucket_mb=5.0\).*asks for DistributedStrategy\(bucket_mb=9.0\)",
    ):
        fleet.init(strategy=fleet.DistributedStrategy(bucket_mb=9))


def test_one_strategy_per_job_once_something_is_wrapped():
    fleet.init()
    model = torch.nn.Linear(2, 1)
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(bucket_mb=5))
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(bucket_mb=5))
    with pytest.raises(fleet.FleetError, match=r"a second strategy .*bucket_mb=9.0.* cannot join it"):
        fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), fleet.DistributedStrategy(bucket_mb=9))


def test_register_strategy_refuses_to_replace_a_name_without_override():
    from fleet import registry
    from fleet.strategies.collective import CollectiveStrategy

    class Mine(CollectiveStrategy):
        pass

    with pytest.raises(ValueError, match=r"'collective' is a built-in strategy.*override=True"):
        fleet.register_strategy("collective", Mine)
    try:
        fleet.register_strategy("mine-once", Mine)
        fleet.register_strategy("mine-once", Mine)  # the same class again: harmless
        with pytest.raises(ValueError, match=r"'mine-once' is already registered \(Mine\)"):
            fleet.register_strategy("mine-once", CollectiveStrategy)
        fleet.register_strategy("mine-once", CollectiveStrategy, override=True)
        assert registry.get("mine-once") is CollectiveStrategy
    finally:
        registry._registered.pop("mine-once", None)


def test_sharding_in_one_process_trains_and_checkpoints(tmp_path):
    """A plain python run of a sharding script: nothing to shard, the same checkpoint format."""
    fleet.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = fleet.distributed_optimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), fleet.DistributedStrategy(mode="sharding")
    )
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    fleet.save_checkpoint(str(tmp_path), model, opt, 1)
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert fleet.load_checkpoint(str(tmp_path), model, opt).step == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters(), strict=True))
    assert opt.state_dict()["state"]  # Adam's moments came back too


def test_slot_dataset_signature_is_frozen():
    assert _shape(fleet.SlotDataset) == (
        "(files, batch_size, *, sparse_slots=26, dense=13, shard=True, chunk_bytes=4194304)"
    )
    assert issubclass(fleet.SlotDataset, torch.utils.data.IterableDataset)


def test_a_lazy_module_not_yet_initialised_is_refused_naming_the_parameter():
    fleet.init()
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2))
    with pytest.raises(fleet.FleetError, match=r"parameter '0.weight' is not initialised yet .*one forward pass"):
        fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.zeros(1, 3))  # initialised: wrapped as any other
    fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    fleet.stop_worker()


def test_hooks_registered_on_the_wrapped_optimizer_run():
    """They were kept in the wrapper's own dicts and never called (an EMA in a step post-hook never moved)."""
    fleet.init()
    model = torch.nn.Linear(2, 1)
    opt = fleet.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("step_pre", o is opt)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("step_post", o is opt)))
    opt.register_state_dict_pre_hook(lambda o: calls.append(("state_dict_pre", o is opt)))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "mine": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load_pre", "mine" in sd)))
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    assert saved["mine"] == 1
    opt.load_state_dict(saved)
    assert calls == [
        ("step_pre", True), ("step_post", True), ("state_dict_pre", True), ("load_pre", True), ("load_post", True)
    ]  # fmt: skip
    fleet.stop_worker()


def test_a_subclass_chain_runs_the_hooks_once_around_the_outermost_call():
    """Each class of the family is made with its own step/state_dict/load_state_dict already hooked (no
    class is rewritten afterwards); calls through super() run the hooks once, around the outermost."""

    class Middle(WrappedOptimizer):
        def step(self, closure=None):
            self.seen.append("middle")
            return super().step(closure)

        def state_dict(self):
            return {**super().state_dict(), "middle": 1}

    middle_step = Middle.__dict__["step"]

    class Outer(Middle):
        def step(self, closure=None):
            self.seen.append("outer")
            return super().step(closure)

    assert Middle.__dict__["step"] is middle_step  # defining a subclass changed nothing of its parent
    param = torch.nn.Parameter(torch.zeros(1))
    opt = Outer(torch.optim.SGD([param], lr=1.0))
    opt.seen = []
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", list(o.seen))))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", list(o.seen))))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "hooked": len(calls)})
    param.grad = torch.ones(1)
    opt.step()
    assert calls == [("pre", []), ("post", ["outer", "middle"])] and param.item() == -1.0
    saved = opt.state_dict()
    assert saved["middle"] == 1 and saved["hooked"] == 2  # the post-hook ran once, on the outermost result
