"""The planner (`python -m dad_integrations.plan`): presets, a local config.json, and its figures
against the router and the all-reduce formula. Meta-device models only: fast, no processes but one."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dad_integrations.config import DADConfig
from dad_integrations.plan import PRESETS, build_meta_model, load_config, main, max_positions
from dad_integrations.routing.planner import plan_model
from dad_integrations.routing.router import UnitShape, RouteContext, UnitEvidence, route

ROOT = Path(__file__).resolve().parents[1]


def run_json(capsys, *argv):
    assert main(list(argv) + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def check_sums(out, sites, param_bytes=None):
    units = out["units"]
    assert out["total"] == pytest.approx(sum(u["dad"] for u in units) + out["dense_dad"], rel=1e-9)
    assert out["allreduce"] == pytest.approx(sum(u["allreduce"] for u in units) + out["dense_allreduce"], rel=1e-9)
    assert out["powersgd"] == pytest.approx(sum(u["powersgd"] for u in units) + out["dense_powersgd"], rel=1e-9)
    assert sum(out["counts"].values()) == len(units)
    if param_bytes is not None:
        assert out["allreduce"] == pytest.approx(2 * (sites - 1) / sites * param_bytes, rel=1e-12)


def param_bytes(model, itemsize=4):
    seen = {id(p): p for p in model.parameters() if p.requires_grad}
    return sum(p.numel() for p in seen.values()) * itemsize


def test_cli_subprocess_gpt2_text_and_json():
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "dad_integrations.plan", "--model", "gpt2", "--sites", "8",
                           "--tokens-per-rank", "512", "--rank", "4"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "transformer.h.0.mlp.c_fc.weight" in proc.stdout and "dense parameters" in proc.stdout
    assert "dAD / all-reduce" in proc.stdout


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-large", "bert-base", "llama-small"])
def test_presets(capsys, preset):
    sites = 64
    out = run_json(capsys, "--model", preset, "--sites", str(sites), "--tokens-per-rank", "4096", "--rank", "4")
    model = build_meta_model(load_config(preset))
    check_sums(out, sites, param_bytes(model))
    assert out["total"] < out["allreduce"]  # rank-r at 64 sites beats all-reduce on all of these
    names = [u["name"] for u in out["units"]]
    assert len(names) == len(set(names)) > 0


def test_llama_7b_geometry_and_dtype(capsys):
    out = run_json(capsys, "--model", "llama-7b-geometry", "--sites", "16", "--tokens-per-rank", "2048",
                   "--rank", "8", "--dtype", "bfloat16")
    check_sums(out, 16)
    n_params = 32000 * 4096 * 2 + 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096
    assert out["allreduce"] == pytest.approx(2 * 15 / 16 * n_params * 2, rel=1e-12)
    assert len(out["units"]) == 32 * 7 + 2   # q k v o gate up down, embed_tokens, lm_head


def test_routes_match_router():
    """The planner's per-layer routes are `route()`'s steady-state decision."""
    cfg = load_config("gpt2-medium")
    model = build_meta_model(cfg)
    for mode, rank_route, sites, tokens in (("auto", "auto", 64, 4096), ("auto", "allgather", 8, 256),
                                            ("exact", "auto", 8, 64), ("auto", "auto", 4, 16)):
        step = plan_model(model, sites=sites, tokens_per_rank=tokens, rank=4, mode=mode, rank_route=rank_route,
                          positions=max_positions(cfg))
        by = {u.name: u for u in step.units}
        config = DADConfig(mode=mode, rank=None if mode == "exact" else 4, rank_route=rank_route)
        for name, kinds in (("transformer.h.3.mlp.c_fc.weight", ("conv1d",)),
                            ("transformer.wte.weight", ("embedding", "linear")),
                            ("transformer.wpe.weight", ("embedding",))):
            u = by[name]
            shape = UnitShape(kinds, u.shape, 4096 if name.endswith("c_fc.weight") else 0, torch.float32)
            rows = [u.rows] * sites
            decision = route(RouteContext(config, world_size=sites, wire_dtype=torch.float32), shape, UnitEvidence(last_rows=rows))
            if decision.representation is None:
                decision = route(RouteContext(config, world_size=sites, wire_dtype=torch.float32), shape, UnitEvidence(rows_by_rank=rows))
            assert u.route == decision.representation, (mode, rank_route, sites, name)
        assert by["transformer.wpe.weight"].rows == [min(tokens, 1024)]
        assert by["transformer.wte.weight"].rows == [tokens, tokens]
    # few rows: exact factors win the lossless choice
    step = plan_model(model, sites=8, tokens_per_rank=16, rank=None, positions=1024)
    assert step.counts["exact"] == len(step.units)


def test_local_config_json(capsys, tmp_path):
    cfg = {"model_type": "gpt2", "vocab_size": 1000, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 2,
           "architectures": ["GPT2LMHeadModel"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    for model_arg in (str(path), str(tmp_path)):
        out = run_json(capsys, "--model", model_arg, "--sites", "4", "--tokens-per-rank", "512", "--rank", "2",
                       "--mode", "exact")
        n = 1000 * 64 + 128 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64
        check_sums(out, 4, n * 4)
        assert set(u["route"] for u in out["units"]) == {"exact"}
        wpe = next(u for u in out["units"] if u["name"] == "transformer.wpe.weight")
        assert wpe["rows"] == [128]  # position rows capped at n_positions


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "no-such-model", "--sites", "4", "--tokens-per-rank", "8"])
    with pytest.raises(SystemExit):
        main(["--model", "gpt2", "--sites", "4", "--tokens-per-rank", "8", "--mode", "rank", "--rank", "0"])
    assert set(PRESETS) >= {"gpt2", "gpt2-medium", "gpt2-large", "bert-base", "llama-7b-geometry"}


def test_planner_imports_no_benchmarks_and_transformers_lazily():
    import ast

    for module in ("plan.py", "plan_models.py", "plan_cluster.py"):  # the command and its parts
        tree = ast.parse((ROOT / "dad_integrations" / module).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not any(n.startswith(("transformers", "benchmarks", "torch.distributed")) for n in names), \
            (module, names)
        every = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(n.startswith("benchmarks") for n in every), module


@pytest.mark.parametrize("preset", ["gpt2", "bert-base", "llama-small"])
def test_auto_never_sends_more_than_powersgd(preset):
    """Auto at rank r, on models with position embeddings (GPT-2: ``wpe``; BERT: position and
    token-type embeddings) and without (Llama), in steady state: at most PowerSGD's bytes at rank r,
    from 2 to 256 sites and few to many rows, in total and weight by weight."""
    from dad_integrations.routing.planner import steady_state
    from dad_integrations.capture.assign import build_plan

    model = build_meta_model(load_config(preset))
    plan = build_plan(model, DADConfig(mode="auto", rank=4))
    for c in plan.captures:
        c.remove()
    for sites in (2, 4, 64, 256):
        for tokens, positions in ((16, 16), (512, 128), (4096, 512)):
            step = steady_state(plan, tokens=tokens, positions=positions, world_size=sites, mode="auto", rank=4)
            assert step.total <= step.powersgd, (sites, tokens, step.total, step.powersgd)
            for u in step.units:
                assert u.dad <= u.powersgd * (1 + 1e-12) + 1e-9, (u.name, sites, tokens, u.route)


@pytest.mark.parametrize("model_name", ["gpt2", "llama-small"])
def test_sharded_plan_against_reduce_scatter(model_name, capsys):
    """`--sharded`: the baseline is FSDP2's reduce-scatter of every parameter (dim 0 padded to the
    sites), every unit's figures add up, mode exact routes every unit exact, and auto (lossless)
    never sends more than the reduce-scatter beyond its row-count exchange."""
    from dad_integrations.routing.costs import reduce_scatter_bytes

    sites, tokens = 8, 128
    cfg = load_config(model_name)
    model = build_meta_model(cfg)
    seen = {id(p): p for p in model.parameters() if p.requires_grad}
    expected_rs = sum(reduce_scatter_bytes(tuple(p.shape), sites, 4) for p in seen.values())
    for mode in ("exact", "auto"):
        out = run_json(capsys, "--model", model_name, "--sites", str(sites), "--tokens-per-rank", str(tokens),
                       "--rank", "0", "--mode", mode, "--sharded")
        units = out["units"]
        assert out["sharded"] is True
        assert out["reduce_scatter"] == pytest.approx(expected_rs, rel=1e-12)
        assert out["total"] == pytest.approx(sum(u["dad"] for u in units) + out["dense_reduce_scatter"], rel=1e-12)
        if mode == "exact":
            assert out["counts"] == {"exact": len(units)}
        for u in units:
            counts_exchange = (sites - 1) * 8.0 * len(u["rows"])
            assert u["dad"] <= u["reduce_scatter"] + counts_exchange or mode == "exact", u
        if mode == "auto":
            assert out["total"] < out["reduce_scatter"]  # few tokens per rank: factors pay somewhere


def test_sharded_plan_prices_rank_routes_with_the_routers_costs():
    """Under ``--sharded`` with a rank, a unit's bytes are the sharded rank routes' cost functions
    (the routes' ``row_shards`` byte models: all-gather of Q plus all-to-all of P's rows; or the all-reduce's),
    its biases' reduce-scatter and the row-count exchange: the planner, the router and the scale
    table share one formula. At 4 sites the tall weight takes the all-gather, the wide one the all-reduce."""
    from torch import nn

    from dad_integrations.routes import layouts
    from dad_integrations.routes.registry import UnitSizing, get_route
    from dad_integrations.routing.costs import reduce_scatter_bytes
    from dad_integrations.routing.planner import sharded_steady_state
    from dad_integrations.capture.assign import build_plan
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    plan = build_plan(model, DADConfig(mode="auto", rank=4))
    for c in plan.captures:
        c.remove()
    step = sharded_steady_state(plan, tokens=4096, positions=4096, world_size=4, mode="auto", rank=4)
    routes = {r.name: r for r in step.units}
    tall, wide = routes["0.weight"], routes["2.weight"]          # 256 x 64 and 64 x 256
    assert (tall.route, wide.route) == ("rank", "rank_allreduce")
    f32 = torch.float32

    def sharded(name, shape):  # the route's bytes on FSDP2's row shards, biases aside
        return get_route(name).bytes_on(layouts.ROW_SHARDS, UnitSizing((), shape, f32, f32, rank=4, world_size=4))

    assert tall.dad == sharded("rank", (256, 64)) + reduce_scatter_bytes((256,), 4, 4) + 3 * 8
    assert wide.dad == sharded("rank_allreduce", (64, 256)) + reduce_scatter_bytes((64,), 4, 4) + 3 * 8
    assert step.total < step.reduce_scatter
    # mode rank sends no row counts (`router.sharded_needs_counts`)
    ranked = {r.name: r for r in sharded_steady_state(plan, tokens=4096, positions=4096, world_size=4,
                                                      mode="rank", rank=4).units}
    assert ranked["0.weight"].dad == tall.dad - 3 * 8 and ranked["2.weight"].dad == wide.dad - 3 * 8


def test_bandwidth_prints_step_time_and_break_even(capsys, tmp_path):
    """``--bandwidth``: per layer the predicted seconds of all-reduce, PowerSGD and dAD (routes by
    time), totals and break-even bandwidths; dAD's prediction never exceeds all-reduce's."""
    args = ["--model", "gpt2", "--sites", "8", "--tokens-per-rank", "2048", "--rank", "4",
            "--compute-device", "none"]
    assert main(args + ["--bandwidth", "10gbit", "--latency-us", "20"]) == 0
    text = capsys.readouterr().out
    assert "dAD ms" in text and "all-reduce ms" in text and "PowerSGD ms" in text
    assert "dAD (its compressed routes) pays at any bandwidth" in text  # no compute counted
    out = run_json(capsys, *args, "--bandwidth", "10gbit", "--latency-us", "20")
    t = out["time"]
    assert t["dad"] <= t["allreduce"] + 1e-12
    assert t["dad"] == pytest.approx(sum(u["dad"] for u in t["units"]), rel=1e-9)
    assert t["allreduce"] == pytest.approx(out["allreduce"] / 1.25e9, rel=1e-9)  # bucketed: no latency
    # with compute: on a link fast enough, dAD sends what all-reduce sends (every weight dense),
    # and its break-even bandwidth is finite
    tiny = tmp_path / "config.json"  # small shapes: the compute model is measured for each
    tiny.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": 256,
                                "n_positions": 64}))
    small = ["--model", str(tiny), "--sites", "2", "--tokens-per-rank", "256", "--rank", "4"]
    out = run_json(capsys, *small, "--bandwidth", "10000gbit")
    assert set(u["route"] for u in out["time"]["by_time"]["units"]) == {"dense"}
    assert out["time"]["dad"] == pytest.approx(out["time"]["allreduce"], rel=1e-9)
    be = out["time"]["break_even"]
    assert 0 < be["dad"] < float("inf") and 0 < be["powersgd"] < float("inf")
    with pytest.raises(SystemExit):
        main(small + ["--bandwidth", "fast"])


# -- vision and speech: rows counted by a forward pass on the meta device ---------------------------------
def test_kind_column_names_the_registry_kinds(capsys):
    """Per layer the registry's kind: GPT-2's ``Conv1D`` weights ``conv1d``, the tied ``wte`` /
    ``lm_head`` weight ``embedding+linear``, ``wpe`` ``embedding``; the other parameters ``dense``."""
    out = run_json(capsys, "--model", "gpt2", "--sites", "8", "--tokens-per-rank", "512", "--rank", "4")
    kinds = {u["name"]: u["kind"] for u in out["units"]}
    assert kinds["transformer.h.0.mlp.c_fc.weight"] == "conv1d"
    assert kinds["transformer.wte.weight"] == "embedding+linear"
    assert kinds["transformer.wpe.weight"] == "embedding"
    assert main(["--model", "gpt2", "--sites", "8", "--tokens-per-rank", "512"]) == 0
    text = capsys.readouterr().out
    assert " kind " in text.splitlines()[2]
    assert re.search(r"dense parameters \(50\) +dense +38,400 el", text), text


def test_counted_rows_equal_the_text_formula_on_gpt2():
    """The forward count and the text formula agree where the formula holds: on GPT-2 every use
    sees batch x seq rows, ``wpe`` seq (looked up once for ``(1, seq)`` ids)."""
    from dad_integrations.routing.planner import count_rows, use_rows
    from dad_integrations.capture.assign import build_plan

    model = build_meta_model(load_config("gpt2"))
    plan = build_plan(model, DADConfig())
    batch, seq = 3, 40
    try:
        counted = count_rows(model, plan, {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device="meta")})
    finally:
        for c in plan.captures:
            c.remove()
    assert len(counted) == len(plan.units)
    for u in plan.units:
        assert counted[u.name] == [use_rows(c, batch * seq, seq) for c in u.uses], u.name


def test_counted_rows_of_a_cnn_are_images_times_output_positions():
    """A CNN on the meta device: a convolution captured by a layer kind counts images x output
    positions rows per use (a grouped one per group's block); one no kind captures is ``floor``
    (no uses: its dense gradient is routed), either way; the linear head counts images."""
    from torch import nn

    from dad_integrations.routing.planner import count_rows, steady_state, unit_kind
    from dad_integrations.capture.assign import build_plan

    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2, groups=2),
                              nn.ReLU(), nn.Flatten(), nn.Linear(16 * 7 * 7, 10))
    plan = build_plan(model, DADConfig())
    images = 5
    try:
        counted = count_rows(model, plan, {"input": torch.zeros(images, 3, 16, 16, device="meta")})
    finally:
        for c in plan.captures:
            c.remove()
    positions = {"0.weight": 16 * 16, "2.weight": 7 * 7}
    by = {u.name: u for u in plan.units}
    assert set(by) == {"0.weight", "2.weight", "5.weight"}
    assert counted["5.weight"] == [images] and unit_kind(by["5.weight"]) == "linear"
    for name, per_image in positions.items():
        u = by[name]
        assert u.uses and unit_kind(u) == "conv", (name, unit_kind(u))
        assert counted[name] == [images * per_image] * len(u.uses), (name, counted[name])
    step = steady_state(plan, tokens=0, positions=0, world_size=4, mode="auto", rank=2, rows=counted)
    assert step.total <= step.powersgd
    assert [r.shape for r in step.units if r.name == "2.weight"] == [(16, 4 * 9)]  # the matrix view


@pytest.mark.parametrize("preset", ["vit-tiny", "whisper-tiny"])
def test_vision_and_speech_presets_count_rows(capsys, preset):
    """ViT: images x (patches + 1) rows per linear layer, images for the classifier; the patch
    convolution is a unit (a kind's or the floor). Whisper: encoder layers and the decoder's
    cross-attention keys and values see clips x 1500 frames, the decoder clips x decoder tokens;
    its two encoder convolutions are units. Totals add up to all-reduce of every parameter, and
    auto sends at most PowerSGD's bytes."""
    batch, sites = 3, 8
    out = run_json(capsys, "--model", preset, "--sites", str(sites), "--batch-per-rank", str(batch), "--rank", "4")
    model = build_meta_model(load_config(preset))
    check_sums(out, sites, param_bytes(model))
    assert out["task"] == ("image" if preset.startswith("vit") else "speech")
    assert out["total"] <= out["powersgd"] * (1 + 1e-12)
    by = {u["name"]: u for u in out["units"]}
    if preset == "vit-tiny":
        tokens = batch * ((224 // 16) ** 2 + 1)
        assert by["vit.layers.0.mlp.fc1.weight"]["rows"] == [tokens]
        assert by["classifier.weight"]["rows"] == [batch]
        conv = by["vit.embeddings.patch_embeddings.projection.weight"]
        assert conv["shape"] == [192, 3 * 16 * 16]
        assert conv["kind"] == "conv" and conv["rows"] == [batch * (224 // 16) ** 2], conv
        assert by["vit.embeddings.position_embeddings"]["kind"] == "floor"
    else:
        assert by["model.encoder.layers.0.fc1.weight"]["rows"] == [batch * 1500]
        assert by["model.decoder.layers.0.fc1.weight"]["rows"] == [batch * 128]
        assert by["model.decoder.layers.0.encoder_attn.k_proj.weight"]["rows"] == [batch * 1500]
        assert by["model.decoder.layers.0.encoder_attn.q_proj.weight"]["rows"] == [batch * 128]
        assert by["model.decoder.embed_tokens.weight"]["kind"] == "embedding+linear"  # tied to proj_out
        assert {"model.encoder.conv1.weight", "model.encoder.conv2.weight"} <= set(by)


def test_vision_and_speech_auto_never_sends_more_than_powersgd():
    """Auto at rank r on ViT and Whisper, rows counted, few to many images and 2 to 256 sites: at
    most PowerSGD's bytes, in total and weight by weight (floor units included)."""
    from dad_integrations.plan import forward_rows
    from dad_integrations.routing.planner import steady_state
    from dad_integrations.capture.assign import build_plan

    for preset in ("vit-tiny", "whisper-tiny"):
        cfg = load_config(preset)
        model = build_meta_model(cfg)
        plan = build_plan(model, DADConfig(mode="auto", rank=4))
        for c in plan.captures:
            c.remove()
        for batch in (1, 32):
            rows = forward_rows(model, cfg, batch=batch, decoder_tokens=16)
            for sites in (2, 16, 256):
                step = steady_state(plan, tokens=0, positions=0, world_size=sites, mode="auto", rank=4, rows=rows)
                assert step.total <= step.powersgd, (preset, batch, sites)
                for u in step.units:
                    assert u.dad <= u.powersgd * (1 + 1e-12) + 1e-9, (preset, u.name, batch, sites, u.route)


def test_local_whisper_config_json_builds_the_speech_model(capsys, tmp_path):
    """A local Whisper config.json plans the encoder-decoder (not WhisperForCausalLM, the decoder
    alone), by its architectures; the sharded plan counts the same rows."""
    cfg = load_config("whisper-tiny").to_dict()
    cfg.update(encoder_layers=1, decoder_layers=1, max_source_positions=100)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = run_json(capsys, "--model", str(tmp_path), "--sites", "4", "--batch-per-rank", "2", "--rank", "4")
    names = {u["name"] for u in out["units"]}
    assert "model.encoder.layers.0.fc1.weight" in names and "model.encoder.conv1.weight" in names
    assert next(u for u in out["units"] if u["name"] == "model.encoder.layers.0.fc1.weight")["rows"] == [200]
    sharded = run_json(capsys, "--model", str(tmp_path), "--sites", "4", "--batch-per-rank", "2", "--rank", "4",
                       "--sharded")
    assert {u["name"]: u["rows"] for u in sharded["units"]} == {u["name"]: u["rows"] for u in out["units"]}


def test_rows_arguments_follow_the_model(capsys):
    with pytest.raises(SystemExit):  # a vision model's rows are counted: images, not tokens
        main(["--model", "vit-tiny", "--sites", "4", "--tokens-per-rank", "8"])
    with pytest.raises(SystemExit):
        main(["--model", "gpt2", "--sites", "4", "--batch-per-rank", "8"])
    with pytest.raises(SystemExit):
        main(["--model", "gpt2", "--sites", "4"])


# -- a cluster of nodes: two-level routes ---------------------------------------------------------------
SLOW_DEVICE = ["--compute-tflops", "1", "--compute-memory-bw", "50GB/s"]  # compute that dense can beat


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A two-layer Llama config.json: the planner's cluster runs take a second each."""
    path = tmp_path_factory.mktemp("tiny_llama") / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 4000, "max_position_embeddings": 512,
                                "architectures": ["LlamaForCausalLM"]}))
    return str(path)


def cluster_args(model, inter, *extra):
    return ["--model", model, "--nodes", "2", "--local-size", "4", "--tokens-per-rank", "512", "--rank", "4",
            "--intra-bw", "900GB/s", "--inter-bw", inter, *SLOW_DEVICE, *extra]


def test_cluster_flags_parse():
    from dad_integrations.plan import cluster_shape

    assert cluster_shape(8, None, None) == (8, 1, 8)            # --sites alone: one node
    assert cluster_shape(None, 4, 8) == (32, 4, 8)
    assert cluster_shape(32, None, 8) == (32, 4, 8) == cluster_shape(32, 4, None) == cluster_shape(32, 4, 8)
    for bad, message in (((12, None, 8), "--local-size 8 does not divide --sites 12"),
                         ((12, 5, None), "--nodes 5 does not divide"), ((None, 0, 8), "--nodes must be >= 1"),
                         ((None, 2, -1), "--local-size must be >= 1"), ((16, 4, 8), "is not --sites 16"),
                         ((None, 2, None), "--local-size"), ((None, None, None), "--sites")):
        with pytest.raises(ValueError, match=re.escape(message)):
            cluster_shape(*bad)


def test_bad_cluster_flags_give_a_clear_error(capsys, tiny_llama):
    for argv, message in (
            (["--sites", "12", "--local-size", "8"], "--local-size 8 does not divide --sites 12"),
            (["--nodes", "0", "--local-size", "8"], "--nodes must be >= 1"),
            (["--nodes", "2", "--local-size", "4", "--intra-bw", "900GB/s"], "give both --intra-bw and --inter-bw"),
            (["--nodes", "1", "--local-size", "4", "--intra-bw", "1gbit", "--inter-bw", "1gbit"], "--nodes > 1"),
            (cluster_args(tiny_llama, "fast"), "--inter-bw: bandwidth 'fast'"),
            (cluster_args(tiny_llama, "1gbit", "--bandwidth", "1gbit"), "--bandwidth is the one-level link"),
            (cluster_args(tiny_llama, "1gbit", "--sharded", "--engine", "zero3"), "is not planned in this version"),
            (cluster_args(tiny_llama, "1gbit", "--compute-device", "cpu"), "without --compute-device")):
        model = [] if argv[0] == "--model" else ["--model", tiny_llama, "--tokens-per-rank", "8"]
        with pytest.raises(SystemExit):
            main(model + argv)
        assert message in capsys.readouterr().err, argv


def test_two_level_table_prints(capsys, tiny_llama):
    assert main(cluster_args(tiny_llama, "10gbit")) == 0
    text = capsys.readouterr().out
    assert "two levels: 2 nodes x 4 ranks (8 sites)" in text
    head = next(line for line in text.splitlines() if line.startswith("layer") and "to owner MB" in line)
    for column in ("flat route", "flat MB", "between MB", "from owner MB", "compress below"):
        assert column in head
    assert re.search(r"predicted step of the factor units: flat [\d.,]+ ms, two levels [\d.,]+ ms: dAD runs "
                     r"(two levels|flat)", text)
    assert "break-even: two-level compressed routes beat hierarchical dense below" in text
    for method in ("all-reduce, flat", "PowerSGD, flat", "dAD, flat routes", "dAD, two levels"):
        assert method in text
    assert "8 sites" in text.splitlines()[0]  # the one-level table above covers the whole group


def test_slow_inter_link_compresses_between_nodes_fast_one_stays_dense(capsys, tiny_llama):
    """At 1 Gbit/s between nodes the big matrices compress on hop 2; at 10 Tbit/s they stay dense
    (the owner's compute costs more than the bytes it saves); the step's break-even bandwidth lies
    between, and so does each layer's; hop 1 is dense either way."""
    outs = {inter: run_json(capsys, *cluster_args(tiny_llama, inter))["two_level"] for inter in ("1gbit", "10000gbit")}
    big = ("mlp.up_proj", "mlp.down_proj", "embed_tokens", "lm_head")
    slow, fast = ({u["name"]: u for u in outs[k]["units"]} for k in ("1gbit", "10000gbit"))
    for name in slow:
        if any(b in name for b in big):
            assert slow[name]["route"] in ("rank", "rank_allreduce"), slow[name]
            assert slow[name]["between"] < slow[name]["to_owner"] / 10
            assert fast[name]["route"] == "dense", fast[name]
            assert slow[name]["to_owner"] == fast[name]["to_owner"]
            assert 1e9 / 8 < slow[name]["compresses_below"] < 1e13 / 8
    for out in outs.values():
        assert 1e9 / 8 < out["break_even"] < 1e13 / 8
        assert out["nodes"] == 2 and out["local_size"] == 4
        assert out["two_level"] == pytest.approx(sum(u["seconds"] for u in out["units"]))
        assert out["flat"] == pytest.approx(sum(u["flat_seconds"] for u in out["units"]))
        assert out["two_level_faster"] == (out["two_level"] < out["flat"])
    assert outs["1gbit"]["break_even"] == pytest.approx(outs["10000gbit"]["break_even"], rel=1e-6)  # one model
    slow_out = outs["1gbit"]
    assert slow_out["compressed"] < slow_out["all_dense"]
    nb = slow_out["node_bytes"]
    assert nb["dad_two_level"] < nb["powersgd"] < nb["allreduce"] and nb["allreduce_two_level"] < nb["allreduce"]


def test_break_even_separates_the_step_times(tiny_llama):
    """Just below the step's break-even the compressed routes are faster than hierarchical dense,
    just above they are not (the same plan, only the inter-node bandwidth moved)."""
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.planner import plan_levels_model, stated_compute

    cfg = load_config(tiny_llama)
    model = build_meta_model(cfg)
    shapes = [(4000, 256), (256, 256), (128, 256), (688, 256), (256, 688)]
    compute = stated_compute(shapes, rank=4, world_size=8, iterations=1, error_feedback=True, itemsize=4,
                             flops=1e12, memory_bw=50e9)

    def at(beta):
        return plan_levels_model(model, nodes=2, local_size=4, tokens_per_rank=512, rank=4,
                                 intra=LinkModel.uniform(900e9, 0.0), inter=LinkModel.uniform(beta, 0.0),
                                 compute=compute, positions=max_positions(cfg))

    be = at(1e9).break_even
    below, above = at(be * 0.99), at(be * 1.01)
    assert below.compressed < below.all_dense and above.compressed > above.all_dense
    assert below.break_even == pytest.approx(be, rel=1e-6)


def test_planner_decides_flat_or_two_levels_as_the_exchanger_does(tiny_llama):
    """`compare_levels` (the planner's comparison) returns `TwoLevelExchanger.predicted_seconds`'
    two figures for a plan whose units all may take every route."""
    from types import SimpleNamespace

    from dad_integrations.comm.topology import Topology
    from dad_integrations.exchange.levels import Levels
    from dad_integrations.exchange.two_level import TwoLevelExchanger
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.planner import stated_compute, unit_plan
    from dad_integrations.routing.timing import StepTiming
    from dad_integrations.routing.two_level import LevelUnit, TwoLevelTiming, compare_levels

    model = build_meta_model(load_config(tiny_llama))
    plan, rank = unit_plan(model, mode="auto", rank=4, rank_route="auto")
    topo = Topology.consecutive(8, 4, 0)
    config = DADConfig(rank=rank, objective="time")
    compute = stated_compute([u.shape for u in plan.units], rank=4, world_size=8, iterations=1, error_feedback=True,
                             itemsize=4, flops=1e12, memory_bw=50e9)
    for inter, tokens in ((1e9 / 8, 512), (1e12, 512), (1e10, 16)):
        intra, link = LinkModel.uniform(900e9, 1e-6), LinkModel.uniform(inter, 5e-6)
        timing, flat_timing = TwoLevelTiming(intra, link, compute), StepTiming(link, compute)
        rows = {u.index: [[tokens] * len(u.kinds)] * 8 for u in plan.units}
        ex = TwoLevelExchanger.__new__(TwoLevelExchanger)  # only what predicted_seconds reads
        ex.plan, ex.config, ex.wire_dtype, ex.N, ex.L = plan, config, None, 2, 4
        ex.world, ex.levels = SimpleNamespace(world_size=8), Levels(topo, None, None, timing)
        units = [LevelUnit(UnitShape(tuple(u.kinds), u.shape, u.bias_numel, torch.float32, u.blocks), rows[u.index],
                           torch.float32) for u in plan.units]
        for step in (0, config.lossless_steps + 1):
            got = compare_levels(config, units, step=step, topology=topo, flat_timing=flat_timing, timing=timing)
            assert (got.flat, got.two_level) == pytest.approx(ex.predicted_seconds(step, rows, flat_timing), rel=1e-12)


def test_stated_compute_is_a_roofline():
    from dad_integrations.routing.planner import stated_compute

    fast = stated_compute([(4096, 4096)], rank=4, world_size=8, iterations=1, error_feedback=True, itemsize=4,
                          flops=1e15, memory_bw=1e12).shapes[(4096, 4096)]
    # memory-bound at rank 4: the compensation, two power-iteration passes, the residual, the rebuild
    assert fast.rank_allreduce == pytest.approx(9 * 4096 * 4096 * 4 / 1e12)
    slow = stated_compute([(4096, 4096)], rank=4, world_size=8, iterations=1, error_feedback=True, itemsize=4,
                          flops=1e9, memory_bw=1e15).shapes[(4096, 4096)]
    assert slow.rank_allreduce == pytest.approx((4 + 2) * 4096 * 4096 * 4 / 1e9)   # flops-bound: 4 k m n r + 2 m n r
    assert slow.rank > slow.rank_allreduce and slow.exact_per_row == pytest.approx(2 * 4096 * 4096 / 1e9)


def test_llama_3_8b_geometry():
    cfg = load_config("llama-3-8b-geometry")
    model = build_meta_model(cfg)
    n = 128256 * 4096 * 2 + 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096
    assert sum(p.numel() for p in model.parameters()) == n and max_positions(cfg) == 8192
    assert "llama-3-8b-geometry" in PRESETS
