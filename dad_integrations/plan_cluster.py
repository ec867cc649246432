"""The plan command's link, compute and cluster options: the step-time prediction on a link
(``--bandwidth``), the cluster's shape (``--sites`` or ``--nodes`` x ``--local-size``), the routes'
compute model (``--compute-*``) and the two-level plan.

Part of `dad_integrations.plan`, which re-exports every name.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from dad_integrations.config import DADConfig
from dad_integrations.plan_models import DTYPES, max_positions
from dad_integrations.routing.planner import RowCounts, StepPlan, plan_levels_model, plan_model


def plan_options(args, cfg, rows: Optional[RowCounts] = None) -> dict:
    """The planner's keywords every plan of the command shares (rows, rank, mode, route, dtype)."""
    return dict(tokens_per_rank=args.tokens_per_rank, rank=args.rank or None, mode=args.mode,
                rank_route=args.rank_route, dtype=DTYPES[args.dtype], positions=max_positions(cfg), rows=rows)


def _time_plan(args, model: torch.nn.Module, cfg, by_bytes: StepPlan, rows: Optional[RowCounts] = None):
    """The plan by predicted time on the stated link: (time plan, the steady state by time, link, note)."""
    from dad_integrations.comm.link_spec import parse_bandwidth
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.plan_time import time_plan
    from dad_integrations.routing.timing import StepTiming

    link = LinkModel.uniform(parse_bandwidth(args.bandwidth), args.latency_us * 1e-6)
    compute, note = compute_model(args, {tuple(r.shape) for r in by_bytes.units})
    timing = StepTiming(link, compute)
    by_time = plan_model(model, sites=args.sites, timing=timing, **plan_options(args, cfg, rows))
    return time_plan(by_time, timing, sites=args.sites, compressed=by_bytes), by_time, link, note


def _sharded_plans(args, model: torch.nn.Module, cfg, rows: Optional[RowCounts], two_level: bool):
    """The sharded plans (`routing.plan_sharded`): the steady state by bytes, and where a link is
    stated (``--bandwidth``; HSDP's ``--intra-bw`` and ``--inter-bw``) the plan by time, as
    ``(time plan, links by hop, compute note)``; FSDP2 on one level keeps its own byte table
    (`routing.planner.sharded_steady_state`)."""
    from dad_integrations.comm.link_spec import parse_bandwidth
    from dad_integrations.routing.link import LinkModel
    from dad_integrations.routing.plan_sharded import as_step_plan, sharded_time_plan
    from dad_integrations.routing.planner import _model_plan, sharded_steady_state
    from dad_integrations.routing.timing import StepTiming

    engine = args.engine or "fsdp2"
    opts = plan_options(args, cfg, rows)
    plan, dad_rank, seq = _model_plan(model, opts["tokens_per_rank"], opts["positions"], mode=args.mode,
                                      rank=args.rank or None, rank_route=args.rank_route)
    where = dict(engine=engine, tokens=opts["tokens_per_rank"], positions=seq, world_size=args.sites, mode=args.mode,
                 rank=dad_rank, rank_route=args.rank_route, dtype=opts["dtype"], rows=rows,
                 nodes=args.nodes if two_level else 1)
    links: dict = {}
    if two_level:
        for hop, flag, bw, latency in (("inside", "--intra-bw", args.intra_bw, args.intra_latency_us),
                                       ("between", "--inter-bw", args.inter_bw, args.inter_latency_us)):
            try:
                links[hop] = LinkModel.uniform(parse_bandwidth(bw), latency * 1e-6)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None
    elif args.bandwidth is not None:
        links["group"] = LinkModel.uniform(parse_bandwidth(args.bandwidth), args.latency_us * 1e-6)
    by_bytes = sharded_time_plan(plan, **where, intra=links.get("inside"))
    step = (sharded_steady_state(plan, **{k: where[k] for k in ("tokens", "positions", "mode", "rank", "rank_route",
                                                                  "dtype", "rows")}, world_size=args.sites)
            if engine == "fsdp2" and not two_level else as_step_plan(by_bytes))
    if not links:
        return step, None
    compute, note = compute_model(args, {tuple(r.shape) for r in by_bytes.units})
    timing = StepTiming(links.get("group", links.get("between")), compute)
    timed = sharded_time_plan(plan, **where, timing=timing, intra=links.get("inside"))
    return step, (timed, links, note)


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
    if args.sharded and args.engine == "zero3":
        raise ValueError("--sharded --engine zero3: ZeRO across nodes (node partitions) is not planned in this "
                         "version; plan it on --sites, or FSDP2's HSDP without --engine")
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
    plan = plan_levels_model(model, nodes=args.nodes, local_size=args.local_size, intra=links[0], inter=links[1],
                             compute=compute, **plan_options(args, cfg, rows))
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
