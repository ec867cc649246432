"""``nn.MultiheadAttention``: its projections are ``F.linear`` calls, captured while its forward runs.

The module never calls ``out_proj.forward``: ``F.multi_head_attention_forward`` hands
``in_proj_weight`` (or ``q/k/v_proj_weight``) and ``out_proj.weight`` straight to ``F.linear``, so
module hooks on ``out_proj`` see nothing. This kind claims both, with priority over ``linear``, and
captures every linear call of the module's own forward:

- a forward pre-hook pushes a ``TorchFunctionMode`` (thread-local) and a forward hook registered
  with ``always_call=True`` pops it, so the mode sees only this module's calls, exception or not;
- the handler runs ``F.multi_head_attention_forward``'s body under the mode (`_unchecked`), so its
  nested ``linear`` calls (the stock op, even where an engine replaced ``F.linear``: DeepSpeed
  ZeRO-3's ``zero3_linear_wrap``) reach it with the very parameter objects, told apart by identity;
- each call's rows are ``D`` (its output's gradient, from a hook on that output) and ``X`` (its
  input), every leading dimension flattened.

Uses and row blocks of the packed ``in_proj_weight`` (``3E x E``), read from the slice's view:

| call (in ``_in_projection_packed``)       | use       | block      |
|-------------------------------------------|-----------|------------|
| self-attention: ``q is k is v``           | `in_proj` | whole      |
| cross-attention, ``k is v``: q, then kv   | `q`, `kv` | (0,E), (E,2E) |
| q, k, v all different                     | `q`,`k`,`v` | (0,E), (E,E), (2E,E) |

``in_proj_bias`` rides as a split bias over those uses. With ``kdim``/``vdim != embed_dim`` the
module holds ``q/k/v_proj_weight`` (one use each) and their shared ``in_proj_bias`` stays dense.
``out_proj``: one use, its bias rides. ``bias_k``/``bias_v`` are not captured (the coverage floor
takes them). Without grad the pre-hook pushes nothing, so the module's fast path runs as without dAD.
"""
from __future__ import annotations

import functools
import logging
import threading
import types
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from dad_integrations.capture import compiled
from dad_integrations.capture.hooks import HookedCapture, Use
from dad_integrations.capture.layers.registry import Claim, LayerKind, register_kind, runs_stock_forward
from dad_integrations.logs import process_rank

log = logging.getLogger(__name__)

_LINEAR = torch._C._nn.linear                    # what ``F.linear`` is, and what the handler receives
PACKED_USES = ("in_proj", "q", "k", "v", "kv")    # uses of the packed ``in_proj_weight``
SEPARATE_USES = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _packed_blocks(e: int) -> Dict[str, Optional[Tuple[int, int]]]:
    """Row block ``(offset, height)`` of ``in_proj_weight`` (``3E x E``) per use."""
    return {"in_proj": None, "q": (0, e), "k": (e, e), "v": (2 * e, e), "kv": (e, 2 * e)}


_PROJECTIONS = ("_in_projection_packed", "_in_projection")  # the helpers that call ``linear``


def _with_globals(fn: Callable, g: dict) -> Callable:
    copy = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


@functools.lru_cache(maxsize=None)
def _unchecked(fn: Callable) -> Callable:
    """A copy of the Python function ``fn`` whose own ``has_torch_function`` check is always False
    (run from the mode's handler with the mode pushed again: ``fn``'s body, not ``fn`` dispatched to
    the mode forever). Its globals are a snapshot of ``fn``'s module taken at first use, with
    ``linear`` the stock op (the mode could not tell an engine's replacement from other products),
    here and in copies of the projection helpers (`_PROJECTIONS`)."""
    g = dict(fn.__globals__)
    g["has_torch_function"] = lambda *_: False
    g["linear"] = _LINEAR
    for name in _PROJECTIONS:
        if callable(g.get(name)):
            g[name] = _with_globals(g[name], dict(g[name].__globals__, linear=_LINEAR))
    return _with_globals(fn, g)


class _LinearCalls(TorchFunctionMode):
    """Passes every call through; reports each ``F.linear`` call (args, output) to the capture."""

    def __init__(self, capture: "MHACapture"):
        super().__init__()
        self.capture = capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward:
            with self:  # run its body under this mode (see `_unchecked`)
                return _unchecked(func)(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is _LINEAR:
            self.capture.linear_call(args, kwargs, out)
        return out


class MHACapture(HookedCapture):
    """The uses of one ``nn.MultiheadAttention``: ``in_proj`` and its blocks (or ``q/k/v_proj_weight``)
    and ``out_proj``; rows from the linear calls its forward makes (see the module docstring)."""

    transient = ("_pending", "_modes")

    def __init__(self, name: str, module: nn.MultiheadAttention, on_forward=None):
        if module._qkv_same_embed_dim:
            uses = {k: Use(f"{name}.in_proj_weight[{k}]", module, "linear", "in_proj_weight", block)
                    for k, block in _packed_blocks(module.embed_dim).items()}
        else:
            uses = {k: Use(f"{name}.{k}", module, "linear", k) for k in SEPARATE_USES}
        uses["out_proj"] = Use(f"{name}.out_proj.weight", module, "linear", "out_proj.weight")
        super().__init__(name, module, uses, on_forward)
        # per thread (the mode stack is thread-local), the modes the pre-hook pushed, one per open call
        self._modes: Dict[int, List[Optional[_LinearCalls]]] = {}
        self._warned = False
        self.hook(module.register_forward_pre_hook(self._pre_hook))
        self.hook(module.register_forward_hook(self._post_hook, always_call=True))

    # -- the window of one forward -----------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if compiled.compiling():
            # dynamo cannot trace the mode's re-dispatch (`_unchecked`): no rows under compile.
            # Where compile is known at attach the weights are routed from their dense gradients
            # (`MHAKind.compiles`); otherwise the first step's check finds the rows missing
            return
        self._modes.setdefault(threading.get_ident(), []).append(self._push())

    def _push(self) -> Optional[_LinearCalls]:
        """Push the capture's mode for this forward, or nothing (no grad, frozen, or capture off)."""
        if self.detached or not torch.is_grad_enabled():
            return None  # (so the module's own fast path runs as without dAD)
        if not any(u.param() is not None and u.param().requires_grad for u in self.uses):
            return None  # frozen: no gradient would take the rows
        self.opened()  # also when disabled: the step's window opens here
        if not any(u.enabled for u in self.uses):
            return None
        mode = _LinearCalls(self)
        mode.__enter__()
        return mode

    def _post_hook(self, module: nn.Module, args: tuple, output) -> None:
        if compiled.compiling():
            return
        stack = self._modes.get(threading.get_ident())
        mode = stack.pop() if stack else None
        if mode is None:
            return
        if _get_current_function_mode() is mode:
            mode.__exit__(None, None, None)
        else:  # another mode was left pushed inside the forward: popping it would be wrong too
            log.warning("dAD: %s: the torch function mode stack changed during forward; capture mode left",
                        self.name)

    # -- one F.linear call ----------------------------------------------------------------------
    def _use_of(self, w: torch.Tensor) -> Optional[Use]:
        """Which use a linear call's weight ``w`` is: a parameter itself, or a row slice of ``in_proj_weight``."""
        m = self.module
        if w is m.out_proj.weight:
            return self.by_key["out_proj"]
        if not m._qkv_same_embed_dim:
            return next((self.by_key[k] for k in SEPARATE_USES if w is getattr(m, k)), None)
        base = m.in_proj_weight
        if w is base:
            return self.by_key["in_proj"]
        if w._base is base and w.dim() == 2 and w.shape[1] == base.shape[1] and w.stride() == base.stride():
            block = ((w.storage_offset() - base.storage_offset()) // base.stride(0), w.shape[0])
            for k, b in _packed_blocks(m.embed_dim).items():
                if b == block:
                    return self.by_key[k]
        if not self._warned:  # its rows are missing: the first-step check sends the weight dense
            self._warned = True
            if process_rank() == 0:  # the model's: the same on every rank
                log.warning("dAD: %s: a linear call on a weight (or slice of in_proj_weight) of no use; "
                            "not captured", self.name)
        return None

    def linear_call(self, args: tuple, kwargs: dict, out) -> None:
        x = args[0] if args else kwargs["input"]
        w = args[1] if len(args) > 1 else kwargs["weight"]
        if not (isinstance(out, torch.Tensor) and out.requires_grad):
            return
        use = self._use_of(w)
        if use is None or not use.enabled or not w.requires_grad:
            return
        x = x.detach()
        self.on_grad(out, lambda grad: use.pairs.append((grad.reshape(-1, grad.shape[-1]),
                                                         x.reshape(-1, x.shape[-1]))))

    def remove(self) -> None:
        super().remove()
        for mode in reversed(self._modes.get(threading.get_ident(), [])):  # removed mid-forward
            if mode is not None and _get_current_function_mode() is mode:
                mode.__exit__(None, None, None)
        self._modes = {}


@register_kind
class MHAKind(LayerKind):
    name = "mha"
    capture_class = MHACapture
    compiles = False  # see `_push`: not captured while dynamo traces
    priority = 10  # before `linear`, which would claim `out_proj` (whose forward never runs)

    def accepts(self, module: nn.Module) -> bool:
        return runs_stock_forward(module, nn.MultiheadAttention)

    def claims(self, module: nn.Module) -> List[Claim]:
        if module._qkv_same_embed_dim:
            out = [Claim("in_proj_weight", uses=PACKED_USES)]
            if module.in_proj_bias is not None:
                out.append(Claim("in_proj_bias", uses=PACKED_USES, bias=True))
        else:  # three weights share in_proj_bias: it stays dense
            out = [Claim(k, uses=(k,)) for k in SEPARATE_USES]
        out.append(Claim("out_proj.weight", uses=("out_proj",)))
        if module.out_proj.bias is not None:
            out.append(Claim("out_proj.bias", uses=("out_proj",), bias=True))
        return out
