"""The layer kind "rnn": GRU, LSTM and RNN weights rebuilt from replayed gate gradients.

One torchrun job (2 ranks) runs every case: mode exact against DDP (the recurrent weights and
biases must take "exact", none may fail the first-step check) for GRUs and LSTMs of 1 and 2
layers, batch_first both ways, with and without h0; ReLU/bias-free RNNs, unbatched and packed
inputs; a GRU language model, also under activation checkpointing (both kinds), as DDP's comm
hook, and with accumulation micro-steps; bf16 autocast (LSTM and tanh RNN); training with the rank routes (ranks end
bit-identical); and a bidirectional GRU, which is not captured and still equals DDP.
Single-process tests check the replay's rows against autograd's gradients.
"""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from conftest import result, run_cases
from dad_integrations.capture.layers import get_kind, kind_of
from dad_integrations.capture.rows import add_bias_grad, add_rebuilt_grad, concat_rows
from dad_integrations.capture.layers.rnn import replay_rows, when_all_grads

TOL = 1e-5  # fp32 round-off, relative per parameter (floored at 1e-6 of the whole gradient's norm)
EXACT_MODELS = ["rnn_gru", "rnn_lstm", "rnn_varied", "rnn_gru_lm", "rnn_gru_lm_ckpt", "rnn_gru_lm_ckpt_reentrant"]
AUTOCAST_MODELS = ["rnn_lstm", "rnn_tanh"]  # tanh runs in bf16 under autocast on every CPU
EXACT_VARIANTS = {  # how the step runs: accumulation micro-steps, dAD as DDP's comm hook
    "nosync-rnn_lstm": {"model": "rnn_lstm", "accumulate": 2},
    "hook-rnn_gru_lm": {"model": "rnn_gru_lm", "ddp_hook": True},
}


def _cases() -> dict:
    cases = {f"grad-{m}": {"kind": "grad", "model": m, "config": {"mode": "exact"}, "uneven": True}
             for m in EXACT_MODELS}
    cases.update({k: dict(v, kind="grad", config={"mode": "exact"}, uneven=True) for k, v in EXACT_VARIANTS.items()})
    for m in AUTOCAST_MODELS:
        cases[f"autocast-{m}"] = {"kind": "grad", "model": m, "config": {"mode": "exact"},
                                  "autocast": "bfloat16", "onednn": _onednn_runs_bf16_lstm()}
    cases["grad-rnn_bidirectional"] = {"kind": "grad", "model": "rnn_bidirectional", "config": {"mode": "exact"}}
    for mode in ("auto", "rank"):
        cases[f"train-rnn_gru_lm-{mode}"] = {"kind": "train", "model": "rnn_gru_lm", "steps": 10,
                                             "config": {"mode": mode, "rank": 2}}
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(tmp_path_factory, 2, _cases())


def _recurrent(routes: dict) -> dict:
    return {n: r for n, r in routes.items() if "_ih_l" in n or "_hh_l" in n}


@pytest.mark.parametrize("case", [f"grad-{m}" for m in EXACT_MODELS] + list(EXACT_VARIANTS))
def test_exact_equals_ddp(results, case):
    for r in result(results, case):
        assert r["worst"] <= TOL, r["per_param"]
        recurrent = _recurrent(r["routes"])
        assert len(recurrent) >= 8, r["routes"]
        assert set(recurrent.values()) == {"exact"}, recurrent  # weights and biases
        assert not r["dense_only"], r["dense_only"]


@functools.lru_cache(maxsize=None)
def _onednn_runs_bf16_lstm() -> bool:
    """Whether this CPU's oneDNN runs an LSTM under bf16 autocast (AVX2-only parts raise inside
    torch); where it cannot, the case runs with oneDNN off, and autocast leaves the LSTM in fp32."""
    m = nn.LSTM(2, 2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(torch.zeros(1, 1, 2))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("model", AUTOCAST_MODELS)
def test_autocast_bf16_keeps_factors(results, model):
    """Under bf16 autocast the replay runs in the dtype the fused call ran in: the first-step
    check passes, and the result is as close to DDP's as bf16 allows."""
    for r in result(results, f"autocast-{model}"):
        assert r["worst"] < 5e-2
        if model == "rnn_lstm" and not _onednn_runs_bf16_lstm():
            # torch's own LSTM then mixes bf16 products with fp32 gates, which no replay follows:
            # the first-step check sends such weights dense (seen for the calls without h0)
            continue
        assert set(_recurrent(r["routes"]).values()) == {"exact"} and not r["dense_only"]


def test_bidirectional_falls_back(results):
    for r in result(results, "grad-rnn_bidirectional"):
        assert r["worst"] <= TOL, r["per_param"]
        recurrent = _recurrent(r["routes"])
        assert recurrent and "exact" not in recurrent.values(), recurrent
        assert r["routes"]["head.weight"] == "exact"


@pytest.mark.parametrize("mode", ["auto", "rank"])
def test_train_ranks_identical(results, mode):
    for r in result(results, f"train-rnn_gru_lm-{mode}"):
        assert r["identical"]
        assert r["losses"][-1] < r["losses"][0]


@pytest.fixture(autouse=True)
def one_thread():
    """The single-process tests' small products: one thread (no pool to wake on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _replay_case(cls, layers, batch_first, h0, packed=False, unbatched=False):
    """Rows of one call, captured by the kind's hooks, against autograd's weight gradients."""
    torch.manual_seed(0)
    m = cls(5, 7, num_layers=layers, batch_first=batch_first).double()
    capture, uses = get_kind("rnn").capture("m", m, None)
    batch, steps = 3, 4
    shape = (steps, 5) if unbatched else (batch, steps, 5) if batch_first else (steps, batch, 5)
    x = torch.randn(*shape, dtype=torch.double)
    args = [pack_padded_sequence(x, torch.tensor([2, 4, 3]), batch_first=batch_first, enforce_sorted=False)
            if packed else x]
    if h0:
        hs = [torch.randn(*((layers, 7) if unbatched else (layers, batch, 7)), dtype=torch.double)
              for _ in range(2 if cls is nn.LSTM else 1)]
        args.append(tuple(hs) if cls is nn.LSTM else hs[0])
    out, state = m(*args)
    out = out.data if packed else out
    h_n, c_n = state if cls is nn.LSTM else (state, None)
    loss = out.pow(2).sum() + 1.3 * h_n.sum() + (c_n.pow(3).sum() if c_n is not None else 0)
    loss.backward()
    for key, use in uses.items():
        for attr, rebuild in ((f"weight_{key}", add_rebuilt_grad), (f"bias_{key}", add_bias_grad)):
            p = getattr(m, attr)
            mine = torch.zeros_like(p)
            rebuild("linear", mine, concat_rows(use.pairs, "linear", tuple(use.param().shape), use.param()))
            assert torch.allclose(mine, p.grad, rtol=1e-10, atol=1e-12), (cls, layers, attr)
    capture.remove()


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM, nn.RNN])
def test_replay_rows_equal_autograd(cls):
    for layers, batch_first, h0 in itertools.product((1, 2), (False, True), (False, True)):
        _replay_case(cls, layers, batch_first, h0)
    _replay_case(cls, 2, False, True, packed=True)
    _replay_case(cls, 2, True, False, unbatched=True)


def test_replay_gru_gates():
    """The GRU's hidden-side rows: ``G' = [G_r, G_z, r * G_n]``, ``G`` the input side's."""
    torch.manual_seed(0)
    w = [(torch.randn(6, 2), torch.randn(6, 2), torch.randn(6), torch.randn(6))]
    x, h0 = torch.randn(3, 2), torch.randn(1, 1, 2)
    (g, rows_x, g_hh, h_prev), = replay_rows("GRU", w, x, h0, None, [1, 1, 1], torch.ones(3, 2), None, None)
    assert torch.equal(g[:, :4], g_hh[:, :4]) and not torch.allclose(g[:, 4:], g_hh[:, 4:])
    assert torch.equal(rows_x, x) and torch.equal(h_prev[0], h0[0, 0])


def test_not_claimed():
    kind = get_kind("rnn")
    for m in (nn.GRU(4, 4, bidirectional=True), nn.LSTM(4, 4, proj_size=2), nn.GRU(4, 4, num_layers=2, dropout=0.1)):
        assert not kind.accepts(m)
    assert kind_of(nn.LSTM(4, 4)) is kind and kind_of(nn.GRU(4, 4, dropout=0.1)) is kind  # one layer: no dropout


def test_when_all_grads_fires_at_a_single_root():
    """PyTorch's multi-grad hook (mode "all") never fires where its tensor is backward's only root."""
    x = torch.randn(3, requires_grad=True)
    seen = []
    for roots in ("y", "z", "both", "w"):
        y, z = x * 2, x * 3
        w = y * z
        when_all_grads([y, z, x.detach()], lambda grads: seen.append([g is not None for g in grads]))
        outs = {"y": [y], "z": [z], "both": [y, z], "w": [w]}[roots]
        torch.autograd.backward(outs, [torch.ones(3)] * len(outs))
    assert seen == [[True, False, False], [False, True, False], [True, True, False], [True, True, False]]


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_rows_exist_before_the_weights_accumulate(cls):
    """The outputs' gradient hook runs before the module's backward: when autograd adds to a
    weight's gradient, its rows of every call (here two, the second from the first's state) are in."""
    torch.manual_seed(0)
    m = cls(5, 7, num_layers=2)
    capture, uses = get_kind("rnn").capture("m", m, None)
    seen = {}
    for key, use in uses.items():
        use.param().register_post_accumulate_grad_hook(
            lambda p, key=key, use=use: seen.setdefault(key, len(use.pairs)) and None)
    out, state = m(torch.randn(4, 3, 5))
    out2, _ = m(torch.randn(2, 3, 5), state)
    (out2.pow(2).sum() + out.sum()).backward()
    assert seen == {key: 2 for key in uses}
    capture.remove()
