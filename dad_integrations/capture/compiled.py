"""Capture under ``torch.compile``: rows handed over by an op the compiler keeps, not by Python hooks.

Dynamo cannot trace eager capture (`hooks`: a dict mutated from a hook, a hook on the output
tensor). So while it traces (`compiling`), a layer's forward hook wraps the output in `tap`, an
autograd function that is the identity forward and whose backward calls
``dad::deliver(key, saved, grads)``: a ``torch.library`` custom op, effectful (ordered, never
dropped), whose Python body hands copies of the real tensors (the inductor reuses buffers) to the
capture registered under ``key`` (`register`), a small CPU tensor so that blocks of one class share
one graph. It runs before autograd accumulates the weights' gradients, as the eager hooks do.
`guard_compiled_hooks` makes dynamo guard on module hooks, so that a graph compiled for a hook-less
copy of the model is never reused for the model dAD hooks. The whole design, and what each layer
kind does under compile: ``docs/guides/compiled.md``.
"""
from __future__ import annotations

import itertools
import logging
import sys
import threading
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from dad_integrations.logs import process_rank

log = logging.getLogger(__name__)

Deliver = Callable[[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]], None]

_SLOTS: Dict[int, "weakref.WeakMethod"] = {}   # key -> the capture's bound delivery method
_NEXT = itertools.count(1)
_LOCK = threading.Lock()


def compiling() -> bool:
    """Whether dynamo is tracing the code that calls this (its hooks are then traced, not run)."""
    return torch.compiler.is_compiling()


def register(deliver: Deliver) -> torch.Tensor:
    """A key for ``deliver`` (a bound method of a capture, held weakly): the tensor to pass to `tap`."""
    with _LOCK:
        slot = next(_NEXT)
        _SLOTS[slot] = weakref.WeakMethod(deliver)
    return torch.tensor(slot, dtype=torch.int64)


def unregister(key: Optional[torch.Tensor]) -> None:
    """Forget ``key``'s capture: rows of a graph still holding the key go nowhere."""
    if key is not None:
        with _LOCK:
            _SLOTS.pop(int(key), None)


@torch.library.custom_op("dad::deliver", mutates_args=())
def deliver(key: torch.Tensor, saved: List[Optional[torch.Tensor]], grads: List[Optional[torch.Tensor]]) -> None:
    """Hand one call's saved tensors and its outputs' gradients to the capture registered under
    ``key`` (run in the backward, compiled or not)."""
    ref = _SLOTS.get(int(key))
    fn = ref() if ref is not None else None
    if fn is not None:
        # copies: the compiler may reuse the memory of an op's inputs once the op has returned (the
        # inductor does, for buffers no later kernel reads), and the rows outlive this call
        fn([t.clone() if t is not None else None for t in saved],
           [t.clone() if t is not None else None for t in grads])


@deliver.register_fake
def _deliver_fake(key, saved, grads) -> None:
    return None


# kept in every graph, in order: it has no output, only its effect
torch.library._register_effectful_op("dad::deliver", torch._library.effects.EffectType.ORDERED)


class _Tap(torch.autograd.Function):
    """Identity on the outputs forward; backward hands ``(saved, grads)`` to ``dad::deliver``."""

    @staticmethod
    def forward(ctx, key: torch.Tensor, n_saved: int, *tensors):
        saved, outputs = tensors[:n_saved], tensors[n_saved:]
        ctx.n_saved = n_saved
        ctx.none = [t is None for t in saved]
        ctx.save_for_backward(key, *[t for t in saved if t is not None])
        return tuple(t.clone() for t in outputs)  # not views: ``nn.ReLU(inplace=True)`` may follow

    @staticmethod
    def backward(ctx, *grads):
        key, *kept = ctx.saved_tensors
        it = iter(kept)
        saved = [None if none else next(it) for none in ctx.none]
        torch.ops.dad.deliver(key, saved, list(grads))
        return (None, None) + (None,) * ctx.n_saved + tuple(grads)


def tap(key: torch.Tensor, saved: Sequence[Optional[torch.Tensor]],
        outputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """``outputs`` (copies) whose gradients, when backward reaches them, go with ``saved`` (detached
    here) to the capture of ``key``; to be called from a forward hook while dynamo traces."""
    saved = [t.detach() if t is not None else None for t in saved]
    return _Tap.apply(key, len(saved), *saved, *outputs)


# -- graphs compiled without capture ----------------------------------------------------------

_GUARDED = False


def guard_compiled_hooks(announce: bool = False) -> int:
    """Make dynamo guard on module hooks, and drop every graph compiled before; returns how many
    compiled functions were dropped. Said (INFO) only where compile is in use (``announce``, or
    graphs dropped). Called at attach and when a step opens: nothing to do until dynamo is imported."""
    global _GUARDED
    if _GUARDED or "torch._dynamo" not in sys.modules:
        return 0
    import torch._dynamo.config as dynamo_config
    with _LOCK:
        if _GUARDED:
            return 0
        _GUARDED = True
        changed = bool(dynamo_config.skip_nnmodule_hook_guards)
        dynamo_config.skip_nnmodule_hook_guards = False
    dropped = _drop_compiled_graphs()
    if changed:
        log.log(logging.INFO if announce or dropped else logging.DEBUG,
                "dAD: torch.compile now guards on module hooks (torch._dynamo.config."
                "skip_nnmodule_hook_guards=False): a graph compiled without dAD's capture is never "
                "reused for a model with it")
    return dropped


def _drop_compiled_graphs() -> int:
    """Drop the graphs of every function dynamo has compiled (built without guards on module hooks)."""
    try:
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._C._dynamo.eval_frame import reset_code
    except ImportError:  # pragma: no cover - a torch without these internals: reset everything
        torch._dynamo.reset()
        return 0
    dropped = 0
    with convert_frame.compile_lock:
        for weak_code in list(convert_frame.input_codes.seen):
            code = weak_code()
            if code is not None and _debug_get_cache_entry_list(code):
                reset_code(code)
                dropped += 1
    if dropped and process_rank() == 0:  # every rank drops its own, alike
        log.info("dAD: dropped the graphs of %d function(s) compiled before dAD was attached (built "
                 "without its capture hooks or guards on them); they recompile at their next call", dropped)
    return dropped


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is, or holds, a module compiled with ``torch.compile`` (an
    ``OptimizedModule``, or ``module.compile()``) at this time: known at attach; a model compiled
    after attach is known only when its first compiled step runs (see `exchange` checks)."""
    from torch._dynamo.eval_frame import OptimizedModule
    for m in model.modules():
        if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None:
            return True
    return False
