"""Plan before launching: per layer, the route dAD takes in steady state and the bytes it sends.

    python -m dad_integrations.plan --model gpt2-medium --sites 64 --tokens-per-rank 4096 --rank 4

    python -m dad_integrations.plan --model vit-base --sites 16 --batch-per-rank 32 --rank 4

``--model`` is a preset (see `PRESETS`) or a local Hugging Face ``config.json`` (or its folder),
built on the meta device (no weights, no downloads); `routing.planner` plans its steady state. Each
layer shows its kind (`routing.planner.unit_kind`), ``dense`` for the parameters outside the units.

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
two-level plan (`routing.planner.plan_levels`). The routes' compute is measured on
``--compute-device`` or stated (``--compute-tflops``, ``--compute-memory-bw``: a roofline).

    python -m dad_integrations.plan --model llama-3-8b-geometry --nodes 4 --local-size 8 \
        --intra-bw 900GB/s --inter-bw 100gbit --tokens-per-rank 4096 --rank 4 \
        --compute-tflops 67 --compute-memory-bw 3.35TB/s
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional, Sequence


from dad_integrations.config import DADConfig
# the models and the cluster options live in plan_models and plan_cluster; every name is importable here too
from dad_integrations.plan_cluster import (_check_levels, _level_plan, _levels_header, _sharded_plans,  # noqa: F401
                                           _time_plan, cluster_shape, compute_model, plan_options)
from dad_integrations.plan_models import (DTYPES, PRESETS, build_meta_model, dummy_batch, forward_rows,  # noqa: F401
                                          load_config, max_positions, model_task, preset_config)
from dad_integrations.routing.planner import plan_model, render, render_levels, render_sharded


def _parser() -> argparse.ArgumentParser:
    """The command's options (see the module docstring)."""
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
                   help="plan for a sharded engine (each rank keeps a shard; the baseline is a reduce-scatter): "
                        "FSDP2 by default, HSDP on --nodes x --local-size")
    p.add_argument("--engine", choices=("fsdp2", "zero3"),
                   help="with --sharded: FSDP2 (row shards; the default) or DeepSpeed ZeRO-3 (flat partitions)")
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
    return p


def _check(p: argparse.ArgumentParser, args) -> bool:
    """Checks the options (argparse's error on a bad one); whether the plan has two levels."""
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
    if args.engine is not None and not args.sharded:
        p.error("--engine names a sharded engine: give --sharded")
    return two_level


def _rows(args, cfg, model, task: str):
    """The counted rows of a vision or speech model (None for a text model: its rows are by formula)."""
    if task == "text":
        if args.tokens_per_rank is None or args.batch_per_rank is not None:
            raise ValueError(f"--model {args.model!r} is a text model: give --tokens-per-rank "
                             f"(not --batch-per-rank)")
        return None
    if args.batch_per_rank is None or args.tokens_per_rank is not None:
        raise ValueError(f"--model {args.model!r} is a {task} model: give --batch-per-rank (its rows "
                         f"are counted by a forward pass), not --tokens-per-rank")
    rows = forward_rows(model, cfg, batch=args.batch_per_rank, decoder_tokens=args.decoder_tokens)
    args.tokens_per_rank = 0  # (the formula is not used)
    return rows


def _plans(args, two_level: bool):
    """(task, the steady state, the time plan or None, the two-level plan or None); ValueError on bad input."""
    cfg = load_config(args.model)
    task = model_task(cfg)
    model = build_meta_model(cfg)
    args.params = sum(p.numel() for p in model.parameters())  # for the memory table (`_memory`)
    rows = _rows(args, cfg, model, task)
    if args.sharded:  # FSDP2, HSDP, ZeRO-3: one plan of hops (`plan_cluster._sharded_plans`)
        return (task, *_sharded_plans(args, model, cfg, rows, two_level), None)
    step = plan_model(model, sites=args.sites, **plan_options(args, cfg, rows))
    timed = _time_plan(args, model, cfg, step, rows) if args.bandwidth is not None else None
    levels = _level_plan(args, model, cfg, step, rows) if two_level else None
    return task, step, timed, levels


def _memory(args, step, timed=None):
    """Memory per rank under every engine for the planned routes (`routing.memory.plan_memory`): a
    sharded plan by time (``timed``) holds what its routes by time hold."""
    from dad_integrations.capture.rows import compute_dtype
    from dad_integrations.routing.memory import plan_memory

    dtype = DTYPES[args.dtype]
    units = timed[0].units if args.sharded and timed is not None else step.units
    return plan_memory([(u.shape, u.rows, u.route) for u in units], params=args.params, world_size=args.sites,
                       rank=args.rank if args.rank and args.mode != "exact" else None, param_itemsize=dtype.itemsize,
                       residual_itemsize=compute_dtype(dtype).itemsize, local_size=args.local_size)


def _print_json(args, task: str, step, timed, levels) -> None:
    """The plans as one JSON object (``--json``)."""
    memory = _memory(args, step, timed)
    out = {"model": args.model, "task": task, **{k: getattr(args, k) for k in (
        "sites", "tokens_per_rank", "batch_per_rank", "sharded", "rank", "mode", "rank_route", "dtype")},
           **asdict(step)}
    if args.sharded:
        out["engine"] = args.engine or "fsdp2"
        if timed is not None:
            out["time"] = asdict(timed[0])
            out["time"]["links"] = {h: link.to_spec() for h, link in timed[1].items()}
            out["time"]["compute"] = timed[2]
        timed = None
    if timed is not None:
        out["time"] = asdict(timed[0])
        out["time"]["by_time"] = asdict(timed[1])
    out["memory"] = {label: asdict(m) for label, m in memory}
    if levels is not None:
        out["two_level"] = {**asdict(levels[0]), "intra": levels[1].to_spec(), "inter": levels[2].to_spec(),
                            "compute": levels[3]}
    print(json.dumps(out, indent=1))


def _print_text(args, task: str, step, timed, levels) -> None:
    """The plans as tables: the steady state, then the step time and the two levels where asked."""
    per_rank = (f"{args.tokens_per_rank} tokens per rank" if task == "text" else
                f"{args.batch_per_rank} {'images' if task == 'image' else 'clips'} per rank (rows counted)")
    header = (f"{args.model}: {args.sites} sites, {per_rank}, mode {args.mode}, "
              f"rank {args.rank or '-'}, rank route {args.rank_route}, {args.dtype}"
              f"{_sharded_label(args)}; MB one rank sends per steady-state step")
    print((render_sharded if args.sharded else render)(step, header))
    if args.sharded and timed is not None:
        from dad_integrations.routing.plan_sharded import render_sharded_time
        print()
        print(render_sharded_time(*timed))
    elif timed is not None:
        from dad_integrations.routing.plan_time import render_time
        print()
        print(render_time(timed[0], timed[2], timed[3]))
    if levels is not None:
        print()
        print(render_levels(levels[0], _levels_header(args, *levels[1:])))
    from dad_integrations.routing.memory import render_memory
    print()
    print(render_memory(_memory(args, step, timed)))


def _sharded_label(args) -> str:
    """The header's engine: none unsharded, FSDP2 (the default), HSDP on nodes, ZeRO-3."""
    if not args.sharded:
        return ""
    if args.nodes > 1 and args.local_size > 1:
        return f", sharded (HSDP: {args.nodes} nodes x {args.local_size} ranks)"
    return f", sharded ({'ZeRO-3' if args.engine == 'zero3' else 'FSDP2'})"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = _parser()
    args = p.parse_args(argv)
    two_level = _check(p, args)
    try:
        plans = _plans(args, two_level)
    except ValueError as e:
        p.error(str(e))
    (_print_json if args.json else _print_text)(args, *plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
