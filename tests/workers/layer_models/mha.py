"""``nn.MultiheadAttention`` in each way its forward calls ``F.linear`` (the `mha` layer kind).

Packed ``in_proj_weight``: self-attention (one whole-height call), cross-attention with ``key is
value`` (a q slice and a kv slice), query/key/value all different (three slices); separate
``q/k/v_proj_weight`` (``kdim``/``vdim`` != ``embed_dim``, with ``add_bias_kv``/``add_zero_attn``);
``batch_first`` both ways, ``need_weights`` both ways, masks; and PyTorch's own encoder and decoder
stacks (dropout 0, so that DDP and dAD see the same activations).
"""
from __future__ import annotations

import torch
from torch import nn

from . import Model

E, HEADS, LQ, LS = 16, 2, 5, 4  # embedding, heads, query and source lengths


class Attn(nn.Module):
    """One attention module between a linear read-in and a linear head.

    ``inputs``: "self" (q = k = v), "cross" (k = v = memory), "qkv" (three different tensors);
    tensors are (N, L, E) for ``batch_first``, else (L, N, E).
    """

    def __init__(self, inputs: str = "self", batch_first: bool = False, need_weights: bool = True,
                 masked: bool = False, kdim: int = None, vdim: int = None, extras: bool = False):
        super().__init__()
        self.inputs, self.batch_first, self.need_weights, self.masked = inputs, batch_first, need_weights, masked
        self.read = nn.Linear(E, E)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=vdim,
                                          add_bias_kv=extras, add_zero_attn=extras)
        self.head = nn.Linear(E, E)

    def forward(self, x, mem, val, pad):
        q = torch.tanh(self.read(x))
        if self.inputs == "self":
            k = v = q
        elif self.inputs == "cross":
            k = v = mem
        else:
            k, v = mem, val
        kwargs = {}
        if self.masked:  # a padding mask per example (its last key) and a causal mask (True: masked)
            t = 1 if self.batch_first else 0
            kwargs["key_padding_mask"] = pad
            kwargs["attn_mask"] = torch.ones(q.shape[t], k.shape[t], dtype=torch.bool).triu(1)
        out, weights = self.attn(q, k, v, need_weights=self.need_weights, **kwargs)
        y = self.head(out)
        if weights is not None:  # the weights take part in the loss, so their path is checked too
            y = y + weights.pow(2).sum()
        return y


def _attn_batch(batch_first: bool, inputs: str, kdim: int = E, vdim: int = E):
    def batch(size: int, g: torch.Generator) -> dict:
        lk = LQ if inputs == "self" else LS

        def t(length, dim):
            shape = (size, length, dim) if batch_first else (length, size, dim)
            return torch.randn(*shape, generator=g)

        pad = torch.zeros(size, lk, dtype=torch.bool)
        pad[:, -1] = torch.rand(size, generator=g) > 0.5  # some examples pad their last key
        return {"x": t(LQ, E), "mem": t(lk, kdim), "val": t(lk, vdim), "pad": pad, "y": t(LQ, E)}
    return batch


def _attn_loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"], data["mem"], data["val"], data["pad"]), data["y"])


class Encoder(nn.Module):
    """``nn.TransformerEncoder``, 2 layers, batch first, with a padding mask."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, HEADS, 2 * E, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(E, E)

    def forward(self, x, pad):
        return self.head(self.enc(x, src_key_padding_mask=pad))


class Decoder(nn.Module):
    """``nn.TransformerDecoder``, 2 layers, sequence first: causal self-attention, then
    cross-attention on the memory (``key is value``)."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerDecoderLayer(E, HEADS, 2 * E, dropout=0.0)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(E, E)

    def forward(self, x, mem):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        return self.head(self.dec(x, mem, tgt_mask=mask))


def _enc_batch(size: int, g: torch.Generator) -> dict:
    pad = torch.zeros(size, LQ, dtype=torch.bool)
    pad[:, -1] = torch.rand(size, generator=g) > 0.5
    return {"x": torch.randn(size, LQ, E, generator=g), "pad": pad, "y": torch.randn(size, LQ, E, generator=g)}


def _dec_batch(size: int, g: torch.Generator) -> dict:
    return {"x": torch.randn(LQ, size, E, generator=g), "mem": torch.randn(LS, size, E, generator=g),
            "y": torch.randn(LQ, size, E, generator=g)}


MODELS = {
    "mha_self": Model(lambda: Attn("self"), _attn_batch(False, "self"), _attn_loss),
    "mha_self_bf_noweights": Model(lambda: Attn("self", batch_first=True, need_weights=False),
                                   _attn_batch(True, "self"), _attn_loss),
    "mha_masked": Model(lambda: Attn("self", batch_first=True, masked=True), _attn_batch(True, "self"), _attn_loss),
    "mha_cross": Model(lambda: Attn("cross", batch_first=True), _attn_batch(True, "cross"), _attn_loss),
    "mha_qkv": Model(lambda: Attn("qkv", need_weights=False, masked=True), _attn_batch(False, "qkv"), _attn_loss),
    "mha_kvdim": Model(lambda: Attn("qkv", kdim=6, vdim=5, extras=True), _attn_batch(False, "qkv", 6, 5),
                       _attn_loss),
    "mha_encoder": Model(Encoder, _enc_batch,
                         lambda m, d: nn.functional.mse_loss(m(d["x"], d["pad"]), d["y"])),
    "mha_decoder": Model(Decoder, _dec_batch,
                         lambda m, d: nn.functional.mse_loss(m(d["x"], d["mem"]), d["y"])),
}
