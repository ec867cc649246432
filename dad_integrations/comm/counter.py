"""`CollectiveCounter`: bytes handed to an engine's collectives, counted at the engine's own API.

The counter wraps the collective functions of one module namespace (``torch.distributed``,
``deepspeed.comm`` or ``horovod.torch``) by name, so it sees every caller that looks them up on
that module at call time (dAD's backends, DDP's hooks, DeepSpeed's engine); it never imports an
engine. Wire bytes follow `comm.aggregator.wire_bytes` (Horovod's all-gather of different sizes
per rank: received bytes assume the others' size is ours).

    with CollectiveCounter(torch.distributed) as counter:
        ...                                           # a training step
    counter.traffic(group=aggregator.group).sent      # one group only (default: every group)
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from dad_integrations.comm.aggregator import Traffic, wire_bytes

__all__ = ["ALL_GROUPS", "Collective", "CollectiveCounter", "NAMESPACES"]


@dataclass(frozen=True)
class Collective:
    """Where one collective function takes its input and its group.

    kind: the wire model: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``,
        ``"all_to_all"``, ``"broadcast"`` or ``"reduce"``.
    input: (position, keyword) of the input tensor, or of a list of input tensors.
    group: (position, keyword) of the group (torch, DeepSpeed) or process set (Horovod).
    """

    kind: str
    input: Tuple[int, str]
    group: Tuple[int, str]


def _c(kind: str, index: int, keyword: str, group_index: int, group_keyword: str = "group") -> Collective:
    return Collective(kind, (index, keyword), (group_index, group_keyword))


TORCH_DISTRIBUTED: Dict[str, Collective] = {
    "all_reduce": _c("all_reduce", 0, "tensor", 2),
    "all_reduce_coalesced": _c("all_reduce", 0, "tensors", 2),
    "all_gather": _c("all_gather", 1, "tensor", 2),
    "all_gather_into_tensor": _c("all_gather", 1, "input_tensor", 2),
    "all_gather_coalesced": _c("all_gather", 1, "input_tensor_list", 2),
    "reduce_scatter": _c("reduce_scatter", 1, "input_list", 3),
    "reduce_scatter_tensor": _c("reduce_scatter", 1, "input", 3),
    "all_to_all_single": _c("all_to_all", 1, "input", 4),
    "broadcast": _c("broadcast", 0, "tensor", 2),
    "reduce": _c("reduce", 0, "tensor", 3),
}

# ``deepspeed.comm`` mirrors torch.distributed, with keywords of its own and two helpers
DEEPSPEED_COMM: Dict[str, Collective] = {
    **{name: c for name, c in TORCH_DISTRIBUTED.items() if name != "all_gather_coalesced"},
    "all_gather_into_tensor": _c("all_gather", 1, "tensor", 2),
    "allgather_fn": _c("all_gather", 1, "input_tensor", 2),
    "reduce_scatter_tensor": _c("reduce_scatter", 1, "tensor", 3),
    "reduce_scatter_fn": _c("reduce_scatter", 1, "tensor", 3),
    "all_to_all_single": _c("all_to_all", 1, "tensor", 4),
}

def _horovod(name: str, kind: str, arg: str, group_index: int, variants: Tuple[str, ...]) -> Dict[str, Collective]:
    """Horovod's ``name`` and its in-place / async variants (``name + suffix``)."""
    return {name + v: _c(kind, 0, arg, group_index, "process_set") for v in variants}


HOROVOD_TORCH: Dict[str, Collective] = {
    **_horovod("allreduce", "all_reduce", "tensor", 6, ("", "_", "_async", "_async_")),
    **_horovod("grouped_allreduce", "all_reduce", "tensors", 6, ("", "_async", "_async_")),
    **_horovod("allgather", "all_gather", "tensor", 2, ("", "_async")),
    **_horovod("broadcast", "broadcast", "tensor", 3, ("", "_", "_async", "_async_")),
    **_horovod("reducescatter", "reduce_scatter", "tensor", 3, ("", "_async")),
}


def _torch_world_size(module: Any, group: Any) -> int:
    return module.get_world_size(group) if group is not None else module.get_world_size()


def _horovod_world_size(module: Any, group: Any) -> int:
    return (group if group is not None else module.global_process_set).size()


#: module name -> (its collectives, how to get a group's size)
NAMESPACES: Dict[str, Tuple[Mapping[str, Collective], Callable[[Any, Any], int]]] = {
    "torch.distributed": (TORCH_DISTRIBUTED, _torch_world_size),
    "deepspeed.comm": (DEEPSPEED_COMM, _torch_world_size),
    "horovod.torch": (HOROVOD_TORCH, _horovod_world_size),
}


class _AllGroups:
    def __repr__(self) -> str:
        return "ALL_GROUPS"


#: `CollectiveCounter.traffic`'s default: calls on every group
ALL_GROUPS: Any = _AllGroups()
_NO_GROUP: Any = object()


def _nbytes(given: Any) -> int:
    tensors = given if isinstance(given, (list, tuple)) else [given]
    # duck-typed: no torch import needed, and non-tensors (None, ints) count nothing
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))


class CollectiveCounter:
    """Counts the bytes handed to the collectives of ``module``, per group and function.

    Args:
        module: the namespace whose functions are wrapped: ``torch.distributed``,
            ``deepspeed.comm``, ``horovod.torch`` or any module given with ``table``.
        table: function name -> `Collective`; None takes the one for ``module.__name__``.
            Names the module lacks are skipped.
        world_size: ``(module, group) -> size`` of a group; None takes the one for the module.

    Wrapping lasts from `install` to `uninstall` (or a ``with`` block); the counts stay readable
    after. Counting is thread-safe; a collective called from inside another wrapped one is counted
    once, as the outer call. Groups are told apart by identity (None: the default).
    """

    def __init__(self, module: Any, table: Optional[Mapping[str, Collective]] = None,
                 world_size: Optional[Callable[[Any, Any], int]] = None):
        known = NAMESPACES.get(getattr(module, "__name__", ""))
        if (table is None or world_size is None) and known is None:
            raise ValueError(f"no collective table for module {getattr(module, '__name__', module)!r}: "
                             "pass table= and world_size=")
        self.module = module
        self.table: Mapping[str, Collective] = table if table is not None else known[0]
        self._world_size = world_size if world_size is not None else known[1]
        self._lock = threading.Lock()
        self._local = threading.local()
        self._saved: Dict[str, Callable] = {}
        self._wrappers: Dict[str, Callable] = {}
        self._counts: Dict[Tuple[int, str], Traffic] = {}
        self._groups: Dict[int, Any] = {}  # keeps each counted group alive, so its id stays unique

    # -- installing ----------------------------------------------------------------------------
    def install(self) -> "CollectiveCounter":
        """Wrap the module's collectives; returns self."""
        if self._saved:
            raise RuntimeError("this CollectiveCounter is already installed")
        for name, spec in self.table.items():
            fn = getattr(self.module, name, None)
            if fn is None:
                continue
            wrapper = self._wrap(name, spec, fn)
            self._saved[name], self._wrappers[name] = fn, wrapper
            setattr(self.module, name, wrapper)
        return self

    def uninstall(self) -> None:
        """Restore the module's functions. One wrapped again by someone else since is left in
        place (restoring it would drop their wrapper); ours underneath stops counting."""
        for name, fn in self._saved.items():
            if getattr(self.module, name, None) is self._wrappers[name]:
                setattr(self.module, name, fn)
        self._saved, self._wrappers = {}, {}

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def __enter__(self) -> "CollectiveCounter":
        return self.install()

    def __exit__(self, *exc: Any) -> bool:
        self.uninstall()
        return False

    # -- reading -------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every count so far."""
        with self._lock:
            self._counts.clear()
            self._groups.clear()

    def traffic(self, group: Any = ALL_GROUPS, *, function: Optional[str] = None,
                exclude_group: Any = _NO_GROUP) -> Traffic:
        """Bytes and calls counted so far: on ``group`` (default every group), of ``function``
        (default every function), leaving out calls on ``exclude_group``."""
        return sum((t for (_, name), t in self._select(group, exclude_group) if function in (None, name)), Traffic())

    def by_function(self, group: Any = ALL_GROUPS, *, exclude_group: Any = _NO_GROUP) -> Dict[str, Traffic]:
        """Bytes and calls per function name, of the functions called (same filters as `traffic`)."""
        out: Dict[str, Traffic] = {}
        for (_, name), t in self._select(group, exclude_group):
            out[name] = out.get(name, Traffic()) + t
        return out

    def _select(self, group: Any, exclude_group: Any) -> Iterable[Tuple[Tuple[int, str], Traffic]]:
        with self._lock:
            items = [(k, t.copy()) for k, t in self._counts.items()]
        return [(k, t) for k, t in items
                if (group is ALL_GROUPS or k[0] == id(group)) and
                (exclude_group is _NO_GROUP or k[0] != id(exclude_group))]

    # -- counting ------------------------------------------------------------------------------
    def _wrap(self, name: str, spec: Collective, fn: Callable) -> Callable:
        (index, keyword), (group_index, group_keyword) = spec.input, spec.group

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._wrappers.get(name) is not counted or getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            given = args[index] if len(args) > index else kwargs.get(keyword)
            group = args[group_index] if len(args) > group_index else kwargs.get(group_keyword)
            nbytes = _nbytes(given)
            self._local.inside = True
            try:
                result = fn(*args, **kwargs)
            finally:
                self._local.inside = False
            self._add(name, spec.kind, group, nbytes)
            return result

        return counted

    def _add(self, name: str, kind: str, group: Any, nbytes: int) -> None:
        sent, received = wire_bytes(kind, nbytes, self._world_size(self.module, group))
        call = Traffic(handed=float(nbytes), sent=sent, received=received, calls=1)
        key = (id(group), name)
        with self._lock:
            self._groups[id(group)] = group
            self._counts[key] = self._counts.get(key, Traffic()) + call
