"""Gradient buckets and the synchroniser's bookkeeping, in one process (no process group)."""

from __future__ import annotations

import torch

from fleet.collective import buckets
from fleet.collective.grad_sync import GradSync
from fleet.collective.transports.compression import make_compressor
from fleet.collective.transports.process_group import ProcessGroupTransport


def _params(*sizes: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


def _bucket(params: list[torch.Tensor]) -> buckets.Bucket:
    bucket = buckets.Bucket(0, params)
    bucket.attach(torch.zeros(bucket.numel))
    return bucket


def test_buckets_follow_backward_order_start_small_and_split_by_dtype():
    first_kb = buckets.FIRST_BUCKET_BYTES // 4
    params = _params(5, dtype=torch.float64) + _params(10, first_kb, 30)
    built = buckets.build(params, bucket_bytes=1 << 30)
    # reverse order; the first bucket closes at 1 MB, later ones at bucket_bytes or a dtype change
    assert [[p.numel() for p in b.params] for b in built] == [[30, first_kb], [10], [5]]
    assert built[1].numel == 10 + 1  # the values, then one flag per parameter


def test_a_parameter_nobody_changed_keeps_its_gradient_exactly():
    kept, new, absent = _params(3, 2, 4)
    bucket = _bucket([kept, new, absent])
    kept.grad = torch.tensor([1.0, 2.0, 3.0])
    new.grad = torch.tensor([4.0, 5.0])
    bucket.gather(0.5, changed={id(new)})
    assert bucket.send[:9].tolist() == [0.5, 1.0, 1.5, 2.0, 2.5, 0, 0, 0, 0]
    assert bucket.flags.tolist() == [0.0, 1.0, 0.0]
    bucket.scatter()  # as after a sum in which no other worker changed anything
    assert kept.grad.tolist() == [1.0, 2.0, 3.0] and absent.grad is None
    assert new.grad.data_ptr() == bucket.values[3:5].data_ptr()  # points into the reduced buffer


def test_a_gradient_living_in_the_bucket_is_kept_aside_before_the_buffer_is_overwritten():
    (param,) = _params(3)
    bucket = _bucket([param])
    bucket.values.copy_(torch.tensor([1.0, 2.0, 3.0]))
    param.grad = bucket.values.view_as(param)  # as after a previous round
    bucket.gather(1.0, changed=set())  # nobody has a new gradient for it this round
    bucket.values.fill_(9.0)  # the reduction writes the buffer (its flag stays 0: nobody changed it)
    bucket.scatter()
    assert param.grad.tolist() == [1.0, 2.0, 3.0]


def test_a_kept_range_is_not_copied_and_is_summed_from_the_gradient_itself():
    a, b = _params(4, 4)
    bucket = buckets.Bucket(0, [a, b])
    bucket.attach(torch.zeros(bucket.numel), send=torch.full((bucket.numel,), -1.0))
    a.grad, b.grad = torch.arange(4.0), torch.arange(4.0, 8.0)
    sources = bucket.gather(0.5, changed={id(a), id(b)}, keep=(2, 6))
    assert bucket.send[:8].tolist() == [0.0, 0.5, -1, -1, -1, -1, 3.0, 3.5]  # [2, 6) left to the owner
    pieces = bucket.own(sources, 2, 9, 0.5)
    assert [(lo, hi, factor) for lo, hi, _, factor in pieces] == [(2, 4, 0.5), (4, 8, 0.5), (8, 9, 1.0)]
    assert pieces[0][2].tolist() == [2.0, 3.0] and pieces[1][2].tolist()[:2] == [4.0, 5.0]
    assert pieces[2][2].data_ptr() == bucket.send[8:9].data_ptr()  # the flags travel in the send buffer


def test_accumulated_micro_batches_are_averaged_in_one_process():
    model = torch.nn.Linear(3, 1)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 3)
    sync = GradSync(
        None,
        bucket_bytes=1 << 20,
        transport=ProcessGroupTransport(None, make_compressor("none")),
        timeout_s=5,
        accumulation=2,
    )
    sync.register(model)
    for micro, half in enumerate((x[:4], x[4:])):
        sync.arm(micro == 1)  # the window's last micro-batch starts the round
        model(half).sum().backward()
    (reference(x).sum() / 2).backward()  # the mean over the two micro-batches
    assert torch.allclose(model.weight.grad, reference.weight.grad)
    assert sync.rounds == 1


def test_a_chunk_sums_a_gradient_that_lives_in_its_own_result_buffer_with_three_workers():
    """zero_grad(set_to_none=False), or a second backward before step: the gradient is last round's
    result buffer, where the other workers' sum is written. It was read after that write (3 workers:
    1.5 + 1/3 of 1.5 instead of 1.5 + 1/3 of the gradient; 2 workers read it first by chance)."""
    from fleet.collective.transports.shared_memory import _Segment, _sum_chunk

    for world in (2, 3, 4):
        sends = [torch.full((4,), float(k + 1)) / world for k in range(world)]
        results = [torch.zeros(4) for _ in range(world)]
        gradient = results[0][:3]  # worker 0's gradient lives in its own result buffer
        gradient.copy_(torch.tensor([6.0, 7.0, 8.0]))
        _sum_chunk(_Segment(sends, results), 0, 0, 4, [(0, 3, gradient, 1.0 / world), (3, 4, sends[0][3:], 1.0)])
        others = sum(range(2, world + 1)) / world
        want = [others + 6.0 / world, others + 7.0 / world, others + 8.0 / world, others + 1.0 / world]
        for k in range(world):
            assert torch.allclose(results[k], torch.tensor(want)), (world, k, results[k].tolist())


def test_a_small_bucket_gathered_whole_sends_exactly_what_a_gradient_at_a_time_sends(monkeypatch):
    # A small bucket is copied in one call and scaled in one pass; a large one gradient by gradient.
    generator = torch.Generator().manual_seed(0)
    sizes = (3, 7, 0, 1, 12, 5)  # an empty parameter without a gradient (a sharded table's placeholder)
    for keep in [(0, 0), (2, 6), (0, 28), (9, 31), (4, 5), (28, 34)]:
        sent = []
        for small in (True, False):
            monkeypatch.setattr(buckets, "SMALL_BUCKET_BYTES", 1 << 20 if small else 0)
            params = _params(*sizes)
            bucket = buckets.Bucket(0, params)
            bucket.attach(torch.zeros(bucket.numel), send=torch.full((bucket.numel,), -1.0))
            assert bucket._small is small
            for p in params:
                if p.numel():
                    p.grad = torch.randn(p.numel() * 2, generator=generator)[::2]  # not contiguous
            sources = bucket.gather(1 / 3, changed={id(p) for p in params[1:]}, keep=keep)
            sent.append((bucket.send.clone(), [s if s is None else s.clone() for s in sources]))
            generator.manual_seed(0)
        assert torch.equal(sent[0][0], sent[1][0]), keep
        assert [s is None for s in sent[0][1]] == [s is None for s in sent[1][1]]
        assert all(a is None or torch.equal(a, b) for a, b in zip(sent[0][1], sent[1][1], strict=True))


class _LateTransport(ProcessGroupTransport):
    """The process group's transport (one worker), recording when each bucket launches; launching early gains
    nothing here (as for shared-memory buckets summed on the training thread)."""

    def __init__(self, early: bool):
        super().__init__(None, make_compressor("none"))
        self.early = early
        self.events: list[str] = []

    def launch_early(self) -> bool:
        return self.early

    def launch(self, bucket, scale, changed):
        self.events.append(f"launch {bucket.index}")
        return super().launch(bucket, scale, changed)


def test_buckets_launch_at_the_end_of_backward_where_launching_early_gains_nothing():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    x = torch.randn(8, 64)
    grads = {}
    for early in (True, False):
        transport = _LateTransport(early)
        sync = GradSync(None, bucket_bytes=4 << 10, transport=transport, timeout_s=5, accumulation=2)
        sync.register(model)
        model.zero_grad()
        model[0].weight.register_hook(lambda grad, t=transport: t.events.append("first layer's gradient") or grad)
        sync.arm(True)
        model(x).sum().backward()
        assert len(sync.refresh().buckets) > 1
        first = transport.events.index("first layer's gradient")
        # Early: the last layers' bucket left while backward still computed the first layer's gradient.
        assert (first > 0) if early else (first == 0), transport.events
        assert sorted(e for e in transport.events if e.startswith("launch")) == [
            e for e in transport.events if e.startswith("launch")
        ]
        grads[early] = [p.grad.clone() for p in model.parameters()]
        sync.remove()
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
