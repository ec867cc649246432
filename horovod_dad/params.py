"""The optimizer's parameters as dAD sees them: which require grad while it attaches, and
sparse gradients made dense before it reads them (Horovod's ``sparse_as_dense``)."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List

from torch import nn


def sparse_to_dense(p: nn.Parameter) -> None:
    """A post-accumulate-grad hook: a sparse gradient becomes dense."""
    if p.grad is not None and p.grad.is_sparse:
        p.grad = p.grad.to_dense()


@contextlib.contextmanager
def requiring_grad_only(model: nn.Module, params: List[nn.Parameter]) -> Iterator[None]:
    """Inside the block, of ``model``'s parameters exactly ``params`` require grad (so that the
    synchroniser's plan covers them and hooks can be registered on them); after it, each parameter's
    ``requires_grad`` is what it was at entry."""
    ours = {id(p) for p in params}
    flipped = [p for p in unique(list(model.parameters()) + list(params)) if p.requires_grad != (id(p) in ours)]
    for p in flipped:
        p.requires_grad_(not p.requires_grad)
    try:
        yield
    finally:
        for p in flipped:
            p.requires_grad_(not p.requires_grad)


def unique(params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
    """``params`` without repeats, in their first order."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
