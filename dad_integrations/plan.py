"""Plan before launching: per layer, the route dAD takes in steady state and the bytes it sends.

    python -m dad_integrations.plan --model gpt2-medium --sites 64 --tokens-per-rank 4096 --rank 4

    python -m dad_integrations.plan --model vit-base --sites 16 --batch-per-rank 32 --rank 4

``--model`` is a preset (see `PRESETS`) or a local Hugging Face ``config.json`` (or its folder).
The model is built on the meta device (no weights, no downloads); the units, routes and bytes come
from the synchroniser's own plan, router and cost model through `routing.planner`, beside dense all-reduce and PyTorch's PowerSGD hook at the same rank. Each layer shows
its kind: the `layers` registry's kind that captures it (``linear``, ``conv1d``, ``embedding``,
``conv``, ...), ``floor`` for a matrix no kind captures (PowerSGD's coverage floor: dense or the
rank routes from its dense gradient), and ``dense`` for the parameters outside the units.

Rows per step and rank, two ways:

- Text models (``--tokens-per-rank``), by formula: every captured call sees ``tokens_per_rank``
  rows, except position embeddings, which Hugging Face looks up once for ``(1, seq)`` ids (``seq``
  = the tokens, at most the model's positions).
- Vision and speech models (``--batch-per-rank``: images or audio clips), by counting: one forward
  and backward of a dummy batch on the meta device (shapes only, no arithmetic) with the plan's
  captures enabled, each use's rows summed over its calls. A convolution's rows are images x
  output positions, a ViT's linear layers see images x (patches + 1): the count needs no formula
  per architecture, only the kinds' own captures.

Figures are bytes one rank sends per step, after the first (checked) step.

A cluster of nodes (``--nodes``, ``--local-size``, ``--intra-bw``, ``--inter-bw``) adds the
two-level plan (`routing.planner.plan_levels`): per layer the route between nodes and the bytes of
each hop beside the flat route, whether dAD runs the step flat or at two levels, the inter-node
bandwidth below which compressing between nodes beats a hierarchical all-reduce, and the bytes each
node sends between nodes. The routes' compute is measured on ``--compute-device`` or stated
(``--compute-tflops``, ``--compute-memory-bw``: a roofline, for a device not at hand).

    python -m dad_integrations.plan --model llama-3-8b-geometry --nodes 4 --local-size 8 \
        --intra-bw 900GB/s --inter-bw 100gbit --tokens-per-rank 4096 --rank 4 \
        --compute-tflops 67 --compute-memory-bw 3.35TB/s
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from dataclasses import asdict
from typing import Dict, Optional, Sequence, Tuple

import torch

from dad_integrations.capture.assign import build_plan
from dad_integrations.config import DADConfig
from dad_integrations.routing.planner import (RowCounts, StepPlan, count_rows, plan_levels_model, plan_model,
                                              plan_sharded_model, render, render_levels, render_sharded)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- Hugging Face models on the meta device ----------------------------------------------------------
PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "bert-base", "llama-7b-geometry", "llama-3-8b-geometry",
           "llama-small", "vit-tiny", "vit-base", "whisper-tiny", "whisper-base")


def preset_config(name: str):
    """The Hugging Face config of a named preset (geometry only: nothing is downloaded)."""
    import transformers as tf

    if name in ("gpt2", "gpt2-medium", "gpt2-large"):
        d, layers, heads = {"gpt2": (768, 12, 12), "gpt2-medium": (1024, 24, 16), "gpt2-large": (1280, 36, 20)}[name]
        return tf.GPT2Config(vocab_size=50257, n_positions=1024, n_embd=d, n_layer=layers, n_head=heads)
    if name == "bert-base":
        return tf.BertConfig()  # bert-base-uncased
    if name == "llama-7b-geometry":
        return tf.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                              num_attention_heads=32, vocab_size=32000)
    if name == "llama-3-8b-geometry":  # grouped-query attention: k and v project to 8 heads (1024 x 4096)
        return tf.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                              max_position_embeddings=8192)
    if name == "llama-small":
        return tf.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                              num_attention_heads=8, vocab_size=32000)
    if name in ("vit-tiny", "vit-base"):  # ViT-Ti/16 and ViT-B/16 at 224 x 224, ImageNet's 1000 classes
        d, heads = {"vit-tiny": (192, 3), "vit-base": (768, 12)}[name]
        return tf.ViTConfig(hidden_size=d, num_hidden_layers=12, num_attention_heads=heads, intermediate_size=4 * d,
                            image_size=224, patch_size=16, num_labels=1000,
                            architectures=["ViTForImageClassification"])
    if name in ("whisper-tiny", "whisper-base"):  # openai/whisper-tiny and -base geometry
        d, layers, heads = {"whisper-tiny": (384, 4, 6), "whisper-base": (512, 6, 8)}[name]
        return tf.WhisperConfig(vocab_size=51865, num_mel_bins=80, d_model=d, encoder_layers=layers,
                                decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
                                encoder_ffn_dim=4 * d, decoder_ffn_dim=4 * d,
                                architectures=["WhisperForConditionalGeneration"])
    raise ValueError(f"unknown model preset {name!r}; presets: {PRESETS}, or a path to a config.json")


def load_config(model: str):
    """A preset's config, or a local ``config.json`` (a file or its folder), read offline."""
    if model in PRESETS:
        return preset_config(model)
    path = Path(model)
    if not path.exists():
        raise ValueError(f"--model {model!r}: not a preset {PRESETS} and no such file")
    from transformers import AutoConfig

    if path.is_dir():
        path = path / "config.json"
    if "model_type" not in json.loads(path.read_text()):
        raise ValueError(f"{path}: no 'model_type' key")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def model_task(config) -> str:
    """What ``config`` builds: ``"image"`` (image classification: ViT, ResNet, ...), ``"speech"``
    (speech-to-text encoder-decoder: Whisper) or ``"text"`` (causal or masked LM, the rest).
    By the config's ``architectures`` where they say, else by which auto class maps its type."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSpeechSeq2Seq

    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForImageClassification") for a in archs):
        return "image"
    if any(a.endswith("ForConditionalGeneration") for a in archs) and _maps(AutoModelForSpeechSeq2Seq, config):
        return "speech"
    if archs or _maps(AutoModelForCausalLM, config):
        return "text"
    if _maps(AutoModelForImageClassification, config):
        return "image"
    if _maps(AutoModelForSpeechSeq2Seq, config):
        return "speech"
    return "text"


def _maps(auto, config) -> bool:
    try:
        return type(config) in auto._model_mapping
    except Exception:  # a mapping entry whose module fails to import
        return False


def build_meta_model(config) -> torch.nn.Module:
    """The model of ``config`` on the meta device: an image classifier or a speech-to-text model
    where `model_task` says so; else a masked LM where its architectures say so, else a causal LM
    (falling back to a masked LM for encoder-only types)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForMaskedLM
    from transformers import AutoModelForSpeechSeq2Seq

    task = model_task(config)
    if task != "text":
        auto = AutoModelForImageClassification if task == "image" else AutoModelForSpeechSeq2Seq
        with torch.device("meta"):
            return auto.from_config(config)
    archs = getattr(config, "architectures", None) or []
    masked = any("MaskedLM" in a for a in archs) or config.model_type == "bert"
    order = (AutoModelForMaskedLM, AutoModelForCausalLM) if masked else (AutoModelForCausalLM, AutoModelForMaskedLM)
    with torch.device("meta"):
        try:
            return order[0].from_config(config)
        except ValueError:
            return order[1].from_config(config)


def max_positions(config) -> Optional[int]:
    """Position-embedding rows of ``config`` (None where it has no such table)."""
    for key in ("n_positions", "max_position_embeddings"):
        v = getattr(config, key, None)
        if v:
            return int(v)
    return None


def dummy_batch(model: torch.nn.Module, config, batch: int, decoder_tokens: int) -> Dict[str, torch.Tensor]:
    """Keyword inputs of one step of ``batch`` examples per rank, on the model's device: images
    of the config's size, or Whisper's log-mel features (``2 x max_source_positions`` frames, the
    30 s its encoder requires) with ``decoder_tokens`` decoder tokens per clip."""
    device = next(model.parameters()).device
    name = getattr(model, "main_input_name", "input_ids")
    if name == "pixel_values":
        size = getattr(config, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        return {"pixel_values": torch.zeros(batch, getattr(config, "num_channels", 3), h, w, device=device)}
    if name == "input_features" and hasattr(config, "max_source_positions"):
        feats = torch.zeros(batch, config.num_mel_bins, 2 * config.max_source_positions, device=device)
        ids = torch.ones(batch, decoder_tokens, dtype=torch.long, device=device)
        return {"input_features": feats, "decoder_input_ids": ids}
    raise ValueError(f"no dummy batch known for {type(model).__name__} (input {name!r}); "
                     f"give --tokens-per-rank for a text model")


def forward_rows(model: torch.nn.Module, config, *, batch: int, decoder_tokens: int = 128) -> RowCounts:
    """`count_rows` for a dummy batch (`dummy_batch`) of ``batch`` examples per rank, on a plan
    built for it (which parameters are units does not depend on the mode); hooks removed after."""
    plan = build_plan(model, DADConfig())
    try:
        return count_rows(model, plan, dummy_batch(model, config, batch, decoder_tokens))
    finally:
        for c in plan.captures:
            c.remove()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m dad_integrations.plan", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"a preset {PRESETS} or a path to a config.json")
    p.add_argument("--sites", type=int, help="number of ranks (S); or --nodes and --local-size")
    p.add_argument("--tokens-per-rank", type=int, help="text models: tokens per rank per step")
    p.add_argument("--batch-per-rank", type=int,
                   help="vision and speech models: images (or audio clips) per rank per step; rows are "
                        "counted by a forward and backward of such a dummy batch on the meta device")
    p.add_argument("--decoder-tokens", type=int, default=128,
                   help="speech models (Whisper): decoder tokens per clip (default 128)")
    p.add_argument("--rank", type=int, default=4, help="rank of rank-dAD and PowerSGD (0: none)")
    p.add_argument("--mode", choices=("auto", "exact", "rank"), default="auto")
    # the synchroniser's own default, so that the plan shows what a default config does
    p.add_argument("--rank-route", choices=("auto", "allgather", "allreduce"), default=DADConfig.rank_route)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="gradient and wire dtype")
    p.add_argument("--sharded", action="store_true",
                   help="plan for FSDP2 (each rank keeps a shard; the baseline is a reduce-scatter)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--bandwidth", help="a link to predict step time on, e.g. 10gbit, 100mbit (per rank); "
                                       "routes are then chosen by time, as objective 'time' does")
    p.add_argument("--latency-us", type=float, default=0.0, help="the link's latency per collective call")
    p.add_argument("--compute-device",
                   help="where the routes' local compute is measured for the model's weight shapes "
                        "(cpu, the default; cuda, ...), or none to count no compute")
    p.add_argument("--compute-tflops", type=float,
                   help="instead of measuring: the device's flop rate (TFLOP/s), with --compute-memory-bw")
    p.add_argument("--compute-memory-bw",
                   help="instead of measuring: the device's memory bandwidth, e.g. 3.35TB/s, with --compute-tflops")
    cluster = p.add_argument_group("a cluster of nodes (two-level routes)")
    cluster.add_argument("--nodes", type=int, help="nodes (N); sites = nodes x local size")
    cluster.add_argument("--local-size", type=int, help="ranks per node (L)")
    cluster.add_argument("--intra-bw", help="the link inside a node, per rank, e.g. 900GB/s")
    cluster.add_argument("--inter-bw", help="the link between nodes, each rank's share with every rank "
                                            "sending (the config's link.inter), e.g. 100gbit")
    cluster.add_argument("--intra-latency-us", type=float, default=0.0, help="latency per call inside a node")
    cluster.add_argument("--inter-latency-us", type=float, default=0.0, help="latency per call between nodes")
    args = p.parse_args(argv)
    try:
        args.sites, args.nodes, args.local_size = cluster_shape(args.sites, args.nodes, args.local_size)
        two_level = _check_levels(args)
    except ValueError as e:
        p.error(str(e))
    if args.sites < 2 or args.rank < 0 or args.decoder_tokens < 1:
        p.error("need --sites >= 2, --rank >= 0, --decoder-tokens >= 1")
    if (args.tokens_per_rank is not None and args.tokens_per_rank < 1) or (
            args.batch_per_rank is not None and args.batch_per_rank < 1):
        p.error("need --tokens-per-rank >= 1 and --batch-per-rank >= 1")
    if args.mode == "rank" and not args.rank:
        p.error("--mode rank needs a rank (--rank >= 1)")
    try:
        cfg = load_config(args.model)
        task = model_task(cfg)
        model = build_meta_model(cfg)
        rows = None
        if task == "text":
            if args.tokens_per_rank is None or args.batch_per_rank is not None:
                raise ValueError(f"--model {args.model!r} is a text model: give --tokens-per-rank "
                                 f"(not --batch-per-rank)")
        else:
            if args.batch_per_rank is None or args.tokens_per_rank is not None:
                raise ValueError(f"--model {args.model!r} is a {task} model: give --batch-per-rank (its rows "
                                 f"are counted by a forward pass), not --tokens-per-rank")
            rows = forward_rows(model, cfg, batch=args.batch_per_rank, decoder_tokens=args.decoder_tokens)
            args.tokens_per_rank = 0  # (the formula is not used)
        planner = plan_sharded_model if args.sharded else plan_model
        step = planner(model, sites=args.sites, tokens_per_rank=args.tokens_per_rank, rank=args.rank or None,
                       mode=args.mode, rank_route=args.rank_route, dtype=DTYPES[args.dtype],
                       positions=max_positions(cfg), rows=rows)
        timed = None
        if args.bandwidth is not None:
            if args.sharded:
                raise ValueError("--bandwidth: the step-time prediction covers unsharded plans only")
            timed = _time_plan(args, model, cfg, step, rows)
        levels = _level_plan(args, model, cfg, step, rows) if two_level else None
    except ValueError as e:
        p.error(str(e))
    if args.json:
        out = {"model": args.model, "task": task, "sites": args.sites, "tokens_per_rank": args.tokens_per_rank,
               "batch_per_rank": args.batch_per_rank, "sharded": args.sharded, "rank": args.rank, "mode": args.mode,
               "rank_route": args.rank_route, "dtype": args.dtype,
               **asdict(step)}
        if timed is not None:
            out["time"] = asdict(timed[0])
            out["time"]["by_time"] = asdict(timed[1])
        if levels is not None:
            out["two_level"] = {**asdict(levels[0]), "intra": levels[1].to_spec(), "inter": levels[2].to_spec(),
                                "compute": levels[3]}
        print(json.dumps(out, indent=1))
    else:
        per_rank = (f"{args.tokens_per_rank} tokens per rank" if task == "text" else
                    f"{args.batch_per_rank} {'images' if task == 'image' else 'clips'} per rank (rows counted)")
        header = (f"{args.model}: {args.sites} sites, {per_rank}, mode {args.mode}, "
                  f"rank {args.rank or '-'}, rank route {args.rank_route}, {args.dtype}"
                  f"{', sharded (FSDP2)' if args.sharded else ''}; MB one rank sends per steady-state step")
        print((render_sharded if args.sharded else render)(step, header))
        if timed is not None:
            from dad_integrations.routing.plan_time import render_time
            print()
            print(render_time(timed[0], timed[2], timed[3]))
        if levels is not None:
            print()
            print(render_levels(levels[0], _levels_header(args, *levels[1:])))
    return 0


def _time_plan(args, model: torch.nn.Module, cfg, by_bytes: StepPlan, rows: Optional[RowCounts] = None):
    """The plan by predicted time on the stated link: (time plan, the steady state by time, link, note)."""
    from dad_integrations.comm.link_spec import parse_bandwidth
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.plan_time import time_plan
    from dad_integrations.routing.timing import StepTiming

    link = LinkModel.uniform(parse_bandwidth(args.bandwidth), args.latency_us * 1e-6)
    compute, note = compute_model(args, {tuple(r.shape) for r in by_bytes.units})
    timing = StepTiming(link, compute)
    by_time = plan_model(model, sites=args.sites, tokens_per_rank=args.tokens_per_rank, rank=args.rank or None,
                         mode=args.mode, rank_route=args.rank_route, dtype=DTYPES[args.dtype],
                         positions=max_positions(cfg), timing=timing, rows=rows)
    return time_plan(by_time, timing, sites=args.sites, compressed=by_bytes), by_time, link, note


def cluster_shape(sites: Optional[int], nodes: Optional[int], local_size: Optional[int]) -> Tuple[int, int, int]:
    """``(sites, nodes, ranks per node)`` from the flags given: ``--sites`` alone is one node;
    any two of the three give the third; all three must agree. Raises ValueError naming the flags."""
    for flag, value in (("--nodes", nodes), ("--local-size", local_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if nodes is None and local_size is None:
        if sites is None:
            raise ValueError("give --sites, or --nodes and --local-size")
        return sites, 1, sites
    if sites is None:
        if nodes is None or local_size is None:
            raise ValueError("give --nodes and --local-size (or --sites with one of them)")
        return nodes * local_size, nodes, local_size
    if local_size is not None and sites % local_size:
        raise ValueError(f"--local-size {local_size} does not divide --sites {sites}: every node holds "
                         "the same number of ranks")
    if nodes is not None and sites % nodes:
        raise ValueError(f"--nodes {nodes} does not divide --sites {sites}: every node holds the same "
                         "number of ranks")
    local = local_size if local_size is not None else sites // nodes
    if nodes is not None and nodes * local != sites:
        raise ValueError(f"--nodes {nodes} x --local-size {local} is not --sites {sites}")
    return sites, sites // local, local


def _check_levels(args) -> bool:
    """Whether the plan has two levels (more than one node of more than one rank); checks that
    the flags for them come together. Raises ValueError naming the flags."""
    two_level = args.nodes > 1 and args.local_size > 1
    stated = [f for f, v in (("--intra-bw", args.intra_bw), ("--inter-bw", args.inter_bw)) if v is not None]
    if not two_level:
        if stated:
            raise ValueError(f"{', '.join(stated)}: two-level routes need --nodes > 1 and --local-size > 1 "
                             f"(got {args.nodes} x {args.local_size}); use --bandwidth for one level")
        return False
    if len(stated) < 2:
        raise ValueError(f"{args.nodes} nodes x {args.local_size} ranks: give both --intra-bw and --inter-bw")
    if args.bandwidth is not None:
        raise ValueError("--bandwidth is the one-level link; on nodes, the flat routes run on --inter-bw")
    if args.sharded:
        raise ValueError("--sharded: two-level routes cover unsharded plans only")
    if args.intra_latency_us < 0 or args.inter_latency_us < 0:
        raise ValueError("latencies must be >= 0")
    return True


def compute_model(args, shapes):
    """The routes' compute model for weights of ``shapes`` and a note saying where it came from:
    stated (``--compute-tflops``, ``--compute-memory-bw``: `routing.planner.stated_compute`),
    measured on ``--compute-device`` (default cpu), or none."""
    from dad_integrations.capture.rows import compute_dtype
    from dad_integrations.comm.link_spec import parse_bandwidth
    from dad_integrations.routing.compute_model import ComputeModel, measure_compute
    from dad_integrations.routing.planner import stated_compute

    rank = args.rank if args.rank and args.mode != "exact" else None
    dtype = compute_dtype(DTYPES[args.dtype])  # as the codecs compute
    stated = (args.compute_tflops, args.compute_memory_bw)
    if any(v is not None for v in stated):
        if None in stated or args.compute_device is not None:
            raise ValueError("state the compute with both --compute-tflops and --compute-memory-bw, "
                             "and without --compute-device")
        if not 0 < args.compute_tflops < float("inf"):
            raise ValueError(f"--compute-tflops must be positive, got {args.compute_tflops}")
        try:
            memory = parse_bandwidth(args.compute_memory_bw)
        except ValueError as e:
            raise ValueError(f"--compute-memory-bw: {e}") from None
        compute = stated_compute(shapes, rank=rank, world_size=args.sites, iterations=DADConfig.power_iterations,
                                 error_feedback=DADConfig.error_feedback, itemsize=dtype.itemsize,
                                 flops=args.compute_tflops * 1e12, memory_bw=memory)
        return compute, (f"compute stated: {args.compute_tflops:g} TFLOP/s, {memory / 1e12:.3g} TB/s "
                         "(a roofline, no launches)")
    device = args.compute_device or "cpu"
    if device == "none":
        return ComputeModel(), "no compute counted"
    compute = measure_compute(shapes, rank=rank, world_size=args.sites, iterations=DADConfig.power_iterations,
                              error_feedback=DADConfig.error_feedback, device=torch.device(device), dtype=dtype)
    return compute, f"compute measured on {device}"


def _level_plan(args, model: torch.nn.Module, cfg, by_bytes: StepPlan, rows: Optional[RowCounts] = None):
    """The plan on ``--nodes`` x ``--local-size``: (level plan, intra link, inter link, compute note)."""
    from dad_integrations.comm.link_spec import parse_bandwidth
    from dad_integrations.routing.link import LinkModel

    links = []
    for flag, bw, latency in (("--intra-bw", args.intra_bw, args.intra_latency_us),
                              ("--inter-bw", args.inter_bw, args.inter_latency_us)):
        try:
            links.append(LinkModel.uniform(parse_bandwidth(bw), latency * 1e-6))
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    compute, note = compute_model(args, {tuple(r.shape) for r in by_bytes.units})
    plan = plan_levels_model(model, nodes=args.nodes, local_size=args.local_size,
                             tokens_per_rank=args.tokens_per_rank, rank=args.rank or None, intra=links[0],
                             inter=links[1], compute=compute, mode=args.mode, rank_route=args.rank_route,
                             dtype=DTYPES[args.dtype], positions=max_positions(cfg), rows=rows)
    return plan, links[0], links[1], note


def _levels_header(args, intra, inter, note: str) -> str:
    """The two-level table's first line: the cluster, both links and the compute model."""
    def link(m) -> str:
        c = m.all_reduce
        return f"{c.beta * 8 / 1e9:,.4g} Gbit/s + {c.alpha * 1e6:g} us"

    return "\n".join([
        f"two levels: {args.nodes} nodes x {args.local_size} ranks ({args.sites} sites); links per rank: inside a "
        f"node {link(intra)}, between nodes {link(inter)}; {note}",
        "flat: the routes on the link between nodes; two levels: to the owner inside the node, between nodes "
        f"(owners only), from the owner; hop 2 and the owner's compute count 1/{args.local_size} (owners run side "
        "by side)",
        "MB: what one rank sends per step; ms: the unit's predicted share of the step; compress below: the "
        "inter-node Gbit/s below which the unit leaves dense at two levels"])


if __name__ == "__main__":
    sys.exit(main())
