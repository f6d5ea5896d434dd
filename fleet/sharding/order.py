"""Every worker runs the same sharded modules in the same order: checked before FSDP2's collectives.

FSDP2 gathers a module's parameters at the start of its forward and reduce-scatters its
gradients in backward, and gloo and NCCL pair those collectives by the order workers issue
them. A module that only some workers run in a step (a branch taken on some batches, an
auxiliary loss on some workers, one of two models trained by some workers only) made the
others' gathers pair with the wrong collective: a wait until the timeout ending in gloo's
"Connection closed by peer", or, between two modules of the same size, parameters silently
mixed. So every worker announces, through fleet's lockstep (one all-gather of a few integers):

- each sharded module's forward, before FSDP2 gathers its parameters;
- the first backward (or ``torch.autograd.grad``) after a sharded forward;
- each reduce-scatter of a module's gradients, with which of its parameters have one;
- each optimizer step, with which parameters carry a gradient set by hand;
- fleet's own collectives in between: a ``fleet.metrics`` all-reduce, ``fleet.barrier_worker()``.

A worker about to do something else is named at once, with the module, on every worker. Within
a module every worker ran, a parameter that only some workers used (a branch inside the
module) gets a zero gradient on the others before the reduce-scatter, so the average counts
them as zero, as one process's gradient of the mean loss does; a parameter nobody used keeps
``.grad is None``.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fleet.collective import lockstep
from fleet.collective.shm import LocalHost
from fleet.errors import PeerError
from fleet.sharding import autograd
from fleet.sharding.comm_timing import CommClock
from fleet.telemetry import timing

ADVICE = (
    "mode='sharding' (FSDP2) gathers a module's parameters and reduces its gradients on every worker together, "
    "so every worker must run the same sharded modules in the same order in every step, and use their outputs "
    "in backward alike. A module used by only some workers (a branch taken on some batches, a loss term on some "
    "workers, a model trained by some workers only) cannot be sharded: run it on every worker (multiplying its "
    "output by zero where it is not wanted gives the same gradients), or use mode='collective', which handles it."
)


class ShardedOrder:
    """Announces each sharded module's forward and reduce-scatter, and each backward after a forward."""

    def __init__(
        self,
        group: Any,
        timeout_s: float,
        diagnose: Callable[[], str | None] | None = None,
        shared_memory: bool = True,
        clock: CommClock | None = None,
        entry_points: autograd.EntryPoints | None = None,
    ):
        self.group = group
        self.clock = clock if clock is not None else CommClock()  # FSDP2's collectives and the waits here
        # Workers on one host exchange the announcements through shared memory: no gloo round trip
        # (a few microseconds instead of about a millisecond each, some thirty per step).
        self.host = LocalHost.connect(group, timeout_s) if shared_memory else None  # also FSDP2's collectives'
        channel = self.host.lockstep if self.host is not None else None
        self.lockstep = lockstep.Lockstep(group, timeout_s, diagnose, channel)
        self.names: list[str] = []  # a watched module's index (the same on every worker) -> its name
        self.roots: list[str] = []  # the models sharded, described, in the order they were
        self._ran_forward = False  # a sharded module ran forward since the last backward announced
        self._in_backward = False  # a backward through sharded modules is running
        # torch.autograd's entry points, held by the strategy (or by this object when none is given)
        self._entry_points = entry_points if entry_points is not None else autograd.EntryPoints()
        self._own_entry_points = entry_points is None
        self._entry_points.before_backward(self.before_backward)
        self._entry_points.after_backward(self.after_backward)

    def watch(self, modules: list[tuple[str, torch.nn.Module]]) -> None:
        """Announce the forward and the reduce-scatter of each of ``modules`` (already given to fully_shard)."""
        for name, module in modules:
            index = len(self.names)
            self.names.append(name)
            module.register_forward_pre_hook(_ForwardHook(self, index), prepend=True)  # before FSDP2's gather
            for param_group in module._get_fsdp_state()._fsdp_param_groups:
                if not isinstance(param_group.post_backward, _ReduceHook):  # modules sharded as one group share it
                    param_group.post_backward = _ReduceHook(self, index, param_group.post_backward)

    def before_forward(self, index: int) -> None:
        self.before_collective(lockstep.SHARD_FORWARD, index)
        self._ran_forward = True

    def before_backward(self, how: int) -> None:
        # Only after a sharded forward: a backward through other tensors (worker 0 alone computing
        # something) issues no FSDP2 collective, so it needs no agreement either.
        if self._ran_forward:
            self._ran_forward = False
            self.before_collective(lockstep.SHARD_BACKWARD, how)
            self.lockstep.count_step()
            self._in_backward = how == autograd.BACKWARD

    def after_backward(self) -> None:
        """A backward through sharded modules ended: a boundary for jobs timed per backward (no ``step()``)."""
        scattered = self.clock.take_scattered()
        if scattered:  # this backward's reduce-scatters: one gradient reduction in the report
            timing.recorder().add_reduction(scattered)
        if self._in_backward:
            self._in_backward = False
            timing.recorder().end_backward(self.take_comm(per_step=False))

    def take_comm(self, per_step: bool = True) -> float:
        """Seconds communicating since the last step (or backward): FSDP2's collectives and the waits here."""
        self.clock.add(self.lockstep.take_waited())
        return self.clock.take_step() if per_step else self.clock.take_backward()

    def before_reduce(self, index: int, param_group: Any) -> None:
        """Agree on which parameters of the module have a gradient; zeros for those only others have."""
        if not param_group.reduce_grads:
            return  # no_sync(): FSDP2 only accumulates, on every worker alike
        params = [p for p in param_group.fsdp_params if hasattr(p, "_unsharded_param")]
        has = [p.unsharded_accumulated_grad is not None or p.unsharded_param.grad is not None for p in params]
        differing = self._agree_on_flags(lockstep.SHARD_REDUCE, index, has)
        if differing is None:
            return
        anyone, _ = differing
        for p, mine, someone in zip(params, has, anyone, strict=True):
            if someone and not mine:
                p.unsharded_param.grad = torch.zeros(
                    p.unsharded_param.shape, dtype=p.unsharded_param.dtype, device=p.unsharded_param.device
                )

    def before_step(self, whole: list[bool]) -> int | None:
        """Announce an optimizer step and which parameters carry a whole gradient set by hand.

        Returns None when every worker says the same, else the index of the first parameter
        whose flag differs.
        """
        differing = self._agree_on_flags(lockstep.SHARD_STEP, 0, whole)
        if differing is None:
            return None
        anyone, everyone = differing
        return next(i for i, (some, every) in enumerate(zip(anyone, everyone, strict=True)) if some != every)

    def before_collective(self, kind: int, a: int = 0, b: int = 0) -> None:
        """Announce the next collective (FSDP2's, or fleet's own: a metric's all-reduce, a barrier)."""
        agreement = self.lockstep.exchange(kind, a, b)
        if any((h.kind, h.a, h.b) != (kind, a, b) for h in agreement.headers):
            raise PeerError(self._mismatch(agreement))

    def _agree_on_flags(self, kind: int, a: int, flags: list[bool]) -> tuple[list[int], list[int]] | None:
        """Announce ``kind``/``a`` with a fingerprint of ``flags``: None when every worker holds the same
        flags, else whether any and whether every worker set each one (one more all-reduce, on every
        worker alike: the max of the flags and the max of their negation)."""
        which = _fingerprint(flags)
        agreement = self.lockstep.exchange(kind, a, which)
        if any((h.kind, h.a) != (kind, a) for h in agreement.headers):
            raise PeerError(self._mismatch(agreement))
        if all(h.b == which for h in agreement.headers):
            return None
        mine = torch.tensor(flags, dtype=torch.int32)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return both[: len(flags)].tolist(), (-both[len(flags) :]).tolist()

    def close(self) -> None:
        self._entry_points.forget(self.before_backward)
        self._entry_points.forget(self.after_backward)
        if self._own_entry_points:
            self._entry_points.close()

    def _mismatch(self, agreement: lockstep.Agreement) -> str:
        groups: dict[str, list[int]] = {}
        for h in agreement.headers:
            groups.setdefault(self._doing(h), []).append(h.rank)
        parts = [f"{lockstep.workers(ranks)} about to {doing}" for doing, ranks in groups.items()]
        passes = "/".join(sorted({str(h.steps) for h in agreement.headers}))
        return (
            f"Workers ran different sharded modules (after {passes} backward pass(es) with sharded modules): "
            f"{'; '.join(parts)}. {ADVICE}"
        )

    def _doing(self, header: lockstep.Header) -> str:
        name = self.names[header.a] if 0 <= header.a < len(self.names) else f"#{header.a}"
        if header.kind == lockstep.SHARD_FORWARD:
            return f"run the forward of sharded module {name!r}"
        if header.kind == lockstep.SHARD_REDUCE:
            return f"reduce-scatter the gradients of sharded module {name!r}"
        if header.kind == lockstep.SHARD_BACKWARD:
            return "run torch.autograd.grad" if header.a == autograd.AUTOGRAD_GRAD else "run backward"
        return header.says()


def _fingerprint(flags: list[bool]) -> int:
    """62 bits: fits a header field."""
    return int.from_bytes(hashlib.blake2b(bytes(flags), digest_size=8).digest(), "little") >> 2


class _ForwardHook:
    """A forward pre-hook holding its order weakly: a model outliving its strategy stops announcing."""

    def __init__(self, order: ShardedOrder, index: int):
        self.order = weakref.ref(order)
        self.index = index

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        order = self.order()
        if order is not None:
            order.before_forward(self.index)


class _ReduceHook:
    """In place of an FSDP2 parameter group's ``post_backward``: agree first, then reduce-scatter."""

    def __init__(self, order: ShardedOrder, index: int, post_backward: Callable[..., Any]):
        self.order = weakref.ref(order)
        self.index = index
        self.post_backward = post_backward

    def __call__(self, *args: Any) -> Any:
        order = self.order()
        if order is not None:
            order.before_reduce(self.index, self.post_backward.__self__)
        return self.post_backward(*args)
