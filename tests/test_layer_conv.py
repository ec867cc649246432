"""The ``conv`` layer kind: im2col rows against autograd (one process), then mode exact against
DDP and lossy modes' bit-identical ranks (one torchrun job on 2 ranks for every case)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conftest import result, run_cases
from dad_integrations import DADConfig
from dad_integrations.capture.layers import kind_of
from dad_integrations.capture.rows import add_bias_grad, add_rebuilt_grad
from dad_integrations.capture.layers.conv import conv_rows
from dad_integrations.capture.assign import build_plan

TOL = 1e-5  # fp32 round-off, relative per parameter (floored at 1e-6 of the whole gradient's norm)

# (module, input spatial size): every padding form, stride, dilation and groups, in 1, 2 and 3 dims
ROWS_CASES = [
    (lambda: nn.Conv1d(4, 6, 3, stride=2, dilation=2, padding=1), (9,)),
    (lambda: nn.Conv1d(4, 6, 4, padding="same", padding_mode="reflect", bias=False), (8,)),
    (lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2)), (7, 6)),
    (lambda: nn.Conv2d(4, 6, 3, padding="valid", groups=2, padding_mode="replicate"), (7, 6)),
    (lambda: nn.Conv2d(4, 4, 3, padding="same", groups=4, padding_mode="circular"), (5, 6)),
    (lambda: nn.Conv3d(4, 6, (2, 3, 2), stride=(1, 2, 1), dilation=(2, 1, 1), padding=1, groups=2), (5, 6, 4)),
    (lambda: nn.Conv3d(2, 4, (2, 3, 4), padding="same", padding_mode="replicate"), (4, 5, 5)),
]


@pytest.mark.parametrize("case", range(len(ROWS_CASES)))
def test_rows_rebuild_autograd(case):
    """``sum_g D_g^T X_g`` into group g's row block (and ``sum D_g`` into its bias block) is
    autograd's gradient, with one row per image and output position."""
    torch.manual_seed(case)
    build, spatial = ROWS_CASES[case]
    m = build().double()
    x = torch.randn(3, m.in_channels, *spatial, dtype=torch.double)
    y = m(x)
    g = torch.randn_like(y)
    y.backward(g)
    grad = torch.zeros(m.out_channels, m.weight[0].numel(), dtype=torch.double)
    bias = torch.zeros(m.out_channels, dtype=torch.double)
    h = m.out_channels // m.groups
    rows = conv_rows(m, x, g)
    assert len(rows) == m.groups
    for i, r in enumerate(rows):
        assert r[0].shape == (3 * y[0, 0].numel(), h)
        block = (i * h, h) if m.groups > 1 else None
        add_rebuilt_grad("linear", grad, r, block)
        add_bias_grad("linear", bias, r, block)
    torch.testing.assert_close(grad, m.weight.grad.reshape(grad.shape), rtol=1e-12, atol=1e-12)
    if m.bias is not None:
        torch.testing.assert_close(bias, m.bias.grad, rtol=1e-12, atol=1e-12)


def test_unbatched_input():
    m = nn.Conv1d(3, 5, 3, padding=1).double()
    x = torch.randn(3, 7, dtype=torch.double)
    y = m(x)
    y.backward(torch.ones_like(y))
    ((d, xr),) = conv_rows(m, x, torch.ones_like(y))
    torch.testing.assert_close(d.t() @ xr, m.weight.grad.reshape(5, -1))


def test_plan_claims_groups_and_leaves_depthwise_to_the_floor():
    """groups=2: one unit with two row-blocked uses and a split bias; depthwise: a unit without
    uses (rank routes from its dense gradient), its bias dense; subclasses with their own forward
    are not captured."""
    class Custom(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 4, 1),
                          Custom(4, 4, 1))
    plan = build_plan(model, DADConfig())
    units = {u.name: u for u in plan.units}
    assert units["0.weight"].blocks == ((0, 4), (4, 4)) and [b.name for b in units["0.weight"].biases] == ["0.bias"]
    assert len(units["0.weight"].biases[0].uses) == 2
    assert not units["1.weight"].has_factors and "1.bias" in dict(plan.dense)
    assert units["2.weight"].has_factors and units["2.weight"].blocks is None and units["2.weight"].biases
    assert not units["3.weight"].has_factors
    assert kind_of(model[3]) is None
    for c in plan.captures:
        c.remove()


def test_capture_pairs_rebuild_autograd_with_reuse():
    """The hooks: a conv called twice, rows paired per call; disabled uses keep nothing."""
    torch.manual_seed(0)
    m = nn.Conv2d(4, 4, 3, padding=1, groups=2)
    plan = build_plan(nn.Sequential(m), DADConfig())
    (unit,) = plan.units
    x = torch.randn(2, 4, 5, 5)
    m(torch.tanh(m(x))).square().sum().backward()
    grad = torch.zeros(unit.shape)
    for use in unit.uses:
        assert len(use.pairs) == 2
        for rows in use.take():
            add_rebuilt_grad(use.kind, grad, rows, use.block)
    torch.testing.assert_close(grad, m.weight.grad.reshape(grad.shape))
    unit.stop_using_rows()
    m(x).sum().backward()
    assert all(not u.pairs for u in unit.uses) and not plan.captures[0]._pending
    for c in plan.captures:
        c.remove()


def test_pickled_capture_is_detached_and_removable():
    """A copied model's conv hooks do nothing and are removed when dAD attaches again; the input
    may come as a keyword."""
    from dad_integrations.capture.hooks import remove_detached_captures

    m = nn.Conv2d(4, 4, 3, stride=2, groups=2)
    plan = build_plan(nn.Sequential(m), DADConfig())
    m(input=torch.randn(1, 4, 9, 9)).sum().backward()
    use = plan.units[0].uses[0]
    assert len(use.take()) == 1
    copy_ = copy.deepcopy(m)
    copy_(torch.randn(1, 4, 9, 9)).sum().backward()
    assert remove_detached_captures(copy_) == 1 and not copy_._forward_hooks
    for c in plan.captures:
        c.remove()


CONV_MODELS = ["conv1d_net", "conv2d_net", "conv3d_net", "small_cnn", "depthwise_net"]
FLOOR = {"depthwise_net": ["dw.weight"]}  # claimed by no kind: rank routes from the dense gradient
# small_cnn's c2.bias feeds batch norm, which cancels it: its gradient is fp32 round-off of a sum
# over every row (the exact rebuild and autograd's conv backward add in different orders), so it
# is compared against that round-off itself (a wrong capture would be off by 100 % or more)
ROUND_OFF = {"small_cnn": {"c2.bias": 0.1}}


def _cases() -> dict:
    cases = {f"grad-{m}-exact": {"kind": "grad", "model": m, "config": {"mode": "exact"}, "uneven": True,
                                 "batch": 2} for m in CONV_MODELS}
    # the same through DDP's communication hook, and over two accumulated micro-steps (no_sync)
    cases["grad-conv2d_net-ddp-hook"] = dict(cases["grad-conv2d_net-exact"], ddp_hook=True)
    cases["grad-conv3d_net-nosync"] = dict(cases["grad-conv3d_net-exact"], accumulate=2)
    # lossless auto at one or three images per rank: exact for the late convs, dense for the stem
    cases["grad-late_cnn-auto"] = {"kind": "grad", "model": "late_cnn", "config": {"mode": "auto"}, "uneven": True,
                                   "batch": 1}
    cases["grad-weightnorm_net-exact"] = {"kind": "grad", "model": "weightnorm_net", "config": {"mode": "exact"},
                                          "uneven": True, "batch": 2}
    cases["vs-weightnorm_net-auto"] = {"kind": "vs_powersgd_routes", "model": "weightnorm_net", "batch": 2,
                                       "config": {"mode": "auto", "rank": 2}}
    for m in ("small_cnn", "conv2d_net", "late_cnn"):
        cases[f"train-{m}-rank"] = {"kind": "train", "model": m, "config": {"mode": "rank", "rank": 2}, "steps": 4}
        cases[f"train-{m}-auto"] = {"kind": "train", "model": m, "config": {"mode": "auto", "rank": 2},
                                    "steps": 4, "batch": 1}
    return cases


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_cases(tmp_path_factory, 2, _cases())


@pytest.mark.parametrize("model", CONV_MODELS)
def test_exact_equals_ddp(two_ranks, model):
    for r in result(two_ranks, f"grad-{model}-exact"):
        loose = ROUND_OFF.get(model, {})
        assert all(e <= loose.get(n, TOL) for n, e in r["per_param"].items()), r["per_param"]
        assert not r["dense_only"], r["dense_only"]
        convs = [n for n in r["routes"] if n.endswith("weight") and not n.startswith(("head", "n1", "n2"))]
        assert convs
        for name in convs:
            want = "dense" if name in FLOOR.get(model, []) else "exact"
            assert r["routes"][name] == want, (name, r["routes"])


@pytest.mark.parametrize("case", ["grad-conv2d_net-ddp-hook", "grad-conv3d_net-nosync"])
def test_exact_under_ddp_hook_and_accumulation(two_ranks, case):
    for r in result(two_ranks, case):
        assert r["worst"] <= TOL, r["per_param"]
        assert not r["dense_only"] and r["routes"]["b.weight"] == "exact", r["routes"]


def test_weight_norm_is_not_captured(two_ranks):
    """A weight computed by a parametrization (weight norm) is not a parameter: its kind does not
    claim the module (its rows would rebuild the computed weight's gradient). The parameters it is
    computed from are uncaptured matrices (dense in mode exact, rank routes in auto), so mode exact
    still equals DDP and auto r=2 sends at most PowerSGD's bytes; the plain conv keeps its factors."""
    for r in result(two_ranks, "grad-weightnorm_net-exact"):
        assert r["worst"] <= TOL, r["per_param"]
        assert not r["dense_only"]
        routes = r["routes"]
        assert routes["conv.weight"] == routes["head.weight"] == "exact", routes
        assert routes["pos.parametrizations.weight.original1"] == "dense", routes
    for r in result(two_ranks, "vs-weightnorm_net-auto"):
        assert max(r["sent"]["dad"]) <= min(r["sent"]["powersgd"]), r["sent"]
        routes = {p["name"]: p["route"] for p in r["params"]}
        assert routes["pos.parametrizations.weight.original1"].startswith("rank"), routes


def test_weight_norm_plan_logs_once(caplog):
    """The plan of a weight-normed conv: no unit with uses for it, its ``original0``/``original1``
    (and old-style ``weight_g``/``weight_v``) are units without uses, and one log line says why."""
    import logging
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from layer_models.conv import WeightNormConvNet

    with caplog.at_level(logging.INFO, logger="dad_integrations.capture.assign"):
        plan = build_plan(WeightNormConvNet(old=True), DADConfig())
    for c in plan.captures:
        c.remove()
    uses = {u.name: len(u.uses) for u in plan.units}
    assert uses["conv.weight"] == 1 and uses["head.weight"] == 1
    for name in ("pos.parametrizations.weight.original0", "pos.parametrizations.weight.original1",
                 "old.weight_g", "old.weight_v"):
        assert uses[name] == 0, uses
    assert "computed from other parameters" in caplog.text


def test_auto_sends_exact_factors_for_late_convs_only(two_ranks):
    """Rows = images x output positions: the stem's 36 positions x (32 + 72) columns outweigh its
    32 x 72 gradient, the late convs' 4 (or 12) rows x (64 + 288) do not; lossless, so as DDP."""
    for r in result(two_ranks, "grad-late_cnn-auto"):
        assert r["worst"] <= TOL, r["per_param"]
        routes = r["routes"]
        assert routes["stem.weight"] == "dense", routes
        assert routes["late.weight"] == routes["grouped.weight"] == routes["grouped.bias"] == "exact", routes


@pytest.mark.parametrize("case", [f"train-{m}-{mode}" for m in ("small_cnn", "conv2d_net", "late_cnn")
                                  for mode in ("rank", "auto")])
def test_lossy_modes_keep_ranks_identical(two_ranks, case):
    for r in result(two_ranks, case):
        assert r["identical"]
        assert all(x == x for x in r["losses"])  # finite
