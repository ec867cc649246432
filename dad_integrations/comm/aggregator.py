"""`FactorAggregator`: the only way dAD algorithms talk to a communication engine.

A backend (torch.distributed, Horovod, DeepSpeed) is a small adapter over one engine's collectives:
all-gather of rows whose first dimension differs per rank, all-reduce, rank / world size and,
optionally, all-to-all (equal blocks, or `all_to_all_v`'s agreed sizes) for the sharded codecs.
Backends count the bytes they really hand to the engine (padding, size exchanges); each handle
carries its own collective's bytes (`CommHandle.traffic`). A failing collective raises
`comm.errors.CollectiveError` for every backend alike: the public calls here wrap the backends'.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import astuple, dataclass, replace
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from dad_integrations.comm.errors import CollectiveError, collective_error, is_engine_error, parse_engine_error
from dad_integrations.comm.peers import node_label

REDUCE_OPS = ("sum", "mean")


@dataclass
class Traffic:
    """Bytes of one collective (a handle's ``traffic``) or the running sum of an aggregator's:
    ``handed`` to the engine (padding included), ``sent`` / ``received`` on the wire by this rank
    (ring algorithms: `wire_bytes`), and the number of ``calls``."""

    handed: float = 0.0
    sent: float = 0.0
    received: float = 0.0
    calls: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(a - b for a, b in zip(astuple(self), astuple(other))))

    def copy(self) -> "Traffic":
        return replace(self)

    def share(self, fraction: float) -> "Traffic":
        """This traffic's bytes times ``fraction``, no calls: one tensor's part of a bucket."""
        return Traffic(self.handed * fraction, self.sent * fraction, self.received * fraction, 0)


class CommHandle:
    """An in-flight collective. `wait()` blocks until it is done and returns its result.

    ``traffic`` holds the bytes of exactly this collective (any size exchange included): add up
    handles' ``traffic`` to attribute bytes to a span of work (snapshots of
    `FactorAggregator.traffic` also hold what other threads issued in between).
    """

    def __init__(self, finish: Callable[[], Any], traffic: Optional[Traffic] = None):
        self._finish = finish
        self._done = False
        self._value: Any = None
        self.traffic: Traffic = traffic if traffic is not None else Traffic()
        # set by `FactorAggregator`: the engine's error as a `CollectiveError`; run after success
        self._translate: Optional[Callable[[BaseException], BaseException]] = None
        self._on_success: Optional[Callable[[], None]] = None

    def wait(self) -> Any:
        """Block until the collective is done; return its result (the same on every call).
        Raises `CollectiveError` where the collective failed or timed out."""
        if not self._done:
            try:
                self._value = self._finish()
            except Exception as exc:
                if self._translate is None or not is_engine_error(exc):
                    raise
                raise self._translate(exc) from exc
            self._done = True
            self._finish = None  # drop references to buffers
            if self._on_success is not None:
                self._on_success()
                self._on_success = None
        return self._value


class FactorAggregator(ABC):
    """Collectives over the ranks of one data-parallel group.

    Every rank must issue the same collectives in the same order. Subclasses set ``_rank`` and
    ``_world``, implement `_all_gather` and `_all_reduce`, count each engine call
    (`_count_all_gather`, `_count_all_reduce`) and return ``CommHandle(finish, traffic)`` with the
    sum of what they counted for that collective.
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
        if first_dims is not None and first_dims[self.rank] != tensor.shape[0]:
            raise ValueError(f"{name}: first_dims says {first_dims[self.rank]} rows for this rank, "
                             f"the tensor has {tensor.shape[0]}")
        return self._guarded("all_gather", name, lambda: self._all_gather(
            tensor, name, None if first_dims is None else list(first_dims)))

    def all_reduce(self, tensor: torch.Tensor, *, name: str, op: str = "sum") -> CommHandle:
        """Reduce ``tensor`` over ranks (``"sum"`` or ``"mean"``); ``wait()`` returns the result."""
        if op not in REDUCE_OPS:
            raise ValueError(f"all_reduce op must be one of {REDUCE_OPS}, got {op!r}")
        return self._guarded("all_reduce", name, lambda: self._all_reduce(tensor, name, op))

    def all_to_all(self, tensor: torch.Tensor, *, name: str) -> CommHandle:
        """Rank d receives every rank's ``tensor[d]``: ``tensor`` has ``world_size`` equal blocks
        along dim 0, and ``wait()`` returns a tensor of the same shape whose block s is rank s's
        block for this rank. Only backends that implement `_all_to_all` have it."""
        if tensor.shape[0] != self.world_size:
            raise ValueError(f"{name}: all_to_all needs {self.world_size} blocks along dim 0, got {tensor.shape[0]}")
        return self._guarded("all_to_all", name, lambda: self._all_to_all(tensor.contiguous(), name))

    def all_to_all_v(self, tensor: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], *,
                     name: str) -> CommHandle:
        """Rank d receives ``send_sizes[d]`` elements of ``tensor`` (1-D, blocks by destination, in
        rank order); ``wait()`` returns the 1-D concatenation of what every rank sent here, by
        source, ``recv_sizes[s]`` from rank s. Every rank must pass sizes that agree (rank s's
        ``send_sizes[d]`` is rank d's ``recv_sizes[s]``): no sizes are exchanged. Only backends
        that implement `_all_to_all_v` have it."""
        send_sizes, recv_sizes = [int(n) for n in send_sizes], [int(n) for n in recv_sizes]
        if len(send_sizes) != self.world_size or len(recv_sizes) != self.world_size:
            raise ValueError(f"{name}: all_to_all_v needs {self.world_size} send and receive sizes")
        if tensor.dim() != 1 or tensor.numel() != sum(send_sizes):
            raise ValueError(f"{name}: all_to_all_v needs a 1-D tensor of {sum(send_sizes)} elements, "
                             f"got shape {tuple(tensor.shape)}")
        if send_sizes[self.rank] != recv_sizes[self.rank]:
            raise ValueError(f"{name}: this rank sends itself {send_sizes[self.rank]} elements but expects "
                             f"{recv_sizes[self.rank]}")
        return self._guarded("all_to_all_v", name,
                             lambda: self._all_to_all_v(tensor.contiguous(), send_sizes, recv_sizes, name))

    def collective_timeout(self) -> Optional[timedelta]:
        """The timeout of this group's collectives, for error messages; None where the backend
        cannot tell. Backends override it."""
        return None

    def peer_directory(self) -> Any:
        """The job's `comm.peers.PeerDirectory` (the global ranks at an address, their node), or
        None where the backend has none. Backends override it."""
        return None

    def topology_hint(self) -> Optional[Tuple[int, int]]:
        """What the launcher says of this rank's node: ``(node index, ranks per node)`` in this
        group's terms, or None where it says nothing (`comm.topology.resolve_topology` then groups
        ranks by hostname). Backends that know their launcher override it."""
        return None

    def split(self, partition: Sequence[Sequence[int]]) -> "FactorAggregator":
        """An aggregator over the part of ``partition`` (lists of this group's ranks, covering each
        once) that holds this rank; every rank must call it at the same point, with the same
        partition (it creates groups). Backends that can make subgroups override it; without them
        there are no two-level routes (``topology: "flat"``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot make subgroups: set topology to 'flat'")

    def _split_with(self, partition: Sequence[Sequence[int]], make: Callable[[List[int]], Any]) -> Any:
        """`split`'s loop: ``make(part)`` for every part of ``partition``, in order, on every rank
        (it makes every part's group); returns what it made for this rank's part."""
        from dad_integrations.comm.topology import checked_partition
        mine = None
        for part in checked_partition(partition, self.world_size):
            made = make(part)
            if self.rank in part:
                mine = made
        return mine

    def traffic(self) -> Traffic:
        """A snapshot of the bytes counted so far, over all collectives of every thread (see `CommHandle`)."""
        with self._lock:
            return self._traffic.copy()

    # -- errors that name the fault ---------------------------------------------------------------
    def _guarded(self, collective: str, name: str, issue: Callable[[], CommHandle]) -> CommHandle:
        """Issue a collective; its failure (issuing or waiting) raises `CollectiveError`."""
        try:
            handle = issue()
        except Exception as exc:
            if not is_engine_error(exc):
                raise
            raise self._collective_error(exc, collective, name) from exc
        handle._translate = lambda exc: self._collective_error(exc, collective, name)
        directory = self.peer_directory()
        if directory is not None:  # once the group has met: every member has published its entry
            handle._on_success = directory.prefetch
        return handle

    def _collective_error(self, exc: BaseException, collective: str, name: str) -> CollectiveError:
        """The engine's ``exc`` in words (`comm.errors.collective_error`): the peer gloo names,
        mapped to its rank and node, or after a timeout the nodes that do not answer a probe."""
        directory, peer = None, None
        try:
            directory = self.peer_directory()
            if directory is not None:
                fault = parse_engine_error(str(exc))
                if fault.addr:
                    peer = directory.lookup(fault.addr)
                elif fault.timed_out:
                    peer = directory.probe()
        except Exception:  # noqa: BLE001 - the message then says "unknown"; the error is what matters
            peer = None
        rank = directory.me if directory is not None else self.rank
        node = directory.label if directory is not None else node_label()
        try:
            timeout = self.collective_timeout()
        except Exception:  # noqa: BLE001
            timeout = None
        return collective_error(exc, collective=collective, name=name, rank=rank, node=node, timeout=timeout,
                                peer=peer)

    # -- for subclasses -------------------------------------------------------------------------
    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor, name: str,
                    first_dims: Optional[List[int]]) -> CommHandle: ...

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle: ...

    def _all_to_all(self, tensor: torch.Tensor, name: str) -> CommHandle:
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all ({name})")

    def _all_to_all_v(self, tensor: torch.Tensor, send_sizes: List[int], recv_sizes: List[int],
                      name: str) -> CommHandle:
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all with sizes ({name})")

    def _count_all_to_all_v(self, itemsize: int, send_sizes: Sequence[int], recv_sizes: Sequence[int]) -> Traffic:
        """Count an all-to-all with sizes: what leaves for and arrives from the other ranks."""
        me = self.rank
        sent = (sum(send_sizes) - send_sizes[me]) * itemsize
        received = (sum(recv_sizes) - recv_sizes[me]) * itemsize
        return self._count(Traffic(handed=sum(send_sizes) * itemsize, sent=sent, received=received, calls=1))

    def _count_all_gather(self, nbytes_per_rank: Sequence[float]) -> Traffic:
        """Count a ring all-gather in which rank s contributes ``nbytes_per_rank[s]`` bytes;
        returns that call's traffic (also added to the running sum)."""
        own = nbytes_per_rank[self.rank]
        others = sum(nbytes_per_rank) - own
        return self._count(Traffic(handed=own, sent=own * (self.world_size - 1), received=others, calls=1))

    def _count_all_reduce(self, nbytes: float, kind: str = "all_reduce") -> Traffic:
        """Count a ring all-reduce (or a collective of another `wire_bytes` ``kind``) of ``nbytes``
        handed; returns that call's traffic (also added to the running sum)."""
        sent, received = wire_bytes(kind, nbytes, self.world_size)
        return self._count(Traffic(handed=nbytes, sent=sent, received=received, calls=1))

    def _count(self, call: Traffic) -> Traffic:
        with self._lock:
            self._traffic = self._traffic + call
        return call


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2.0 * (world_size - 1) / world_size * nbytes


def wire_bytes(kind: str, nbytes: float, world_size: int) -> Tuple[float, float]:
    """(sent, received) bytes of one rank for a collective of ``kind`` handed ``nbytes``: ring
    models (`CollectiveCounter`'s kinds; an all-to-all keeps ``1/S`` on this rank)."""
    s = max(int(world_size), 1)
    if kind == "all_reduce":
        w = ring_allreduce_bytes(nbytes, s)
    elif kind == "all_gather":
        w = float((s - 1) * nbytes)
    elif kind in ("reduce_scatter", "all_to_all"):
        w = (s - 1) / s * nbytes
    elif kind in ("broadcast", "reduce"):
        w = float(nbytes) if s > 1 else 0.0
    else:
        raise ValueError(f"unknown collective kind {kind!r}")
    return w, w


def _finish(work: Any, result: Callable[[], Any]) -> Callable[[], Any]:
    """A handle's ``finish``: wait for the engine's ``work`` (None: done already), then ``result()``."""
    def finish() -> Any:
        if work is not None:
            work.wait()
        return result()
    return finish


class EqualSizeAggregator(FactorAggregator):
    """A backend whose collectives need equal sizes on every rank (gloo's and NCCL's all-gather):
    rows are padded to the longest after an exchange of sizes (none with ``first_dims``).
    Subclasses give the engine's calls (`_engine_all_gather`, `_engine_all_reduce`, optionally the
    all-to-alls); every byte the backend moves passes through them, counted here."""

    @abstractmethod
    def _engine_all_gather(self, out: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False):
        """The engine's all-gather of equal-size tensors; returns a work handle (or None)."""

    @abstractmethod
    def _engine_all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """The engine's in-place sum all-reduce; returns a work handle (or None)."""

    def _engine_all_to_all(self, out: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        """The engine's all-to-all of equal blocks along dim 0 (optional; see `all_to_all`)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    def _engine_all_to_all_v(self, out: torch.Tensor, tensor: torch.Tensor, out_sizes: List[int],
                             in_sizes: List[int], async_op: bool = False):
        """The engine's all-to-all of 1-D blocks of the given sizes (optional; see `all_to_all_v`)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all with sizes")

    def _all_to_all_v(self, tensor: torch.Tensor, send_sizes: List[int], recv_sizes: List[int],
                      name: str) -> CommHandle:
        out = tensor.new_empty(sum(recv_sizes))
        traffic = self._count_all_to_all_v(tensor.element_size(), send_sizes, recv_sizes)
        work = self._engine_all_to_all_v(out, tensor, recv_sizes, send_sizes, async_op=True)
        return CommHandle(_finish(work, lambda: out), traffic)

    def _all_to_all(self, tensor: torch.Tensor, name: str) -> CommHandle:
        out = torch.empty_like(tensor)
        traffic = self._count_all_reduce(tensor.numel() * tensor.element_size(), "all_to_all")
        work = self._engine_all_to_all(out, tensor, async_op=True)
        return CommHandle(_finish(work, lambda: out), traffic)

    def _gather_equal(self, out: List[torch.Tensor], tensor: torch.Tensor,
                      async_op: bool = False) -> Tuple[Any, Traffic]:
        """The engine's all-gather, counted: (work handle or None, this call's traffic)."""
        traffic = self._count_all_gather([tensor.numel() * tensor.element_size()] * self.world_size)
        return self._engine_all_gather(out, tensor, async_op), traffic

    def _exchange_first_dims(self, tensor: torch.Tensor) -> Tuple[List[int], Traffic]:
        """Every rank's first dimension of ``tensor``, and the traffic of the exchange."""
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        _, traffic = self._gather_equal(out, mine)
        return [int(t.item()) for t in out], traffic

    def _all_gather(self, tensor: torch.Tensor, name: str, first_dims: Optional[List[int]]) -> CommHandle:
        tensor = tensor.contiguous()
        traffic = Traffic()
        if first_dims is None:
            first_dims, traffic = self._exchange_first_dims(tensor)
        longest = max(first_dims)
        if tensor.shape[0] < longest:
            pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work, gathered = self._gather_equal(out, tensor, async_op=True)
        return CommHandle(_finish(work, lambda: [t[:n] for t, n in zip(out, first_dims)]), traffic + gathered)

    def _all_reduce(self, tensor: torch.Tensor, name: str, op: str) -> CommHandle:
        traffic = self._count_all_reduce(tensor.numel() * tensor.element_size())
        work = self._engine_all_reduce(tensor, async_op=True)
        return CommHandle(_finish(work, lambda: tensor.div_(self.world_size) if op == "mean" else tensor), traffic)
