"""``nn.GRU``, ``nn.LSTM`` and ``nn.RNN``: each weight's gradient is a sum over time steps of outer products.

Layer ``l`` computes per time step ``gi_t = W_ih x_t + b_ih`` and ``gh_t = W_hh h_{t-1} + b_hh``, so

    dW_ih = sum_t G_t^T x_t        dW_hh = sum_t G'_t^T h_{t-1}        db_ih = sum_t G_t   db_hh = sum_t G'_t

with ``G = dL/dgi`` and ``G' = dL/dgh``: every time step is a row of the "linear" layout, ``N * T``
rows per weight (a ``PackedSequence``: ``sum(lengths)``). For the LSTM and the RNN ``G' = G``; the
GRU's reset gate scales the hidden side: ``G' = [G_r, G_z, r * G_n]``.

The fused kernels (cuDNN, oneDNN) never expose ``G``. So the capture keeps the call's input, initial
state and weights (alive in autograd anyway); when the outputs' gradients arrive (`when_all_grads`)
it *replays* the recurrence on the detached weights and back-propagates through time by hand
(`replay_rows`), before the module's own backward node accumulates the weights' gradients. The
replay costs a second forward of the recurrence in a Python loop: exact factors pay for few rows
only anyway, and a unit routed from its dense gradient stops capturing. Under autocast the replay
runs in the autocast dtype, as the fused call does.

Not captured (the coverage floor takes the weights), each logged once: ``bidirectional``,
``proj_size > 0`` and ``dropout > 0`` between layers (masks drawn inside the fused kernel).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from dad_integrations.capture import compiled
from dad_integrations.capture.hooks import HookedCapture, Use
from dad_integrations.capture.layers.registry import Claim, LayerKind, register_kind, runs_stock_forward
from dad_integrations.logs import OnceLogger

log = logging.getLogger(__name__)

GATES = {"GRU": 3, "LSTM": 4, "RNN_TANH": 1, "RNN_RELU": 1}
STOCK = (nn.GRU, nn.LSTM, nn.RNN)

Weights = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]  # w_ih, w_hh, b_ih, b_hh
LayerRows = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # G, X, G', H_prev

_log_once = OnceLogger(log, level=logging.INFO)


def _linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.addmm(b, x, w.t()) if b is not None else x @ w.t()


def _step(mode: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: Optional[torch.Tensor]
          ) -> Tuple[torch.Tensor, Optional[torch.Tensor], tuple]:
    """One step of PyTorch's cell from the pre-activations: ``(h', c', kept for backward)``."""
    hidden = h.shape[1]
    if mode == "GRU":
        rz = torch.sigmoid(gi[:, :2 * hidden] + gh[:, :2 * hidden])
        gh_n = gh[:, 2 * hidden:]
        n = torch.tanh(torch.addcmul(gi[:, 2 * hidden:], rz[:, :hidden], gh_n))
        return torch.addcmul(n, rz[:, hidden:], h - n), None, (rz, n, gh_n)
    if mode == "LSTM":
        pre = gi + gh
        sig = torch.sigmoid(pre)  # i, f, o (the g slice is unused)
        g = torch.tanh(pre[:, 2 * hidden:3 * hidden])
        c2 = torch.addcmul(sig[:, hidden:2 * hidden] * c, sig[:, :hidden], g)
        tc = torch.tanh(c2)
        return sig[:, 3 * hidden:] * tc, c2, (sig, g, c, tc)
    out = torch.tanh(gi + gh) if mode == "RNN_TANH" else torch.relu(gi + gh)
    return out, None, (out,)


def _coefficients(mode: str, kept: List[torch.Tensor], h_prev: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The local derivatives of every step at once (rows of the whole layer), so that each step's
    backward is a few products: ``G = [state gradients] * C`` (GRU: also ``C_hh`` for ``G'`` and
    ``Z`` for ``dh``; LSTM: ``B`` for ``dc'`` and ``F`` for ``dc``)."""
    if mode == "GRU":
        rz, n, gh_n = kept
        hidden = n.shape[1]
        r, z = rz[:, :hidden], rz[:, hidden:]
        cn = (1 - z) * (1 - n * n)
        cr = cn * gh_n * r * (1 - r)
        cz = (h_prev - n) * z * (1 - z)
        return {"C": torch.cat([cr, cz, cn], 1), "C_hh": torch.cat([cr, cz, r * cn], 1), "Z": z}
    if mode == "LSTM":
        sig, g, c, tc = kept
        hidden = g.shape[1]
        i, f, o = sig[:, :hidden], sig[:, hidden:2 * hidden], sig[:, 3 * hidden:]
        return {"C": torch.cat([g * i * (1 - i), c * f * (1 - f), i * (1 - g * g), tc * o * (1 - o)], 1),
                "B": o * (1 - tc * tc), "F": f}
    out, = kept
    return {"C": 1 - out * out if mode == "RNN_TANH" else (out > 0).to(out.dtype)}


def replay_rows(mode: str, weights: Sequence[Weights], x: torch.Tensor, h0: torch.Tensor,
                c0: Optional[torch.Tensor], batch_sizes: Sequence[int],
                grad_out: Optional[torch.Tensor], grad_hn: Optional[torch.Tensor],
                grad_cn: Optional[torch.Tensor]) -> List[LayerRows]:
    """Per layer, the rows ``(G, X, G', H_prev)`` of one call: the recurrence replayed on the
    detached weights, then back-propagated through time by hand (no autograd: its per-operation
    cost, many times over; the local derivatives of all steps at once, `_coefficients`).

    ``x`` is the time-major packed input ``(sum(batch_sizes), in)``, step ``t``'s rows the first
    ``batch_sizes[t]`` sequences (longest first, as ``PackedSequence`` keeps them). ``h0``, ``c0``
    are ``(layers, B, H)``; ``grad_out`` is the gradient of the last layer's output rows,
    ``grad_hn`` / ``grad_cn`` of the final states (None: not in the loss).
    """
    sizes = [int(s) for s in batch_sizes]
    offsets = [0, *itertools.accumulate(sizes)]
    full, hidden = sizes[0], h0.shape[2]
    with torch.no_grad():
        # forward, layer by layer: inputs, hidden-state rows and each layer's local derivatives
        inputs, prevs, coefs = [], [], []
        layer_in = x
        for k, (w_ih, w_hh, b_ih, b_hh) in enumerate(weights):
            inputs.append(layer_in)
            gi = _linear(layer_in, w_ih, b_ih)
            h, c = h0[k], (c0[k] if c0 is not None else None)
            outs, hp, kept = [], [], []
            for t, bs in enumerate(sizes):
                h_prev = h[:bs]
                h_new, c_new, keep = _step(mode, gi[offsets[t]:offsets[t + 1]], _linear(h_prev, w_hh, b_hh),
                                           h_prev, c[:bs] if c is not None else None)
                outs.append(h_new)
                hp.append(h_prev)
                kept.append(keep)
                h = h_new if bs == full else torch.cat([h_new, h[bs:]])
                if c is not None:
                    c = c_new if bs == full else torch.cat([c_new, c[bs:]])
            prevs.append(torch.cat(hp))
            coefs.append(_coefficients(mode, [torch.cat(parts) for parts in zip(*kept)], prevs[-1]))
            layer_in = torch.cat(outs)

        # backward, from the last layer down; a layer's output gradient is the next one's G W_ih
        rows: List[LayerRows] = []
        d_out = grad_out
        for k in reversed(range(len(weights))):
            w_ih, w_hh = weights[k][0], weights[k][1]
            co = coefs[k]
            g_all = x.new_empty(offsets[-1], w_hh.shape[0])  # every step writes its rows
            g_hh = x.new_empty(g_all.shape) if mode == "GRU" else g_all  # (the gates add: the same rows)
            # the running gradients of the state (B, H); rows bs: belong to sequences already ended
            dh, dc = (g[k].clone() if g is not None else x.new_zeros(full, hidden)  # (dc: LSTM only)
                      for g in (grad_hn, grad_cn))
            for t in reversed(range(len(sizes))):
                bs, lo, hi = sizes[t], offsets[t], offsets[t + 1]
                dh_t = dh[:bs] + d_out[lo:hi] if d_out is not None else dh[:bs]
                if mode == "GRU":
                    e = dh_t.repeat(1, 3)
                    torch.mul(e, co["C"][lo:hi], out=g_all[lo:hi])
                    torch.mul(e, co["C_hh"][lo:hi], out=g_hh[lo:hi])
                    dh[:bs] = torch.addmm(dh_t * co["Z"][lo:hi], g_hh[lo:hi], w_hh)
                elif mode == "LSTM":
                    dc_t = torch.addcmul(dc[:bs], dh_t, co["B"][lo:hi])
                    torch.mul(torch.cat([dc_t, dc_t, dc_t, dh_t], 1), co["C"][lo:hi], out=g_all[lo:hi])
                    dh[:bs] = g_all[lo:hi] @ w_hh
                    dc[:bs] = dc_t * co["F"][lo:hi]
                else:
                    torch.mul(dh_t, co["C"][lo:hi], out=g_all[lo:hi])
                    dh[:bs] = g_all[lo:hi] @ w_hh
            rows.append((g_all, inputs[k], g_hh, prevs[k]))
            coefs[k] = None  # (freed as the layers go)
            d_out = g_all @ w_ih if k > 0 else None
    return rows[::-1]


def when_all_grads(tensors: Sequence[torch.Tensor], fn) -> None:
    """Call ``fn(grads)`` once per backward pass, when every tensor of ``tensors`` that the pass
    reaches has its gradient (None for the others): ``register_multi_grad_hook(mode="all")``'s
    counting, except that the node whose hook fires first counts as executed too (the single root
    of ``backward()`` does not, and reentrant checkpointing back-propagates from the output itself)."""
    grad_fns = [t.grad_fn for t in tensors]  # (a tensor without one gets no gradient: None)
    pending: Dict[int, list] = {}  # per graph task: [gradients seen, gradients expected, gradients]
    lock = threading.Lock()

    def inner(idx: int, grad: Optional[torch.Tensor]) -> None:
        task = torch._C._current_graph_task_id()
        with lock:
            state = pending.get(task)
            if state is None:
                first = grad_fns[idx]
                expected = sum(1 for g in grad_fns
                               if g is not None and (g is first or torch._C._will_engine_execute_node(g)))
                state = pending[task] = [0, expected, [None] * len(tensors)]
            state[2][idx] = grad
            state[0] += 1
            done = state[0] >= state[1]
            if done:
                del pending[task]
        if done:
            fn(state[2])

    for i, t in enumerate(tensors):
        if t.grad_fn is not None:
            t.register_hook(functools.partial(inner, i))


def _call(args: tuple, kwargs: dict) -> tuple:
    """A call's input and initial state, ``(x, hx)``."""
    return (args[0] if args else kwargs["input"]), (args[1] if len(args) > 1 else kwargs.get("hx"))


def _pair(state) -> tuple:
    """``(h, c)`` of an LSTM's state, ``(h, None)`` of the others'."""
    return state if isinstance(state, tuple) else (state, None)


def _replay_order(state: torch.Tensor, unbatched: bool, sorted_idx: Optional[torch.Tensor]) -> torch.Tensor:
    """A ``(layers, B, H)`` state (or its gradient) as the replay takes it: batched, sequences sorted as packed."""
    if unbatched:
        state = state.unsqueeze(1)
    return state.index_select(1, sorted_idx) if sorted_idx is not None else state


def _keys(module: nn.RNNBase) -> List[str]:
    """The uses of a recurrent module, two per layer: ``ih_l{k}`` and ``hh_l{k}``."""
    return [f"{side}_l{k}" for k in range(module.num_layers) for side in ("ih", "hh")]


def layer_weights(module: nn.RNNBase, k: int) -> Weights:
    """Layer ``k``'s (w_ih, w_hh, b_ih, b_hh), detached (biases None without ``bias``)."""
    def get(name: str) -> Optional[torch.Tensor]:
        t = getattr(module, f"{name}_l{k}", None)
        return t.detach() if t is not None else None
    return get("weight_ih"), get("weight_hh"), get("bias_ih"), get("bias_hh")


class RNNCapture(HookedCapture):
    """Forward hook: keep the call's input, initial state and weights; the outputs' gradient hook
    (`when_all_grads`) replays the recurrence (`replay_rows`) and appends each layer's rows to its
    two uses, ``ih_l{k}`` (``(G, X)``) and ``hh_l{k}`` (``(G', H_prev)``). A call's saved state
    lives in the hook's closure (it goes with the autograd graph); `clear` moves an epoch on, so
    that a gradient arriving after it adds nothing.
    """

    def __init__(self, name: str, module: nn.RNNBase, on_forward=None):
        super().__init__(name, module, {key: Use(f"{name}.{key}", module, "linear", attr=f"weight_{key}")
                                        for key in _keys(module)}, on_forward)
        self._epoch = 0
        self.compiled_key()
        self.hook(module.register_forward_hook(self._forward_hook, with_kwargs=True))

    def clear(self) -> None:
        self._epoch += 1
        super().clear()

    def _wanted(self) -> bool:
        return any(u.enabled and u.param().requires_grad for u in self.uses)

    def _forward_hook(self, module: nn.RNNBase, args: tuple, kwargs: dict, output):
        if self.detached or not torch.is_grad_enabled():
            return None
        out, state = output
        out_t = out.data if isinstance(out, PackedSequence) else out
        if not out_t.requires_grad or not any(p.requires_grad for p in module.parameters()):
            return None
        x, hx = _call(args, kwargs)
        h_n, c_n = _pair(state)
        if compiled.compiling():
            return self._compiled_forward(x, hx, out, h_n, c_n)
        self.opened()  # also when disabled: the step's window opens here
        if not self._wanted():
            return
        saved = self._saved_call(x, *_pair(hx), out_t.dtype)  # (autocast: the replay's dtype too)
        epoch = self._epoch

        def arrived(grads: Sequence[Optional[torch.Tensor]]) -> None:
            if epoch == self._epoch and not self.detached:
                self._append(saved, grads)

        when_all_grads([t for t in (out_t, h_n, c_n) if t is not None], arrived)

    def _compiled_forward(self, x, hx, out, h_n, c_n):
        """The traced hook: the outputs wrapped so that their backward delivers the input, the
        initial states and every output's gradient at once (`compiled.tap`), for the replay. A
        ``PackedSequence`` (its batch sizes are data) is not captured: the first step's check
        routes its weights from their dense gradients."""
        if isinstance(x, PackedSequence):
            return None
        outs = compiled.tap(self.compiled_key(), [x, *_pair(hx)], [t for t in (out, h_n, c_n) if t is not None])
        return outs[0], ((outs[1], outs[2]) if c_n is not None else outs[1])

    def _add_delivered(self, saved: list, grads: list) -> None:
        """A compiled call's input, initial states and outputs' gradients (in its backward)."""
        self._append(self._saved_call(*saved, grads[0].dtype), grads)

    def _saved_call(self, x, h0, c0, dtype: torch.dtype) -> dict:
        """The call in the replay's terms: time-major rows, batch sizes, initial states (L, B, H), and
        the ``dtype`` the module ran in (under autocast bf16/fp16: so does the replay)."""
        module = self.module
        layers, hidden = module.num_layers, module.hidden_size
        sorted_idx = None
        if isinstance(x, PackedSequence):
            rows, sizes, sorted_idx = x.data, x.batch_sizes.tolist(), x.sorted_indices
            batch, unbatched = sizes[0], False
        else:  # the input as given (a reference, no copy until backward); steps and batch from its shape
            rows, unbatched = x, x.dim() == 2
            steps, batch = ((x.shape[0], 1) if unbatched else (x.shape[1], x.shape[0]) if module.batch_first
                            else tuple(x.shape[:2]))
            sizes = [batch] * steps
        states = [_replay_order(s.detach(), unbatched, sorted_idx) if s is not None
                  else rows.new_zeros(layers, batch, hidden) for s in ((h0, c0) if module.mode == "LSTM" else (h0,))]
        return {"rows": rows.detach(), "packed": isinstance(x, PackedSequence), "sizes": sizes, "dtype": dtype,
                "sorted": sorted_idx, "unbatched": unbatched,
                "h0": states[0], "c0": states[1] if len(states) > 1 else None,
                "weights": [layer_weights(module, k) for k in range(layers)]}

    def _time_major(self, t: Optional[torch.Tensor], unbatched: bool) -> Optional[torch.Tensor]:
        """A (batch, steps, .) or (steps, batch, .) tensor as time-major rows (steps * batch, .)."""
        if t is None or unbatched:
            return t
        return (t.transpose(0, 1) if self.module.batch_first else t).reshape(-1, t.shape[-1])

    def _append(self, saved: dict, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Replay one call (`_saved_call`) with its outputs' gradients, ``(out, h_n[, c_n])``."""
        if not self._wanted():
            return
        g_out, g_hn, g_cn = (list(grads) + [None])[:3]
        sizes, sorted_idx, unbatched = saved["sizes"], saved["sorted"], saved["unbatched"]
        x = saved["rows"]
        if not saved["packed"]:  # input and output gradient as time-major rows
            x, g_out = (self._time_major(t, unbatched) for t in (x, g_out))
        # (the module returned the final states in the caller's order)
        finals = [None if g is None else _replay_order(g, unbatched, sorted_idx) for g in (g_hn, g_cn)]
        dt = saved["dtype"]
        weights = [tuple(w.to(dt) if w is not None else None for w in ws) for ws in saved["weights"]]
        c0 = saved["c0"].to(dt) if saved["c0"] is not None else None
        rows = replay_rows(self.module.mode, weights, x.to(dt), saved["h0"].to(dt), c0, sizes,
                           g_out.detach() if g_out is not None else None,
                           *(g.detach() if g is not None else None for g in finals))
        for k, (g, x, g_hh, h_prev) in enumerate(rows):
            for key, pair in ((f"ih_l{k}", (g, x)), (f"hh_l{k}", (g_hh, h_prev))):
                use = self.by_key[key]
                if use.enabled and use.param().requires_grad:
                    use.pairs.append(pair)


def _refusal(module: nn.RNNBase) -> Optional[str]:
    """Why a stock recurrent module is not captured (None: it is)."""
    if module.mode not in GATES:
        return f"mode {module.mode}"
    if module.bidirectional:
        return "bidirectional=True"
    if getattr(module, "proj_size", 0) > 0:
        return "proj_size > 0"
    if module.dropout > 0 and module.num_layers > 1:
        return "dropout > 0 between layers"
    return None


@register_kind
class RNNKind(LayerKind):
    name = "rnn"
    capture_class = RNNCapture

    def accepts(self, module: nn.Module) -> bool:
        if not any(runs_stock_forward(module, base) for base in STOCK):
            return False
        reason = _refusal(module)
        if reason is not None:
            _log_once("dAD: recurrent layers with %s (first: %r) are not captured as factors; their weights take "
                      "the routes of uncaptured matrices (rank routes from the dense gradient, or dense)",
                      reason, type(module).__name__, key=reason)
            return False
        return True

    def claims(self, module: nn.Module) -> List[Claim]:
        out = []
        for key in _keys(module):
            out.append(Claim(f"weight_{key}", uses=(key,)))
            if module.bias:
                out.append(Claim(f"bias_{key}", uses=(key,), bias=True))
        return out
