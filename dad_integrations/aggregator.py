"""`FactorAggregator`: the only way dAD algorithms talk to a communication engine.

A backend (torch.distributed, Horovod, DeepSpeed) is a small adapter over one engine's collectives.
The algorithms need four things: all-gather of rows whose first dimension differs per rank,
all-reduce, rank / world size, and the bytes each call put on the wire (for the step report).
Backends count bytes themselves because only they know what they really handed to the engine
(padding, size exchanges).
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

REDUCE_OPS = ("sum", "mean")


class CommHandle:
    """An in-flight collective. `wait()` blocks until it is done and returns its result.

    ``traffic`` holds the bytes of exactly this collective (with any size exchange the backend
    ran for it): callers attribute bytes by reading it, not by diffing a shared counter that
    other threads may move meanwhile.
    """

    def __init__(self, finish: Callable[[], Any], traffic: Optional["Traffic"] = None):
        self._finish = finish
        self._done = False
        self._value: Any = None
        self.traffic = traffic if traffic is not None else Traffic()

    def wait(self) -> Any:
        if not self._done:
            self._value = self._finish()
            self._done = True
            self._finish = None  # drop references to buffers
        return self._value


@dataclass
class Traffic:
    """Cumulative bytes of one aggregator.

    handed: bytes of the tensors handed to the engine's collectives (padding included).
    sent / received: bytes this rank puts on / takes off the wire, for ring algorithms:
    an all-gather of b bytes per rank sends and receives ``(S-1) * b``; an all-reduce of b bytes
    sends and receives ``2 (S-1)/S * b``.
    calls: number of collectives issued.
    """

    handed: float = 0.0
    sent: float = 0.0
    received: float = 0.0
    calls: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.handed + other.handed, self.sent + other.sent,
                       self.received + other.received, self.calls + other.calls)

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.handed - other.handed, self.sent - other.sent,
                       self.received - other.received, self.calls - other.calls)

    def copy(self) -> "Traffic":
        return Traffic(self.handed, self.sent, self.received, self.calls)

    def share(self, fraction: float) -> "Traffic":
        """This traffic's bytes times ``fraction``, no calls: one tensor's part of a bucket."""
        return Traffic(self.handed * fraction, self.sent * fraction, self.received * fraction, 0)


class FactorAggregator(ABC):
    """Collectives over the ranks of one data-parallel group.

    Every rank must issue the same collectives in the same order. Subclasses set ``_rank`` and
    ``_world``, implement `_all_gather` and `_all_reduce`, and count each collective
    (`_count_all_gather`, `_count_all_reduce`).
    """

    def __init__(self) -> None:
        self._traffic = Traffic()
        self._lock = threading.Lock()

    # subclasses set these two in their constructor
    _rank: int
    _world: int

    @property
    def rank(self) -> int:
        """This process' rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._world

    def all_gather(self, tensor: torch.Tensor, *, name: str,
                   first_dims: Optional[Sequence[int]] = None) -> CommHandle:
        """Gather ``tensor`` from every rank; ``wait()`` returns the list of tensors, by rank.

        The first dimension may differ per rank; the other dimensions and the dtype must agree.
        Pass ``first_dims`` (every rank's first dimension) when the caller already knows them, so
        that backends needing equal sizes can skip their size exchange.
        """
        if first_dims is not None and len(first_dims) != self.world_size:
            raise ValueError(f"first_dims has {len(first_dims)} entries for {self.world_size} ranks")
        return self._all_gather(tensor, name, None if first_dims is None else list(first_dims))

    def all_reduce(self, tensor: torch.Tensor, *, name: str, op: str = "sum") -> CommHandle:
        """Reduce ``tensor`` over ranks (``"sum"`` or ``"mean"``); ``wait()`` returns the result."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {REDUCE_OPS}, got {op!r}")
        return self._all_reduce(tensor, name, op)

    def traffic(self) -> Traffic:
        """A snapshot of the bytes counted so far (difference two snapshots to attribute a span)."""
        with self._lock:
            return self._traffic.copy()

    # -- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor, name: str,
                    first_dims: Optional[List[int]]) -> CommHandle: ...

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle: ...

    def _count_all_gather(self, nbytes_per_rank: Sequence[float]) -> Traffic:
        """Count a ring all-gather in which rank s contributes ``nbytes_per_rank[s]`` bytes."""
        own = nbytes_per_rank[self.rank]
        others = sum(nbytes_per_rank) - own
        return self._count(Traffic(own, own * (self.world_size - 1), others, 1))

    def _count_all_reduce(self, nbytes: float) -> Traffic:
        """Count a ring all-reduce of ``nbytes``."""
        s = self.world_size
        wire = 2.0 * (s - 1) / s * nbytes
        return self._count(Traffic(nbytes, wire, wire, 1))

    def _count(self, traffic: Traffic) -> Traffic:
        with self._lock:
            self._traffic = self._traffic + traffic
        return traffic


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


class EqualSizeAggregator(FactorAggregator):
    """A backend whose collectives need equal sizes on every rank (gloo's and NCCL's all-gather).

    Rows of different lengths are padded to the longest after an exchange of sizes (skipped when
    the caller passes ``first_dims``). Subclasses give the engine's two calls,
    `_engine_all_gather` and `_engine_all_reduce`; every byte the backend moves passes through
    them, and they are counted here.
    """

    @abstractmethod
    def _engine_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        """The engine's all-gather of equal-size tensors; returns a work handle (or None)."""

    @abstractmethod
    def _engine_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """The engine's in-place sum all-reduce; returns a work handle (or None)."""

    def _gather_equal(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        traffic = self._count_all_gather([tensor.numel() * tensor.element_size()] * self.world_size)
        return self._engine_all_gather(out, tensor, async_op), traffic

    def _exchange_first_dims(self, tensor: torch.Tensor) -> Tuple[List[int], Traffic]:
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        _, traffic = self._gather_equal(out, mine)
        return [int(t.item()) for t in out], traffic

    def _all_gather(self, tensor: torch.Tensor, name: str, first_dims: Optional[List[int]]) -> CommHandle:
        tensor = tensor.contiguous()
        traffic = Traffic()
        if first_dims is None:
            first_dims, traffic = self._exchange_first_dims(tensor)
        elif first_dims[self.rank] != tensor.shape[0]:
            raise ValueError(f"{name}: first_dims says {first_dims[self.rank]} rows for this rank, "
                             f"the tensor has {tensor.shape[0]}")
        longest = max(first_dims)
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work, gathered = self._gather_equal(out, tensor, async_op=True)

        def finish() -> List[torch.Tensor]:
            if work is not None:
                work.wait()
            return [t[:n] for t, n in zip(out, first_dims)]

        return CommHandle(finish, traffic + gathered)

    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle:
        traffic = self._count_all_reduce(tensor.numel() * tensor.element_size())
        work = self._engine_all_reduce(tensor, async_op=True)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            if op == "mean":
                tensor.div_(self.world_size)
            return tensor

        return CommHandle(finish, traffic)
