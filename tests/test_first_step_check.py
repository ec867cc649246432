"""The first step's check by sketch (`exchange.checks.factors_rebuild_local_grad`), on one process.

Real capture (`build_plan`'s hooks) of real layers, every row layout: the sketched check passes on
the rows of an unchanged backward, and fails where autograd's gradient is not what the rows say (a
gradient hook scaling a weight or a bias, a weight used outside its layer), in fp32, bf16 and fp64.
`codecs.exact.rebuild` with a sketch equals the whole rebuild times the sketch, in every layout,
block and region; without one it is what it was (the exact route's decoder).
"""
import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from dad_integrations.capture.assign import build_plan
from dad_integrations.capture.rows import concat_rows
from dad_integrations.capture.sink import GradSink, ShardSink, ShardSlot
from dad_integrations.codecs.exact import RowShards, bias_uses, cut, pairs, rebuild, rebuild_unit
from dad_integrations.config import DADConfig
from dad_integrations.exchange.checks import SKETCH_COLUMNS, factors_rebuild_local_grad, sketch_matrix

from conftest import result, run_cases

TOKENS = 6


class Layouts(nn.Module):
    """One layer of each layout and block kind, each wider than the sketch (so it is sketched):
    linear with a riding bias, GPT-2's Conv1D (its bias is the right), an embedding, a grouped conv
    (one row block per group) and a cross-attention (the packed projection's q and kv blocks)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 24)
        self.lin = nn.Linear(24, 20)
        self.c1d = Conv1D(18, 20)            # weight (in 20, out 18)
        self.conv = nn.Conv1d(18, 16, 3, groups=2, padding=1)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.kv = nn.Linear(24, 16)
        self.head = nn.Linear(16, 10, bias=False)

    def forward(self, ids: torch.Tensor, extra: bool = False) -> torch.Tensor:
        e = self.emb(ids)                                # (B, T, 24)
        h = torch.tanh(self.lin(e))
        if extra:                                        # the weight used outside its layer
            h = h + 0.3 * nn.functional.linear(e, self.lin.weight)
        h = torch.tanh(self.c1d(h))                      # (B, T, 18)
        h = torch.tanh(self.conv(h.transpose(1, 2)).transpose(1, 2))  # (B, T, 16)
        kv = self.kv(e)
        h, _ = self.mha(h, kv, kv, need_weights=False)
        return self.head(h)


WEIGHTS = {"emb.weight": "embedding", "lin.weight": "linear", "c1d.weight": "conv1d",
           "conv.weight": "linear (2 row blocks)", "mha.in_proj_weight": "linear (row blocks)",
           "kv.weight": "linear", "head.weight": "linear"}


def _step(dtype=torch.float32, hooks=(), extra=False, seed=0):
    """Build, hook, run one backward; returns the plan's units by name and their captured rows."""
    torch.manual_seed(seed)
    model = Layouts().to(dtype)
    params = dict(model.named_parameters())
    for name, fn in hooks:
        params[name].register_hook(fn)
    plan = build_plan(model, DADConfig(mode="exact"))
    model(torch.randint(0, 40, (2, TOKENS)), extra=extra).float().pow(2).sum().backward()
    units = {u.name: u for u in plan.units}
    rows = {name: [concat_rows(use.pairs, use.kind, u.shape, u.param, use.block) for use in u.uses]
            for name, u in units.items()}
    return units, rows, params


def _verdicts(units, rows, sink=None, **kw):
    sink = sink or GradSink({})
    return {name: factors_rebuild_local_grad(u, rows[name], sink, **kw) for name, u in units.items()}


def test_every_layout_is_captured_and_sketched():
    units, rows, params = _step()
    assert set(WEIGHTS) <= set(units), set(units)
    for name in WEIGHTS:
        assert units[name].shape[1] > SKETCH_COLUMNS and sketch_matrix(units[name], SKETCH_COLUMNS,
                                                                       torch.float32) is not None
        assert any(r[0].shape[0] for r in rows[name]), name
    kinds = {k for u in units.values() for k in u.kinds}
    assert {"linear", "conv1d", "embedding"} <= kinds
    assert units["conv.weight"].blocks and units["mha.in_proj_weight"].blocks
    assert {b.param.shape[0] for b in units["c1d.weight"].biases} == {18}  # conv1d: the bias is the right
    assert units["lin.weight"].biases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exact_factors_pass(dtype):
    units, rows, params = _step(dtype)
    assert all(_verdicts(units, rows).values()), _verdicts(units, rows)


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 1.01), (torch.bfloat16, 1.25), (torch.float64, 1.0001)])
@pytest.mark.parametrize("target", ["emb.weight", "lin.weight", "c1d.weight", "conv.weight", "mha.in_proj_weight",
                                    "head.weight", "lin.bias", "c1d.bias", "mha.in_proj_bias"])
def test_a_hook_changing_one_gradient_fails_its_unit_only(dtype, factor, target):
    """A hook scaling one tensor by ``factor`` (ten times the tolerance in fp32, five in bf16): its
    unit fails (a bias alone fails its weight's unit), every other passes."""
    units, rows, params = _step(dtype, hooks=[(target, lambda g: g * factor)])
    owner = next(name for name, u in units.items() if any(p is params[target] for p in u.params))
    verdicts = _verdicts(units, rows)
    assert not verdicts[owner], (target, verdicts)
    assert all(ok for name, ok in verdicts.items() if name != owner), verdicts


def test_a_hook_adding_a_rank_one_change_fails():
    """An error of rank one (the sketch's worst case), ten times the fp32 tolerance."""
    def hook(g):
        u, v = torch.randn(g.shape[0], 1), torch.randn(1, g.shape[1])
        return g + 1e-2 * g.norm() * (u @ v) / (u.norm() * v.norm())
    units, rows, params = _step(hooks=[("lin.weight", hook)])
    assert not _verdicts(units, rows)["lin.weight"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_used_outside_its_layer_fails(dtype):
    units, rows, params = _step(dtype, extra=True)
    verdicts = _verdicts(units, rows)
    assert [name for name, ok in verdicts.items() if not ok] == ["lin.weight"], verdicts


def test_sketched_and_whole_checks_agree():
    """Far from the tolerance either way the verdict is the whole check's (``columns`` at least n:
    no sketch, every tensor compared whole)."""
    for factor in (1.0, 1.0 + 1e-5, 1.02, 0.5, -1.0):
        scale = (lambda g, f=factor: g * f)
        units, rows, params = _step(hooks=[("c1d.weight", scale), ("emb.weight", scale)])
        assert _verdicts(units, rows) == _verdicts(units, rows, columns=10 ** 6), factor


def test_the_check_leaves_the_users_random_stream_alone():
    units, rows, params = _step()
    state = torch.get_rng_state()
    _verdicts(units, rows)
    assert torch.equal(state, torch.get_rng_state())
    a = sketch_matrix(units["lin.weight"], 8, torch.float32)
    assert torch.equal(a, sketch_matrix(units["lin.weight"], 8, torch.float32))  # the same every run
    assert a.shape == (24, 8)


def test_a_weight_no_wider_than_the_sketch_is_checked_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 4))
    model[0].weight.register_hook(lambda g: g * 1.0015)  # 1.5 x the fp32 tolerance: whole, it fails
    plan = build_plan(model, DADConfig(mode="exact"))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    units = {u.name: u for u in plan.units}
    rows = {n: [concat_rows(c.pairs, c.kind, u.shape, u.param, c.block) for c in u.uses] for n, u in units.items()}
    assert sketch_matrix(units["0.weight"], SKETCH_COLUMNS, torch.float32) is None
    assert _verdicts(units, rows) == {"0.weight": False, "2.weight": True}


def test_under_fsdp2s_shard_sink():
    """FSDP2's sink: the local gradient read from the reduce-scatter input (one rank's rows padded,
    pre-divided), as `ShardSink.local_grad` gives it."""
    units, rows, params = _step(hooks=[("head.weight", lambda g: g * 1.01)])
    params = [p for u in units.values() for p in u.params]
    world, predivide = 2, 2.0
    slots, offset = [], 0
    for p in params:
        r = -(-p.shape[0] // world)
        numel = r * (p[0].numel() if p.dim() > 1 else 1)
        slots.append(ShardSlot("p", p, offset, numel, r, tuple(p.shape)))
        offset += numel
    inp = torch.zeros(world * offset)
    chunks = inp.view(world, offset)
    for s in slots:
        g = s.param.grad.float().reshape(s.param.shape[0], -1) / predivide
        padded = torch.zeros(world * s.rows, g.shape[1])
        padded[:g.shape[0]] = g
        chunks[:, s.offset:s.offset + s.numel] = padded.reshape(world, -1)
    sink = ShardSink(slots, torch.zeros(offset), inp, world, predivide=predivide)
    for s in slots:
        torch.testing.assert_close(sink.local_grad(s.param, torch.float32).reshape(s.param.shape), s.param.grad)
    verdicts = _verdicts(units, rows, sink)
    assert [name for name, ok in verdicts.items() if not ok] == ["head.weight"], verdicts


def test_sketched_rebuild_is_the_rebuild_times_the_sketch():
    """In every layout (blocks, riding biases, an embedding), whole and over row shards: the
    weight is ``G V``, the biases unchanged; without a sketch ``rebuild`` gives ``G`` itself."""
    units, rows, params = _step(torch.float64)
    for name, u in units.items():
        v = torch.randn(8, u.shape[1], dtype=torch.float64).t()
        whole = rebuild_unit(u, rows[name], torch.float64)
        sketched = rebuild_unit(u, rows[name], torch.float64, sketch=v)
        assert whole[u.param].shape == u.shape and whole[u.param].is_contiguous()
        torch.testing.assert_close(sketched[u.param], whole[u.param] @ v, rtol=1e-10, atol=1e-10)
        for b in u.biases:
            assert torch.equal(sketched[b.param], whole[b.param])
        torch.testing.assert_close(whole[u.param], u.param.grad.reshape(u.shape), rtol=1e-10, atol=1e-10)
        for dest in range(3):
            own = pairs(cut(u.kinds, u.shape, rows[name], torch.float64, u.blocks, RowShards(3), dest))
            args = (u.kinds, u.shape, [own], torch.float64, u.blocks, RowShards(3), dest, bias_uses(u))
            w, values = rebuild(*args)
            ws, values_s = rebuild(*args, sketch=v)
            torch.testing.assert_close(ws, w @ v, rtol=1e-10, atol=1e-10)
            assert all(torch.equal(a, b) for a, b in zip(values, values_s))


# 2 gloo ranks under torchrun (`workers/check_worker.py`, DDP as the reference with the same hooks):
# tests/workers/models.py's MLP, every weight wider than the sketch
HOOKED = {
    "sync-weight": {"config": {"mode": "exact"}, "grad_hooks": {"hidden.weight": 1.01}},
    "sync-bias": {"config": {"mode": "exact"}, "grad_hooks": {"inp.bias": 1.01}, "uneven": True},
    # a stated slow link: factors from the first step (on a fast one every weight may go dense by DDP's
    # buckets, and the check waits for the first step that sends factors: tests/test_ahead.py)
    "ddphook-auto-weight": {"config": {"mode": "auto", "link": {"bandwidth": "1mbit", "latency_us": 100}},
                            "grad_hooks": {"hidden.weight": 1.01}, "ddp_hook": True},
    "sync-none": {"config": {"mode": "exact"}},
}
DENSE = {"sync-weight": "hidden.weight", "sync-bias": "inp.weight", "ddphook-auto-weight": "hidden.weight"}


@pytest.fixture(scope="module")
def hooked(tmp_path_factory):
    return run_cases(tmp_path_factory, 2, {k: dict(v, kind="grad", model="mlp", steps=3) for k, v in HOOKED.items()})


@pytest.mark.parametrize("case_id", sorted(HOOKED))
def test_a_hooked_gradient_goes_dense_for_good_on_real_ranks(hooked, case_id):
    """A gradient hook scaling a weight (or only its bias) by 1.01: the unit fails the first step's
    check on both ranks, goes dense for good with the check's warning (rank 0), and every gradient
    equals DDP's under the same hook; without a hook nothing fails."""
    for rank, r in enumerate(result(hooked, case_id)):
        assert r["worst"] <= 1e-5, (rank, r["per_param"])
        warned = [line for line in r["warnings"] if "goes dense" in line]
        if case_id not in DENSE:
            assert r["dense_only"] == [] and not warned, (r["dense_only"], warned)
            continue
        name = DENSE[case_id]
        assert r["dense_only"] == [name], r["dense_only"]
        assert warned == ([] if rank else [
            f"dAD: the factors of {name!r} do not rebuild its local gradient on rank(s) [0, 1] (is the weight "
            f"used outside its layers, or changed by a gradient hook?); it goes dense from now on"]), warned
