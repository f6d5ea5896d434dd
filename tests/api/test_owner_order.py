"""The models holding an optimizer's parameters come in one order on every worker: the parameters' order.

The owner scan walks the garbage collector's lists, whose order depends on when each worker's
collections ran. Sharding shards (and checks) one model after another, so two workers listing the
same models differently compared different models ("Workers hold different models") -- seen once
in the suite, when one worker had collected the previous test case's models and the other had not.
"""

from __future__ import annotations

import gc

import torch

from fleet.training import owners


def test_models_are_listed_by_the_first_parameter_each_holds_whatever_the_gc_order():
    head = torch.nn.Linear(8, 3)  # made first: first in the collector's list
    trunk = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
    params = [*trunk.parameters(), *head.parameters()]
    scanned = [m for m in gc.get_objects() if m is head or m is trunk]
    assert scanned == [head, trunk], "the scan's own order (this test's premise)"
    assert owners.modules_holding(params) == [trunk, head]
    assert owners.modules_holding(list(reversed(params))) == [head, trunk]
    assert owners.modules_holding([params[0]]) == [trunk]


def test_a_tied_sparse_embedding_decides_whatever_the_gc_order():
    # Weight tying (an embedding and an output layer share one matrix): the owner used to be whichever
    # module the collector's list named first, so workers could disagree on whether the gradient is sparse.
    for embedding_first in (True, False):
        if embedding_first:
            embedding, linear = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 10, bias=False)
        else:
            linear, embedding = torch.nn.Linear(4, 10, bias=False), torch.nn.Embedding(10, 4, sparse=True)
        linear.weight = embedding.weight
        found = owners.find_owners([embedding.weight])
        assert owners.is_sparse_embedding_weight(found[id(embedding.weight)]), f"embedding first: {embedding_first}"
