"""A prefetch (parameter server, async) is used only by a forward of exactly the ids it fetched: another batch,
or the same tensor refilled in place after the prefetch, is pulled again, never given the prefetched rows.

The modules run in one process over a stand-in backend that serves rows from the module's own table and
prefetches the way the async PS backend does (a future of the rows), counting the pulls each forward makes."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from fleet.nn import FeatureTable, SparseEmbedding, SparseFeatureCollection

_KEY = object()  # every stand-in backend pulls together with the others (one client)


class PrefetchingRows:
    """The module's local rows, behind the prefetch interface of ``fleet.ps.modes.rows.RemoteRows``."""

    pulls = 0
    prefetches = 0

    def __init__(self, module) -> None:
        self.local = module.local

    # one module
    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        PrefetchingRows.pulls += 1
        return self.local.pull(ids)

    def prefetch(self, ids: torch.Tensor) -> Future:
        PrefetchingRows.prefetches += 1
        future: Future = Future()
        future.set_result(self.local.pull(ids))
        return future

    def collect(self, future: Future) -> torch.Tensor:
        return future.result()

    # several modules (SparseFeatureCollection)
    def batch_key(self) -> object:
        return _KEY

    @staticmethod
    def pull_together(backends: list, ids: list[torch.Tensor]) -> list[torch.Tensor]:
        PrefetchingRows.pulls += 1
        return [b.local.pull(x) for b, x in zip(backends, ids, strict=True)]

    @staticmethod
    def prefetch_together(backends: list, ids: list[torch.Tensor]) -> Future:
        PrefetchingRows.prefetches += 1
        future: Future = Future()
        future.set_result([b.local.pull(x) for b, x in zip(backends, ids, strict=True)])
        return future


def _serve_through_stand_in(module, monkeypatch) -> None:
    backend = PrefetchingRows(module)
    monkeypatch.setattr(module, "backend", lambda: backend)
    monkeypatch.setattr(PrefetchingRows, "pulls", 0)
    monkeypatch.setattr(PrefetchingRows, "prefetches", 0)


def _pulls_of(forward) -> tuple[torch.Tensor, int]:
    before = PrefetchingRows.pulls
    with torch.no_grad():
        out = forward()
    return out, PrefetchingRows.pulls - before


@pytest.mark.timeout(60)
def test_a_sparse_embeddings_prefetch_serves_only_the_same_ids(monkeypatch) -> None:
    emb = SparseEmbedding(4, seed=3)
    ref = SparseEmbedding(4, seed=3)  # the same rows, pulled plainly
    _serve_through_stand_in(emb, monkeypatch)
    a = torch.tensor([[1, 5, 5], [9, 1, 2]])
    b = torch.tensor([[7, 8, 5], [3, 3, 4]])
    with torch.no_grad():
        want_a, want_b = ref(a), ref(b)

    emb.prefetch(a)
    out, pulls = _pulls_of(lambda: emb(a.clone()))  # equal ids, another tensor: the prefetch serves them
    assert pulls == 0 and torch.equal(out, want_a)

    emb.prefetch(a)
    out, pulls = _pulls_of(lambda: emb(b))  # another batch: pulled
    assert pulls == 1 and torch.equal(out, want_b)

    ids = a.clone()
    emb.prefetch(ids)
    ids.copy_(b)  # the caller's buffer refilled after the prefetch
    out, pulls = _pulls_of(lambda: emb(ids))
    assert pulls == 1 and torch.equal(out, want_b)
    assert PrefetchingRows.prefetches == 3


def _collection() -> SparseFeatureCollection:
    return SparseFeatureCollection(
        [FeatureTable("t0", 3, ["f0", "f1"], seed=1), FeatureTable("t1", 5, ["f2"], mode="mean", padding_idx=0)]
    )


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([2, 0, 3, 1])
    return {f: (torch.randint(0, 12, (6,), generator=g), lengths) for f in ("f0", "f1", "f2")}


@pytest.mark.timeout(60)
def test_a_collections_prefetch_serves_only_the_same_ids(monkeypatch) -> None:
    features, ref = _collection(), _collection()
    for table in features.tables.values():
        _serve_through_stand_in(table, monkeypatch)
    a, b = _batch(0), _batch(1)
    with torch.no_grad():
        want_a, want_b = ref(a), ref(b)

    def same(got: dict, want: dict) -> bool:
        return list(got) == list(want) and all(torch.equal(got[f], want[f]) for f in want)

    features.prefetch(a)
    out, pulls = _pulls_of(lambda: features({f: (v.clone(), n) for f, (v, n) in a.items()}))
    assert pulls == 0 and same(out, want_a)  # the prefetch's rows, unique ids and inverse index served it

    features.prefetch(a)
    out, pulls = _pulls_of(lambda: features(b))
    assert pulls == 1 and same(out, want_b)

    refilled = {f: (v.clone(), n) for f, (v, n) in a.items()}
    features.prefetch(refilled)
    refilled["f2"][0].copy_(b["f2"][0])  # one feature's ids refilled in place after the prefetch
    mixed = {"f0": a["f0"], "f1": a["f1"], "f2": b["f2"]}
    with torch.no_grad():
        want_mixed = ref(mixed)
    out, pulls = _pulls_of(lambda: features(refilled))
    assert pulls == 1 and same(out, want_mixed)

    features.prefetch(a)
    out, pulls = _pulls_of(lambda: features(a))
    out, again = _pulls_of(lambda: features(a))  # a prefetch serves one forward
    assert pulls == 0 and again == 1 and same(out, want_a)
