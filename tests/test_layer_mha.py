"""The `mha` layer kind (``nn.MultiheadAttention``): exact factors equal DDP, one torchrun job on 2 ranks.

Every way the module calls ``F.linear`` (packed self-attention, cross-attention with ``key is
value``, three different inputs, separate ``q/k/v_proj_weight``), ``batch_first`` and
``need_weights`` both ways, masks, and PyTorch's encoder and decoder stacks: in mode exact every
gradient equals DDP's, every attention weight took "exact" (none went dense after the first-step
check), and the lossy routes keep the ranks bit-identical. The regression: without this kind,
``linear`` claimed ``out_proj`` (whose forward the module never calls) and the first-step check
sent it dense for good.
"""
from __future__ import annotations

import pytest

from conftest import result, run_cases

TOL = 1e-5  # fp32 round-off, relative, floored at 1e-6 of the whole gradient's norm
WITHOUT_MHA = ["linear", "conv1d", "embedding"]  # the kinds there were before `mha`

# model -> its attention modules' parameter-name prefixes and whether in_proj is packed
ATTN = {
    "mha_self": (["attn."], True),
    "mha_self_bf_noweights": (["attn."], True),
    "mha_masked": (["attn."], True),
    "mha_cross": (["attn."], True),
    "mha_qkv": (["attn."], True),
    "mha_kvdim": (["attn."], False),
    "mha_encoder": ([f"enc.layers.{i}.self_attn." for i in range(2)], True),
    "mha_decoder": ([f"dec.layers.{i}.{a}." for i in range(2) for a in ("self_attn", "multihead_attn")], True),
}
BYTES = ["mha_self", "mha_kvdim", "mha_decoder"]  # per-parameter routes: packed, separate, self + cross
TRAIN = {"auto": {"mode": "auto", "rank": 2}, "rank": {"mode": "rank", "rank": 2}}


def _weights(model: str):
    """The attention weights the kind captures (and the biases that ride with them)."""
    prefixes, packed = ATTN[model]
    weights = ["in_proj_weight"] if packed else ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    biases = ["in_proj_bias"] if packed else []
    return ([p + w for p in prefixes for w in weights + ["out_proj.weight"]],
            [p + b for p in prefixes for b in biases + ["out_proj.bias"]])


def _cases() -> dict:
    cases = {}
    for model in ATTN:
        cases[f"grad-{model}"] = {"kind": "grad", "model": model, "config": {"mode": "exact"}, "uneven": True}
    for model in BYTES:
        cases[f"bytes-{model}"] = {"kind": "bytes", "model": model, "config": {"mode": "exact"}}
    for model in ("mha_encoder", "mha_decoder"):
        for mode, cfg in TRAIN.items():
            cases[f"train-{model}-{mode}"] = {"kind": "train", "model": model, "config": cfg, "steps": 10}
    cases["grad-mha_encoder-ddp-hook"] = {"kind": "grad", "model": "mha_encoder", "config": {"mode": "exact"},
                                         "ddp_hook": True}
    cases["grad-mha_encoder-autocast-bf16"] = {"kind": "grad", "model": "mha_encoder", "config": {"mode": "exact"},
                                              "autocast": "bfloat16"}
    cases["grad-mha_self-without-mha"] = {"kind": "grad", "model": "mha_self",
                                          "config": {"mode": "exact", "layer_kinds": WITHOUT_MHA}}
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(tmp_path_factory, 2, _cases())


@pytest.mark.parametrize("model", list(ATTN))
def test_exact_equals_ddp(results, model):
    weights, _ = _weights(model)
    for rank, r in enumerate(result(results, f"grad-{model}")):
        assert r["worst"] <= TOL, f"rank {rank}: {r['per_param']}"
        assert r["dense_only"] == [], f"rank {rank}: failed the first-step check: {r['dense_only']}"
        assert set(weights) <= set(r["units"]), f"rank {rank}: {r['units']}"


@pytest.mark.parametrize("model", BYTES)
def test_attention_weights_take_exact(results, model):
    weights, biases = _weights(model)
    for rank, r in enumerate(result(results, f"bytes-{model}")):
        for step in r["steps"]:  # the first-step check's step and the next
            routes = {name: rep for name, rep, _, _ in step["params"]}
            assert {n: routes.get(n) for n in weights + biases} == {n: "exact" for n in weights + biases}, \
                f"rank {rank}: {routes}"


def test_kdim_vdim_extras_go_dense(results):
    """Separate q/k/v weights share in_proj_bias; bias_k/bias_v (1 x 1 x E) no kind captures."""
    for r in result(results, "bytes-mha_kvdim"):
        routes = {name: rep for name, rep, _, _ in r["steps"][-1]["params"]}
        assert routes["attn.in_proj_bias"] == "dense"
        assert routes["attn.bias_k"] == routes["attn.bias_v"] == "dense"


@pytest.mark.parametrize("case", [f"train-{m}-{mode}" for m in ("mha_encoder", "mha_decoder") for mode in TRAIN])
def test_lossy_routes_keep_ranks_identical(results, case):
    for r in result(results, case):
        assert r["identical"]
        assert r["losses"][-1] < r["losses"][0]


def test_ddp_hook_exact(results):
    weights, _ = _weights("mha_encoder")
    for r in result(results, "grad-mha_encoder-ddp-hook"):
        assert r["worst"] <= TOL, r["per_param"]
        assert r["dense_only"] == [] and set(weights) <= set(r["units"])


def test_autocast_bf16_keeps_factors(results):
    """bf16 output-gradient rows beside fp32 inputs still pass the first-step check; the result is as
    close to DDP's as bf16 allows (as tests/test_distributed.py's GPT-2 case)."""
    weights, _ = _weights("mha_encoder")
    for r in result(results, "grad-mha_encoder-autocast-bf16"):
        assert r["dense_only"] == [] and set(weights) <= set(r["units"])
        assert r["worst"] < 5e-2


def test_out_proj_regression(results):
    """Before `mha`: ``linear`` claimed ``out_proj``, whose forward MultiheadAttention never calls;
    no rows came, the first-step check failed and ``out_proj.weight`` went dense for good. Now it
    is exact (test_exact_equals_ddp on the same model and data); with the kind switched off,
    ``linear`` leaves it alone and it is a floor unit (no rows expected, no failed check)."""
    for r in result(results, "grad-mha_self-without-mha"):
        assert r["dense_only"] == []
        assert "attn.out_proj.weight" in r["units"]  # a unit without uses: dense in mode exact
        assert r["worst"] <= TOL
    for r in result(results, "grad-mha_self"):
        assert "attn.out_proj.weight" in r["units"] and r["dense_only"] == []


# -- in one process: the capture's torch function mode -----------------------------------------

def _attached(module):
    from dad_integrations.config import DADConfig
    from dad_integrations.capture.assign import build_plan
    return build_plan(module, DADConfig())


def _stack_depths(module):
    """The torch function mode stack's depth each time ``module``'s forward starts (after dAD's pre-hook)."""
    import torch
    depths = []
    module.register_forward_pre_hook(lambda m, a: depths.append(torch._C._len_torch_function_stack()))
    return depths


def test_without_grad_nothing_is_pushed():
    """no_grad/eval: dAD pushes no mode, so the module's fast path (``_native_multi_head_attention``)
    is as without dAD, output bit for bit; with grad the mode is pushed for the forward only."""
    import copy
    import torch
    from torch import nn
    torch.manual_seed(0)
    plain = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    mha = copy.deepcopy(plain)
    plan = _attached(mha)
    depths = _stack_depths(mha)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert torch.equal(mha(x, x, x)[0], plain(x, x, x)[0])
    mha(x, x, x)[0].sum().backward()
    assert depths == [0, 1] and torch._C._len_torch_function_stack() == 0
    assert [len(u.pairs) for u in plan.captures[0].uses] == [1, 0, 0, 0, 0, 1]  # in_proj whole, out_proj
    for c in plan.captures:
        c.remove()


def test_forward_that_raises_leaves_no_mode():
    import torch
    from torch import nn
    mha = nn.MultiheadAttention(8, 2)
    plan = _attached(mha)
    with pytest.raises(Exception):
        mha(torch.randn(3, 2, 8), torch.randn(4, 2, 7), torch.randn(4, 2, 7))  # wrong key width
    assert torch._C._len_torch_function_stack() == 0
    for c in plan.captures:
        c.remove()
