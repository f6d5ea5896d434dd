"""The gradient synchroniser: one per job, shared by every wrapped optimizer and distributed model.

It gives a job single-process semantics on ordinary training code, without a flag:

- **Registry.** Every parameter of every wrapped optimizer (its ``param_groups``, read live,
  so ``add_param_group`` counts) and of every model given to ``distributed_model``, once,
  in registration order. Every worker registers the same things in the same order.
- **Layout.** The registered parameters that require a gradient now, in buckets. It is
  rebuilt when that set changes (freezing, unfreezing, ``add_param_group``, an embedding
  switched to ``sparse=True``), checked at ``zero_grad`` and at the start of every round,
  so a change takes effect at the next backward on every worker. Each round's header
  (:mod:`fleet.collective.lockstep`) carries the layout's fingerprint: a worker that froze
  a layer the others did not fails at once, naming the parameter and the workers.
- **Round.** A backward that accumulates a gradient into any layout parameter starts a round
  from the first post-accumulate-grad hook: the header is sent, and the parameters
  whose gradient accumulator the autograd engine will not run in this backward (unused this
  step: a branch not taken, a frozen layer) are marked ready at once, so the buckets launch,
  strictly in index order, as backward produces the rest. The others' headers are waited for
  (and checked) only when the first bucket is ready, at the end of backward, or before any
  other exchange this worker starts, whichever comes first: the round trip overlaps backward
  (through gloo it cost about 2 ms of W1's step), and no bucket leaves before the agreement. Where launching
  early gains nothing (buckets summed through shared memory on the training thread: ``Transport.launch_early``),
  every bucket launches at the end of backward instead, so the agreement is not waited for mid-backward: one
  meeting with the peers per round less. At the end of backward the
  buckets are waited for and written back (see :mod:`fleet.collective.buckets`): a
  parameter that got a gradient on no worker keeps ``.grad`` as it was (``None`` stays
  ``None``); one that got a gradient on some workers gets the average over the workers
  still training, absent counting as zero (DDP's semantics).
- **Sparse gradients** (``nn.Embedding``/``EmbeddingBag`` with ``sparse=True``) are
  all-reduced as sparse tensors (gloo gathers and sums indices and values) after a small
  all-reduce of which ones changed anywhere.
- **Catch-up.** A worker whose backward produced no gradient at all (its loss touched no
  parameter) runs the round at ``optimizer.step()`` instead, so its peers' round still
  pairs with one.
- **Gradients set by hand** (``p.grad = g``, e.g. from ``torch.autograd.grad``) are this
  worker's gradients: a round counts every gradient set or written since the last round as
  new, and ``optimizer.step()`` runs one more round when a gradient was replaced after the
  last one (in-place changes of averaged gradients, such as ``clip_grad_norm_``, are not).

Every collective a round issues depends only on the agreed layout, never on which
parameters this worker happened to use, so collectives cannot pair wrongly by construction.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from fleet.collective import buckets as bucketing
from fleet.collective import disagreement, lockstep, sparse_grads
from fleet.collective.broadcast import all_gather_json
from fleet.collective.layout import Layout, ParamMap
from fleet.collective.shm import PeerGone
from fleet.collective.transports.base import Transport
from fleet.errors import FleetError, PeerError
from fleet.telemetry import timing
from fleet.training.owners import find_owners, is_sparse_embedding_weight

_UNKNOWN = object()  # a parameter whose owner was never looked for
_NO_GRAD = (lambda: None, -1)  # how _idle remembers a parameter without a gradient


class GradSync:
    """Averages gradients over ``group`` (None: one worker, rounds only scale for accumulation).

    ``hooked``: False in local-SGD mode, or for one worker without accumulation: the registry
    only, no gradient rounds. The strategy steers it with :meth:`arm` (accumulation windows),
    :meth:`pause`/:meth:`resume` (``no_sync()``), :meth:`count_step` and :meth:`close`.
    """

    def __init__(
        self,
        group: Any,
        *,
        bucket_bytes: int,
        transport: Transport,
        timeout_s: float,
        diagnose: Callable[[], str | None] | None = None,
        accumulation: int = 1,
        hooked: bool = True,
        silent_peers: Callable[[], list[int] | None] | None = None,
    ):
        self.group = group
        channel = transport.header_channel()
        self.lockstep = (
            lockstep.Lockstep(group, timeout_s, diagnose, channel, silent_peers) if group is not None else None
        )
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self.timeout = timedelta(seconds=timeout_s)
        self.diagnose = diagnose
        self.accumulation = accumulation
        self._armed = True  # False between the micro-batches of an accumulation window
        self._paused = 0  # inside no_sync() (nested): backward accumulates locally, as between micro-batches
        self._backwards = 0
        self._counting = False  # a backward pass produced a gradient and has not ended yet
        self._held = False  # require_backward_grad_sync was False at the last forward: the same, DDP's other idiom
        self._hooked = hooked
        self._rounds = 0
        self._comm_wait_s = 0.0
        # Weakly held: an optimizer or model the script dropped stops training with the others.
        self._sources: list[weakref.ref] = []
        self._owners = ParamMap()  # param -> Owner (name, module)
        self._hooks = ParamMap()  # param -> hook handle
        self._layout: Layout | None = None
        self._changed: set[int] = set()  # parameters with a new gradient since the last round
        self._early: set[int] = set()  # this round: judged unused at its start
        self._idle: dict[int, tuple[Any, int]] = {}  # every registered parameter's gradient at the last round's end
        self._in_round = False
        self._header: lockstep.InFlight | None = None  # this round's header, started and not yet waited for
        self._next = 0
        self._pending: list[int] = []  # this round, per bucket: gradients backward has still to produce
        self._works: list[Any] = []  # this round, per bucket: the transport's work in flight
        self._early_launch = True  # this round: buckets launch as backward produces them (Transport.launch_early)
        self._scale = 1.0
        self._verified = ParamMap()  # parameters whose values are known to be worker 0's everywhere

    # --- what the strategy steers ---------------------------------------------------------

    @property
    def hooked(self) -> bool:
        """Whether backward runs gradient rounds (False in local-SGD mode, and after :meth:`close`)."""
        return self._hooked

    @property
    def rounds(self) -> int:
        """Gradient rounds run so far (catch-up rounds included)."""
        return self._rounds

    @property
    def comm_wait_s(self) -> float:
        """Seconds waited for gradient all-reduces since :meth:`take_comm_wait` last took them."""
        return self._comm_wait_s

    def arm(self, reduce: bool) -> None:
        """Whether the next backward averages (False on the micro-batches before an accumulation window's last)."""
        self._armed = reduce

    def pause(self) -> None:
        """Enter ``no_sync()`` (nests): backward accumulates locally until the matching :meth:`resume`."""
        self._paused += 1

    def resume(self) -> None:
        self._paused -= 1

    def hold(self, held: bool) -> None:
        """DDP's ``require_backward_grad_sync`` (False: ``held``), set at each forward: whether the next backward
        accumulates locally, as inside ``no_sync()``."""
        self._held = held

    def count_step(self) -> None:
        """An optimizer step was taken: the lockstep's headers carry the count."""
        if self.lockstep is not None:
            self.lockstep.count_step()

    def close(self) -> None:
        """Unhook from the parameters and stop the transport (fleet.stop_worker())."""
        self.remove()
        self.transport.close()

    # --- registry and layout ------------------------------------------------------------

    def register(self, source: torch.optim.Optimizer | nn.Module) -> None:
        """Add an optimizer's or a model's parameters (already made identical on every worker)."""
        if not any(s is source for s in self.sources):
            self._sources.append(weakref.ref(source))
        self.verified(self.registered())
        self.refresh()

    @property
    def sources(self) -> list[torch.optim.Optimizer | nn.Module]:
        return [s for s in (ref() for ref in self._sources) if s is not None]

    def verified(self, params: list[torch.Tensor]) -> None:
        """These parameters hold the same values on every worker (broadcast from worker 0)."""
        for p in params:
            self._verified.set(p, True)

    def registered(self) -> list[torch.Tensor]:
        seen: set[int] = set()
        out = []
        for source in self.sources:
            params = (
                source.parameters()
                if isinstance(source, nn.Module)
                else (p for group in source.param_groups for p in group["params"])
            )
            for p in params:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def refresh(self) -> Layout:
        """The layout for the parameters as they are now; rebuilt (and hooked) if they changed."""
        return self._refresh(self.registered())

    def _refresh(self, registered: list[torch.Tensor]) -> Layout:
        owners = self._owners.get_all(registered, _UNKNOWN)
        new = [p for p, owner in zip(registered, owners, strict=True) if owner is _UNKNOWN]
        if new:  # a gc scan, only when parameters were added
            found = find_owners(new)
            for p in new:
                self._owners.set(p, found[id(p)])
            owners = self._owners.get_all(registered)
        sparse_flags = [is_sparse_embedding_weight(owner) for owner in owners]
        signature = tuple(zip(map(id, registered), [p.requires_grad for p in registered], sparse_flags, strict=True))
        if self._layout is not None and self._layout.signature == signature:
            return self._layout
        sparse = {id(p) for p, flag in zip(registered, sparse_flags, strict=True) if flag}
        layout = Layout(registered, signature, sparse, self.bucket_bytes)
        if self._hooked:
            for p in layout.dense + layout.sparse:
                if p not in self._hooks:
                    self._hooks.set(p, p.register_post_accumulate_grad_hook(self._on_grad_ready))
                    if self._grad_changed_while_idle(p):
                        # Newly trainable: backward may have accumulated into it before the hook existed
                        # (unfrozen just before this backward), so look at the gradient itself.
                        self._changed.add(id(p))
        self._layout = layout
        return layout

    def _grad_changed_while_idle(self, p: torch.Tensor) -> bool:
        grad = p.grad
        if grad is None:
            return False
        seen = self._idle.get(id(p))
        return seen is None or seen[0]() is not grad or seen[1] != grad._version

    def _remember_idle(self, layout: Layout) -> None:
        # The round's layout as well as the registered parameters: an optimizer the script dropped may have
        # been collected during the round (on this worker only), leaving its parameters in the layout with
        # their old gradients -- remembered here, they are not taken for gradients set by hand at step().
        idle: dict[int, tuple[Any, int]] = {}
        for p in (*self.registered(), *layout.dense, *layout.sparse):
            if id(p) not in idle:  # the layout's parameters are registered too, as a rule
                grad = p.grad
                idle[id(p)] = _NO_GRAD if grad is None else (weakref.ref(grad), grad._version)
        self._idle = idle

    def _set_by_hand(self, layout: Layout) -> set[int]:
        """Layout parameters whose gradient was set or written since the last round without a backward
        accumulating into them (``p.grad = g`` from torch.autograd.grad): new gradients of this worker."""
        return {
            id(p)
            for p in layout.dense + layout.sparse
            if id(p) not in self._changed and self._grad_changed_while_idle(p)
        }

    def remove(self) -> None:
        """Unhook from the parameters (after stop_worker their backward no longer talks to the group)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks = ParamMap()
        self._hooked = False

    # --- a round during backward --------------------------------------------------------

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._hooked:
            return
        pid = id(param)
        if self._in_round and pid in self._early:
            raise FleetError(
                f"parameter {self._name(param)!r} got its gradient after fleet had judged it unused in this "
                "backward pass: its gradient came from a nested backward (reentrant activation checkpointing). "
                "Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        self._changed.add(pid)
        if not self._counting:  # the first gradient of this backward pass
            self._counting = True
            torch.autograd.Variable._execution_engine.queue_callback(self._count_backward)
        if not self._armed or self._paused or self._held or (self.lockstep is not None and self.lockstep.joined):
            return
        if not self._in_round:
            self._begin(in_backward=True)
        bucket = self._layout.where.get(pid)  # type: ignore[union-attr]
        if bucket is not None:
            self._pending[bucket.index] -= 1
            if self._early_launch:
                self._launch_ready()

    def _count_backward(self) -> None:
        self._counting = False
        self._backwards += 1

    @property
    def backwards(self) -> int:
        """Backward passes that produced a gradient of a registered parameter (reduced or not)."""
        return self._backwards

    def _begin(self, in_backward: bool) -> bool:
        """Start a round: agree on the layout, judge which parameters stay unused; False if nothing to do.

        In backward the agreement is only started here: the header travels while backward
        computes, and :meth:`_settle` waits for it and acts on it before the first bucket
        launches (or at the end of backward), so every collective of the round still follows
        the agreed layout.
        """
        self._in_round = True
        try:
            registered = self.registered()
            layout = self._refresh(registered)
            self._changed |= self._set_by_hand(layout)
            if self.lockstep is not None and in_backward:
                header = (len(self._changed), self._unverified(registered))  # b > 0: this worker has a gradient
                self._header = self.lockstep.start(lockstep.ROUND, layout.fingerprint, *header, settle=self._settle)
            elif not self._agree(layout, None):
                self._in_round = False
                return False  # a catch-up round where no worker has any gradient: nothing to send
        except BaseException:
            self._in_round = False
            raise
        layout = self._layout  # type: ignore[assignment]  # _agree may have rebuilt it
        self._early = set()
        self._pending = [0] * len(layout.buckets)
        self._works = [None] * len(layout.buckets)
        if in_backward:
            will_execute = torch._C._will_engine_execute_node
            for pid, node, index in layout.accumulators:
                if will_execute(node):
                    self._pending[index] += 1
                else:
                    self._early.add(pid)
        else:
            self._early.update(map(id, layout.dense))
        self._next = 0
        # Asked once per round: a transport whose buckets fell back to the process group changes its answer.
        self._early_launch = self.transport.launch_early()
        if in_backward:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if not self._early_launch:
                return True  # every bucket launches at the end of backward (_finish), after the agreement
        self._launch_ready()
        return True

    def _unverified(self, registered: list[torch.Tensor] | None = None) -> int:
        """How many registered parameters (``registered``: as just listed) were never broadcast."""
        verified = self._verified.get_all(self.registered() if registered is None else registered, False)
        return len(verified) - sum(verified)

    def _agree(self, layout: Layout, header: lockstep.InFlight | None) -> bool:
        """Agree on this round (see :mod:`fleet.collective.lockstep`), from the header ``header`` started, or
        exchanged now; the layouts must agree. Then bind the buckets and set the scale; False if no worker
        has a gradient. The layout the round runs on is ``self._layout`` afterwards."""
        lock = self.lockstep
        if lock is None:
            active = 1
        else:
            unverified = self._unverified() if header is None else None  # the header carries it
            if header is None:
                agreement = lock.exchange(lockstep.ROUND, layout.fingerprint, len(self._changed), unverified)
            else:
                agreement = lock.collect(header)
            if agreement.fingerprints_differ():
                # An optimizer the script dropped may be awaiting the garbage collector on some workers only
                # (a reference cycle, e.g. through an LR scheduler): collect everywhere, then compare again.
                if unverified is None:
                    unverified = self._unverified()
                gc.collect()
                layout = self.refresh()
                agreement = lock.exchange(lockstep.ROUND, layout.fingerprint, len(self._changed), unverified)
            lock.check(agreement, lockstep.ROUND, layout.fingerprint, self.explain_layout)
            active = len(agreement.active)
            if any(h.c for h in agreement.headers):
                self._check_added_values()
            if not any(h.b for h in agreement.headers if h.kind == lockstep.ROUND):
                return False
        self.transport.bind(layout.buckets)  # collective the first time: after the workers agreed
        self._scale = 1.0 / (active * self.accumulation)
        return True

    def _settle(self) -> None:
        """Wait for the header this backward's round started, and act on the agreement: before the round's
        first bucket launches, at the end of backward, or before any other exchange of this worker."""
        header, self._header = self._header, None
        if header is None:
            return
        started = self._layout
        try:
            agreed = self._agree(started, header)  # type: ignore[arg-type]
        except BaseException:
            self._in_round = False
            raise
        assert agreed, "this worker has a gradient in this round"
        layout = self._layout
        if layout is not started:
            # The layout changed after a garbage collection (see _agree) while backward ran: what it already
            # produced counted for the old buckets. Hold every bucket until the end of backward, which launches
            # them all with every gradient in place (no overlap, this one round).
            self._pending = [sys.maxsize] * len(layout.buckets)  # type: ignore[union-attr]
            self._works = [None] * len(layout.buckets)  # type: ignore[union-attr]

    def _launch_ready(self) -> None:
        buckets = self._layout.buckets  # type: ignore[union-attr]
        if self._header is not None and self._next < len(buckets) and self._pending[self._next] <= 0:
            self._settle()
            buckets = self._layout.buckets  # type: ignore[union-attr]
        while self._next < len(buckets) and self._pending[self._next] <= 0:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, bucket: bucketing.Bucket) -> None:
        self._works[bucket.index] = self.transport.launch(bucket, self._scale, self._changed)

    def _finish(self, in_backward: bool = True) -> None:
        """End of the round: launch what is left, exchange sparse gradients, wait, write back.

        At the end of a backward it is also a timing boundary, for scripts that never call ``step()``.
        """
        if self._header is not None:
            self._settle()  # no bucket was ready before the end of backward
        layout = self._layout
        assert layout is not None
        self._in_round = False
        try:
            while self._next < len(layout.buckets):
                self._launch(layout.buckets[self._next])
                self._next += 1
            sparse = self._start_sparse(layout)
            started = time.perf_counter()
            for bucket in layout.buckets:
                work, self._works[bucket.index] = self._works[bucket.index], None
                if work is not None:
                    self._wait_bucket(bucket, work, f"all-reduce of gradient bucket {bucket.index}")
                bucket.scatter()
            for param, reduced, work in sparse:
                if work is not None:
                    self._wait(work, f"all-reduce of the sparse gradient of {self._name(param)!r}")
                param.grad = reduced
            waited = time.perf_counter() - started
            if self.lockstep is not None:
                waited += self.lockstep.take_waited()  # the round's agreement, and fleet's exchanges before it
            self._comm_wait_s += waited
            if self.group is not None:  # one gradient reduction, whatever its buckets: what the report counts
                dense = sum(b.numel * b.flat.element_size() for b in layout.buckets if b.flat is not None)
                timing.recorder().add_reduction(dense + sum(r.element_size() * r._nnz() for _, r, _ in sparse))
            if in_backward:
                timing.recorder().end_backward(waited)
        finally:
            self._changed = set()
            self._early = set()
            self._rounds += 1
            self._remember_idle(layout)

    def take_comm_wait(self) -> float:
        """Seconds spent waiting for the gradient all-reduces since the last call."""
        waited, self._comm_wait_s = self._comm_wait_s, 0.0
        if self.lockstep is not None:
            waited += self.lockstep.take_waited()
        return waited

    def replaced_by_hand(self) -> bool:
        """Whether a gradient was replaced (``p.grad = g``) since the last round: it must be averaged before
        the step even though a backward ran (in-place changes of the averaged gradients, such as
        clip_grad_norm_, are single-process changes of the average and are not sent again)."""
        layout = self._layout
        if layout is None:
            return False
        for p in layout.dense + layout.sparse:
            grad = p.grad
            if grad is not None:
                seen = self._idle.get(id(p))
                if seen is None or seen[0]() is not grad:
                    return True
        return False

    def catch_up(self) -> None:
        """At optimizer.step(): run this round now if no backward started one since the last step."""
        if self._begin(in_backward=False):
            self._finish(in_backward=False)
        else:
            self._changed = set()
            self._rounds += 1

    def shadow_round(self, agreement: lockstep.Agreement) -> None:
        """Inside fleet.join() with the loop finished: take part in the others' round, adding nothing.

        Issues exactly the collectives a training worker's round issues, in the same order:
        every bucket, then the sparse flags and the sparse gradients that changed anywhere.
        """
        if not any(h.b for h in agreement.headers if h.kind == lockstep.ROUND):
            return
        layout = self.refresh()
        self.transport.bind(layout.buckets)
        works = [(bucket, self.transport.start_empty(bucket)) for bucket in layout.buckets]
        sparse_works = sparse_grads.start(layout.sparse, [False] * len(layout.sparse), 1.0, self.group, self._wait)
        for bucket, work in works:
            self._wait_bucket(bucket, work, "a gradient all-reduce shadowed inside fleet.join()")
        for _, _, work in sparse_works:
            self._wait(work, "a sparse gradient all-reduce shadowed inside fleet.join()")

    # --- sparse gradients ---------------------------------------------------------------

    def _start_sparse(self, layout: Layout) -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
        changed = [id(p) in self._changed for p in layout.sparse]
        return sparse_grads.start(layout.sparse, changed, self._scale, self.group, self._wait)

    def _check_added_values(self) -> None:
        """Parameters added on the unwrapped optimizer were never broadcast: they must already agree."""
        registered = self.registered()
        disagreement.check_same_values(registered, self._name, self.group, self._wait)
        self.verified(registered)

    # --- helpers ------------------------------------------------------------------------

    def _wait_bucket(self, bucket: bucketing.Bucket, work: Any, what: str) -> None:
        self._wait(lambda: self.transport.wait(bucket, work, self.timeout), what)

    def _wait(self, work: Any, what: str) -> None:
        """``work.wait`` (or ``work()``); a failure becomes a PeerError naming the peer at fault."""
        try:
            work() if callable(work) else work.wait(self.timeout)
        except RuntimeError as error:
            if isinstance(error, PeerGone):
                raise PeerError.from_collective(what, error, plain=True) from None
            diagnosis = self.diagnose() if self.diagnose is not None else None
            raise PeerError.from_collective(what, error, diagnosis) from None

    def _name(self, param: torch.Tensor) -> str:
        owner = self._owners.get(param)
        return owner.name if owner is not None else "a parameter"

    def explain_layout(self, agreement: lockstep.Agreement) -> str:
        """Every worker's parameters, gathered only now that they disagree, compared with the first's."""
        registered = self.registered()
        sparse = {id(p) for p in registered if is_sparse_embedding_weight(self._owners.get(p))}
        mine = [[self._name(p), list(p.shape), bool(p.requires_grad), id(p) in sparse] for p in registered]
        everyone = all_gather_json(mine, self.group)
        return disagreement.explain(everyone)
