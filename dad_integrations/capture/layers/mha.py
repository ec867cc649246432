"""``nn.MultiheadAttention``: its projections are ``F.linear`` calls, captured while its forward runs.

The module never calls ``out_proj.forward``: ``F.multi_head_attention_forward`` passes
``in_proj_weight`` (or ``q/k/v_proj_weight``) and ``out_proj.weight`` straight to ``F.linear``, so
module hooks on ``out_proj`` see nothing (claimed by ``linear``, it would get no rows, and the
first-step check would send it dense for good). This kind claims both, with priority over
``linear``, and captures every linear call of the module's own forward:

- a forward pre-hook pushes a ``TorchFunctionMode`` (thread-local) and a forward hook registered
  with ``always_call=True`` pops it, so the mode sees only this module's calls, exception or not;
- a mode's handler runs with the mode popped, so the calls *inside* a Python function that checks
  ``has_torch_function`` itself (``F.multi_head_attention_forward``) would escape it: the handler
  runs that one function as a copy whose check is off (`_unchecked`), with the mode pushed again,
  and the nested ``F.linear`` calls (``torch._C._nn.linear``) reach the mode with the very
  parameter objects (and their views), so each call is told apart by identity;
- that copy, and copies of the projection helpers it calls (``_in_projection_packed``,
  ``_in_projection``), call the stock ``torch._C._nn.linear`` whatever ``F.linear`` has been
  replaced by: DeepSpeed ZeRO-3 sets ``torch.nn.functional.linear`` to its memory-efficient
  ``zero3_linear_wrap`` (an autograd Function doing ``addmm``/``matmul``, which the mode cannot
  tell from any other product), and the projections then reached the mode as no linear call (no
  rows: both weights failed the first-step check). The stock op is the same product; ZeRO-3
  re-gathers the parameters it saves for backward as it does for any other op;
- each call's rows are ``D`` (the gradient of that call's output, from a hook on the output
  tensor: one hook per call, so several calls per step pair right) and ``X`` (its input), every
  leading dimension (``L, N`` or ``N, L`` with ``batch_first``) flattened.

Uses and row blocks of the packed ``in_proj_weight`` (``3E x E``, matrix view as is):

| call (in ``_in_projection_packed``)       | use       | block      |
|-------------------------------------------|-----------|------------|
| self-attention: ``q is k is v``           | `in_proj` | whole      |
| cross-attention, ``k is v``: q, then kv   | `q`, `kv` | (0,E), (E,2E) |
| q, k, v all different                     | `q`,`k`,`v` | (0,E), (E,E), (2E,E) |

A slice's block is read from the view: offset ``(w.storage_offset() - base.storage_offset()) //
base.stride(0)``, height ``w.shape[0]``. ``in_proj_bias`` rides as a split bias over those uses
(each adds its ``D`` column sums into its block; the whole-height use into all of it). With
``kdim``/``vdim != embed_dim`` the module holds ``q/k/v_proj_weight`` (one use each, whole) and
``in_proj_bias`` is shared by three weights: it stays dense. ``out_proj``: one use, its bias rides.
``bias_k``/``bias_v`` (``add_bias_kv``, ``1 x 1 x E``) are concatenated after the projection: no
kind captures them (the coverage floor / dense takes them). ``add_zero_attn``, masks, dropout,
``need_weights`` and ``is_causal`` change what happens between the projections, not the
projections' rows.

Without grad (``no_grad``, inference) the pre-hook pushes nothing, so the module's fast path
(``torch._native_multi_head_attention``, eval only) is taken exactly as without dAD; with grad
enabled and a trainable projection the fast path is never taken anyway.

Cost: for self-attention a step's rows are the ``N L`` tokens of every call, ``N L (3E + E)``
numbers for ``in_proj`` (``X`` sent once for q, k and v) against ``3 E^2`` for its gradient, and
``N L 2E`` for ``out_proj`` against ``E^2``: exact factors pay only while a rank's tokens stay
below about ``3E/4`` (``E/2`` for ``out_proj``); beyond, "auto" routes dense or rank.
The mode costs a Python call per tensor operation of the module's forward (about 55 per call,
paid only while capturing).
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
    """A copy of the Python function ``fn`` whose own ``has_torch_function`` check is always False.

    Called from the mode's handler with the mode pushed again, it runs ``fn``'s body (instead of
    dispatching ``fn`` to the mode once more, forever); every call inside still reaches the mode.
    Its globals are a snapshot of ``fn``'s module taken at first use (the functions it calls are
    the module's own objects, with their own checks), with ``linear`` the stock op, here and in
    copies of the projection helpers (`_PROJECTIONS`): an engine may have replaced
    ``F.linear`` (DeepSpeed ZeRO-3's ``zero3_linear_wrap``; see the module doc).
    """
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
        super().__init__(name, module, list(uses.values()), on_forward)
        self.by_key = uses
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

    def capture(self, name, module, on_forward):
        c = MHACapture(name, module, on_forward)
        return c, c.by_key

