"""Recurrent models for the layer kind "rnn" (`dad_integrations.capture.layers.rnn`)."""
from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from . import Model

IN, HID, STEPS = 6, 8, 5
# (layers, batch_first, h0 given): each axis both ways over the four recurrent modules of a model
VARIANTS = ((1, False, False), (1, True, True), (2, False, True), (2, True, False))


class Recurrent(nn.Module):
    """Four GRUs (or LSTMs, or tanh RNNs), one per `VARIANTS` entry, on the same sequences; a given ``h0``
    (and ``c0``) comes from a Linear of the sequence's mean, so that its gradient flows on."""

    def __init__(self, cell: type):
        super().__init__()
        self.cell = cell
        self.rnns = nn.ModuleList(cell(IN, HID, num_layers=n, batch_first=bf) for n, bf, _ in VARIANTS)
        self.init = nn.Linear(IN, 2 * 2 * HID)  # (h0, c0) for up to two layers
        self.head = nn.Linear(HID, 3)

    def forward(self, x):  # x: (batch, steps, IN)
        states = torch.tanh(self.init(x.mean(1))).view(x.shape[0], 2, 2, HID)
        total = 0
        for rnn, (n, bf, given) in zip(self.rnns, VARIANTS):
            seq = x if bf else x.transpose(0, 1)
            if given:
                h0 = states[:, 0, :n].transpose(0, 1).contiguous()
                c0 = states[:, 1, :n].transpose(0, 1).contiguous()
                out, state = rnn(seq, (h0, c0) if self.cell is nn.LSTM else h0)
            else:
                out, state = rnn(seq)
            h_n = state[0] if self.cell is nn.LSTM else state
            out = out if bf else out.transpose(0, 1)
            total = total + self.head(out).mean(1) + self.head(h_n[-1])
        return total


class Varied(nn.Module):
    """A ReLU RNN on unbatched sequences (one call per example), then an LSTM on a
    ``PackedSequence`` of uneven lengths (unsorted), an RNN with neither bias, and a GRU whose
    ``h_n`` alone enters the loss."""

    def __init__(self):
        super().__init__()
        self.relu = nn.RNN(IN, HID, nonlinearity="relu")
        self.lstm = nn.LSTM(HID, HID, num_layers=2, batch_first=True)
        self.plain = nn.RNN(HID, HID, bias=False)
        self.gru = nn.GRU(HID, HID)
        self.head = nn.Linear(HID, 3)

    def forward(self, x, lengths):
        seq = torch.stack([self.relu(e)[0] for e in x])  # unbatched: (steps, IN) per example
        packed = pack_padded_sequence(seq, lengths, batch_first=True, enforce_sorted=False)
        out, (h_n, _) = self.lstm(packed)
        mixed, _ = self.plain(seq.transpose(0, 1))
        _, last = self.gru(mixed)
        return self.head(out.data).mean() + self.head(h_n[-1]) + self.head(last[0])


class Bidirectional(nn.Module):
    """Not captured: a bidirectional GRU (its weights take the uncaptured matrices' routes)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(IN, HID, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * HID, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0]).mean(1)


VOCAB = 40


class GRULanguageModel(nn.Module):
    """Embedding, a two-layer GRU and a Linear head over the vocabulary (next-token loss); with
    ``checkpoint`` the GRU runs under activation checkpointing (``"reentrant"`` or not)."""

    def __init__(self, checkpoint: str = ""):
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 24, num_layers=2, batch_first=True)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        if self.checkpoint:
            out = torch.utils.checkpoint.checkpoint(lambda t: self.rnn(t)[0], x,
                                                    use_reentrant=self.checkpoint == "reentrant")
        else:
            out = self.rnn(x)[0]
        return self.head(out)


def _sequences(size: int, g: torch.Generator) -> dict:
    return {"x": torch.randn(size, STEPS, IN, generator=g), "y": torch.randn(size, 3, generator=g)}


def _varied(size: int, g: torch.Generator) -> dict:
    data = _sequences(size, g)
    data["lengths"] = torch.randint(1, STEPS + 1, (size,), generator=g)
    data["lengths"][0] = STEPS  # the padded length is the longest
    return data


def _tokens(size: int, g: torch.Generator) -> dict:
    return {"ids": torch.randint(0, VOCAB, (size, STEPS + 1), generator=g)}


def _mse(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"]), data["y"])


def _varied_loss(model: nn.Module, data: dict) -> torch.Tensor:
    return nn.functional.mse_loss(model(data["x"], data["lengths"]), data["y"])


def _lm_loss(model: nn.Module, data: dict) -> torch.Tensor:
    ids = data["ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


MODELS = {
    "rnn_gru": Model(lambda: Recurrent(nn.GRU), _sequences, _mse),
    "rnn_lstm": Model(lambda: Recurrent(nn.LSTM), _sequences, _mse),
    "rnn_tanh": Model(lambda: Recurrent(nn.RNN), _sequences, _mse),
    "rnn_varied": Model(Varied, _varied, _varied_loss),
    "rnn_bidirectional": Model(Bidirectional, _sequences, _mse),
    "rnn_gru_lm": Model(GRULanguageModel, _tokens, _lm_loss),
    "rnn_gru_lm_ckpt": Model(lambda: GRULanguageModel("non-reentrant"), _tokens, _lm_loss),
    "rnn_gru_lm_ckpt_reentrant": Model(lambda: GRULanguageModel("reentrant"), _tokens, _lm_loss),
}
