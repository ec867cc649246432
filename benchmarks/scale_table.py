"""Bytes per rank and step at scale: all-reduce, dAD, rank-dAD and auto, computed, not run.

    python -m benchmarks.scale_table [--check]

For GPT-2 small/medium/large and BERT-base (masked LM) geometries, batch x sequence from 1x128 to
32x1024 and 2 to 256 sites, the bytes one rank sends per step in steady state (after the first,
verifying step), from the synchroniser's own plan (`dad_integrations.capture.assign.build_plan`, on a
model built on the meta device: no memory, no weights) and its own cost model
(`dad_integrations.routing.router.route`, the decision each unit takes), plus the size exchanges the
synchroniser sends besides. ``--check`` runs small real configs on 2 ranks
and compares these figures with `last_step_report()`'s accounting, byte for byte.

Rows per step and rank: every captured call of a layer sees all ``batch x seq`` tokens (GPT-2's
tied ``wte``/``lm_head`` unit has two uses, each with that many rows), except the position
embeddings, which Hugging Face looks up once for ``(1, seq)`` ids and broadcasts over the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from dad_integrations.comm.aggregator import ring_allreduce_bytes
from dad_integrations.config import DADConfig
from dad_integrations.routing.planner import steady_state
from dad_integrations.capture.assign import build_plan

ROOT = Path(__file__).resolve().parents[1]
GEOMETRIES = ("gpt2-small", "gpt2-medium", "gpt2-large", "bert-base")
SHAPES = ((1, 128), (8, 128), (1, 1024), (8, 512), (32, 128), (32, 1024))
SITES = (2, 8, 32, 256)
SCHEMES = ("allreduce", "dad-exact", "dad-rank", "dad-auto", "auto-lossless")


def model_config(name: str, tiny: bool = False):
    """A Hugging Face config of one geometry (``tiny``: the same architecture, small, for checks)."""
    from transformers import BertConfig, GPT2Config

    if name.startswith("gpt2"):
        d, layers, heads = {"gpt2-small": (768, 12, 12), "gpt2-medium": (1024, 24, 16),
                            "gpt2-large": (1280, 36, 20), "gpt2-tiny": (48, 2, 2)}[name]
        vocab, pos = (50257, 1024) if name != "gpt2-tiny" else (300, 64)
        return GPT2Config(vocab_size=vocab, n_positions=pos, n_embd=d, n_layer=layers, n_head=heads,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          **({"bos_token_id": None, "eos_token_id": None} if name == "gpt2-tiny" else {}))
    if name in ("bert-base", "bert-tiny"):
        if name == "bert-tiny":
            return BertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=96, max_position_embeddings=64, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0)
        return BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # bert-base-uncased
    raise ValueError(f"unknown geometry {name!r}")


def build(name: str, device: str = "meta"):
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    cfg = model_config(name)
    cls = GPT2LMHeadModel if name.startswith("gpt2") else BertForMaskedLM
    with torch.device(device):
        return cls(cfg)


def max_positions(name: str) -> int:
    cfg = model_config(name)
    return getattr(cfg, "n_positions", None) or cfg.max_position_embeddings


def plan_of(model, mode: str, rank: Optional[int]):
    plan = build_plan(model, DADConfig(mode=mode, rank=rank))
    for c in plan.captures:
        c.remove()  # only the plan is needed, not the hooks
    return plan


def step_bytes(plan, batch: int, seq: int, world: int, mode: str, rank: Optional[int],
               dtype: torch.dtype = torch.float32, rank_route: Optional[str] = None) -> Dict[str, object]:
    """Bytes one rank sends in a steady-state step of ``mode`` with ``batch x seq`` tokens per rank
    (`dad_integrations.plan.steady_state`: the router's decision per unit, size exchanges, dense
    buckets), and PyTorch's PowerSGD hook at the same rank (None without a rank).
    ``rank_route`` None is the config's default."""
    route_kw = {} if rank_route is None else {"rank_route": rank_route}
    step = steady_state(plan, tokens=batch * seq, positions=seq, world_size=world, mode=mode, rank=rank,
                        dtype=dtype, **route_kw)
    return {"sent": step.total, "units": step.counts, "powersgd": step.powersgd}


def allreduce_bytes(model, world: int) -> float:
    seen, nbytes = set(), 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            nbytes += p.numel() * p.element_size()
    return ring_allreduce_bytes(nbytes, world)


def table(rank: int, geometries: Sequence[str] = GEOMETRIES, shapes=SHAPES, sites=SITES) -> List[dict]:
    rows = []
    for g in geometries:
        model = build(g)
        plans = {"dad-exact": plan_of(model, "exact", None), "dad-rank": plan_of(model, "rank", rank),
                 "dad-auto": plan_of(model, "auto", rank), "auto-lossless": plan_of(model, "auto", None)}
        modes = {"dad-exact": ("exact", None), "dad-rank": ("rank", rank), "dad-auto": ("auto", rank),
                 "auto-lossless": ("auto", None)}
        for b, t in shapes:
            if t > max_positions(g):
                continue
            for s in sites:
                rec = {"geometry": g, "batch": b, "seq": t, "sites": s, "rank": rank,
                       "allreduce": allreduce_bytes(model, s)}
                for scheme, (mode, r) in modes.items():
                    out = step_bytes(plans[scheme], b, t, s, mode, r)
                    rec[scheme] = out["sent"]
                    rec[f"{scheme}_units"] = out["units"]
                    if scheme == "dad-auto":
                        rec["powersgd"] = out["powersgd"]
                lossless = {k: rec[k] for k in ("allreduce", "dad-exact")}
                rec["winner_lossless"] = min(lossless, key=lossless.get)
                rec["winner"] = min(("allreduce", "dad-exact", "dad-rank"), key=lambda k: rec[k])
                rows.append(rec)
    return rows


def _gb(b: float) -> str:
    return f"{b / 2 ** 20:,.1f}"


def markdown(rows: List[dict]) -> str:
    head = ("| geometry | batch x seq | sites | all-reduce MB | dAD exact MB | rank-dAD MB | auto (r) MB "
            "| PowerSGD (r) MB | auto / PowerSGD | auto lossless MB | rank-dAD / all-reduce | lossless winner "
            "| auto units exact/rank all-gather/rank all-reduce/dense |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        u = r["dad-auto_units"]
        lines.append(f"| {r['geometry']} | {r['batch']}x{r['seq']} | {r['sites']} | {_gb(r['allreduce'])} "
                     f"| {_gb(r['dad-exact'])} | {_gb(r['dad-rank'])} | {_gb(r['dad-auto'])} "
                     f"| {_gb(r['powersgd'])} | {r['dad-auto'] / r['powersgd']:.4f} "
                     f"| {_gb(r['auto-lossless'])} | {r['dad-rank'] / r['allreduce']:.4f} "
                     f"| {r['winner_lossless']} | {u['exact']}/{u['rank']}/{u['rank_allreduce']}/{u['dense']} |")
    return "\n".join(lines)


def crossovers(rank: int) -> str:
    """Where each scheme stops winning: rows per rank below which exact beats all-reduce, and the
    number of sites above which rank-dAD's all-gather route outgrows all-reduce, per geometry
    (the all-reduce route, which auto takes, is flat in the sites)."""
    lines = ["| geometry | exact beats all-reduce below (tokens per rank, 1 sequence, S=8) | rank-dAD all-gather beats all-reduce up to (sites, 512 tokens) |",
             "|---|---|---|"]
    for g in GEOMETRIES:
        model = build(g)
        exact_plan, rank_plan = plan_of(model, "exact", None), plan_of(model, "rank", rank)
        lo, hi = 1, 1 << 20
        while lo < hi:  # largest N with exact < all-reduce (monotone in N)
            mid = (lo + hi + 1) // 2
            if step_bytes(exact_plan, mid, 1, 8, "exact", None)["sent"] < allreduce_bytes(model, 8):
                lo = mid
            else:
                hi = mid - 1
        s = 2
        while s < 1 << 16 and step_bytes(rank_plan, 1, 512, s * 2, "rank", rank,
                                         rank_route="allgather")["sent"] < allreduce_bytes(model, s * 2):
            s *= 2
        lines.append(f"| {g} | {lo} | ~{s} (doubling search; rank {rank}) |")
    return "\n".join(lines)


# -- sharded (FSDP2): each rank keeps a shard; the baseline is a reduce-scatter -------------------
SHARDED_GEOMETRIES = ("gpt2", "gpt2-medium", "gpt2-large", "llama-7b-geometry")  # `plan.PRESETS`
SHARDED_TOKENS = (128, 1024, 8192)
SHARDED_SITES = (8, 32, 256)
SHARDED_SCHEMES = {"dad-exact": ("exact", None), "auto-lossless": ("auto", None), "dad-auto": ("auto", "r")}


def sharded_table(rank: int, geometries: Sequence[str] = SHARDED_GEOMETRIES, tokens=SHARDED_TOKENS,
                  sites=SHARDED_SITES) -> List[dict]:
    """Bytes per rank and steady-state step under FSDP2 (`plan.sharded_steady_state`): FSDP2's
    reduce-scatter against dAD exact, auto lossless and auto at ``rank``, fp32 gradients."""
    from dad_integrations.plan import build_meta_model, load_config, max_positions as positions_of
    from dad_integrations.routing.planner import sharded_steady_state

    rows = []
    for g in geometries:
        cfg = load_config(g)
        model = build_meta_model(cfg)
        plans = {k: plan_of(model, mode, rank if r else None) for k, (mode, r) in SHARDED_SCHEMES.items()}
        for t in tokens:
            seq = min(t, positions_of(cfg) or t)
            for s in sites:
                rec = {"geometry": g, "tokens": t, "sites": s, "rank": rank}
                for k, (mode, r) in SHARDED_SCHEMES.items():
                    step = sharded_steady_state(plans[k], tokens=t, positions=seq, world_size=s, mode=mode,
                                                rank=rank if r else None)
                    rec["reduce_scatter"] = step.reduce_scatter
                    rec[k], rec[f"{k}_units"] = step.total, step.counts
                rows.append(rec)
    return rows


def sharded_markdown(rows: List[dict]) -> str:
    lines = ["Sharded (FSDP2; fp32 gradients; MB one rank sends per steady-state step, row-count exchange "
             "included):", "",
             "| geometry | tokens/rank | sites | reduce-scatter MB | dAD exact MB | auto lossless MB "
             "| auto (r) MB | auto (r) / reduce-scatter | auto (r) routes |", "|" + "---|" * 9]
    for r in rows:
        units = ", ".join(f"{v} {k}" for k, v in sorted(r["dad-auto_units"].items()))
        lines.append(f"| {r['geometry']} | {r['tokens']} | {r['sites']} | {_gb(r['reduce_scatter'])} "
                     f"| {_gb(r['dad-exact'])} | {_gb(r['auto-lossless'])} | {_gb(r['dad-auto'])} "
                     f"| {r['dad-auto'] / r['reduce_scatter']:.4f} | {units} |")
    return "\n".join(lines)


def plot(rows: List[dict], out: Path) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, len(GEOMETRIES), figsize=(4 * len(GEOMETRIES), 3.6), sharey=True)
    for ax, g in zip(axes, GEOMETRIES):
        sel = [r for r in rows if r["geometry"] == g and (r["batch"], r["seq"]) == (8, 512)]
        sites = [r["sites"] for r in sel]
        for scheme, style in (("allreduce", "k-"), ("dad-exact", "C0--"), ("dad-rank", "C1-o"),
                              ("dad-auto", "C2:"), ("powersgd", "C3-.")):
            ax.plot(sites, [r[scheme] / 2 ** 20 for r in sel], style, label=scheme)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{g}, 8x512 tokens/rank", fontsize=9)
        ax.set_xlabel("sites")
    axes[0].set_ylabel("MB sent per rank per step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scale_bytes_vs_sites.png", dpi=110)
    plt.close(fig)
    files.append("scale_bytes_vs_sites.png")
    return files


# -- check against last_step_report() on real small configs, 2 ranks --------------------------------
CHECK_CASES = [("gpt2-tiny", 2, 16), ("gpt2-tiny", 1, 8), ("bert-tiny", 2, 16)]
CHECK_MODES = (("exact", None), ("rank", 3), ("auto", 3), ("auto", None))


def _check_rank(rank: int, world: int, port: int, out_path: str) -> None:
    import datetime

    import torch.distributed as dist
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    from dad_integrations import DADConfig, DADSynchronizer, TorchDistributedAggregator

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    results = []
    try:
        for geom, batch, seq in CHECK_CASES:
            for mode, r in CHECK_MODES:
                torch.manual_seed(0)
                cfg = model_config(geom)
                model = (GPT2LMHeadModel if geom.startswith("gpt2") else BertForMaskedLM)(cfg)
                sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode=mode, rank=r))
                g = torch.Generator().manual_seed(rank)
                sent = []
                for step in range(3):
                    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
                    model(input_ids=x, labels=x).loss.backward()
                    sync.synchronize()
                    sent.append(sync.last_step_report().totals["sent_bytes"])
                    model.zero_grad(set_to_none=True)
                sync.close()
                results.append({"geometry": geom, "batch": batch, "seq": seq, "mode": mode, "rank": r,
                                "reported": sent[1:]})
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(results, fh)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check(world: int = 2) -> List[dict]:
    """Real 2-rank runs of small configs: `last_step_report()` totals against `step_bytes`."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        out = os.path.join(tmp, "check.json")
        mp.spawn(_check_rank, args=(world, port, out), nprocs=world, join=True)
        with open(out) as fh:
            reported = json.load(fh)
    rows = []
    from transformers import BertForMaskedLM, GPT2LMHeadModel

    for rec in reported:
        cfg = model_config(rec["geometry"])
        with torch.device("meta"):
            model = (GPT2LMHeadModel if rec["geometry"].startswith("gpt2") else BertForMaskedLM)(cfg)
        plan = plan_of(model, rec["mode"], rec["rank"])
        predicted = step_bytes(plan, rec["batch"], rec["seq"], world, rec["mode"], rec["rank"])["sent"]
        rows.append(dict(rec, predicted=predicted,
                         match=all(abs(v - predicted) <= 1e-6 * max(predicted, 1) for v in rec["reported"])))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=4, help="rank of rank-dAD")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--json", metavar="PATH", help="write every row here")
    p.add_argument("--check", action="store_true", help="compare with last_step_report() on 2 real ranks")
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = table(args.rank)
    sharded = sharded_table(args.rank)
    text = markdown(rows) + "\n\n" + crossovers(args.rank) + "\n\n" + sharded_markdown(sharded)
    if args.check:
        checks = check()
        ok = all(c["match"] for c in checks)
        text += "\n\nCheck against last_step_report() (2 real ranks, steady-state steps):\n\n"
        text += "| geometry | batch x seq | mode | rank | predicted B | reported B | match |\n|---|---|---|---|---|---|---|\n"
        text += "\n".join(f"| {c['geometry']} | {c['batch']}x{c['seq']} | {c['mode']} | {c['rank']} | "
                          f"{c['predicted']:,.0f} | {', '.join(f'{v:,.0f}' for v in c['reported'])} | "
                          f"{'yes' if c['match'] else 'NO'} |" for c in checks)
        if not ok:
            print(text)
            print("scale_table: the analytic bytes differ from last_step_report()", file=sys.stderr)
            return 1
    (out / "scale_table.md").write_text(text + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"replicated": rows, "sharded": sharded}, fh, indent=1)
    if not args.no_plots:
        plot(rows, out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
