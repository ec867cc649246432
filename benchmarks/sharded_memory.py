"""Peak memory of a sharded training step: the engine's own reduction against dAD inside it.

    python -m benchmarks.sharded_memory [--preset default|quick|smoke] [--engines fsdp2,zero2,zero3] [--ranks 2]

Issue 12 asks that a sharded step with dAD peak within 10 % of the engine's own step and that no
full-size gradient of a sharded weight be materialised beyond what the engine materialises. This
benchmark measures it, it does not assert it: one process group of gloo ranks trains a byte-level
GPT-2 under each engine (FSDP2 with every block and the root ``fully_shard``-ed; DeepSpeed ZeRO-2
and ZeRO-3 on the CPU accelerator), once with the engine's own reduce-scatter and once per dAD
mode, from the same weights on the same batches, and records per rank and step:

* **peak**: the most tensor bytes alive at once during forward, backward and optimizer step, on
  top of what was alive when the step began (`AllocationPeak`: the profiler's allocation events
  in time order, so it is exact for CPU tensors and blind to the rest of the process);
* **state**: the bytes alive at the step's start that training keeps: local parameter shards,
  their gradients, the optimizer's state (for ZeRO: the module's parameters, ZeRO-3's partitions,
  and the inner optimizer's state; ZeRO's flat fp32 partitions are the same for both runs and
  not counted), and dAD's own state (none in the lossless modes; rank-dAD's warm starts and, with
  error feedback, its residuals: one unsharded gradient per rank-routed weight, or ``q (m+n)``
  numbers with ``error_feedback_rank: q``);

and reports ``state + peak`` per method and its ratio to the engine's own. Steps after the first
count (the first also runs dAD's one-off check that factors rebuild the local gradients).

Results: ``benchmarks/results/sharded_memory.{json,md}``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import os
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
# "engine": the engine's own reduction; each dAD method is its config
DAD_CONFIGS = {"dad-exact": {"mode": "exact"}, "dad-auto": {"mode": "auto"},
               # whole residuals, as the README's table says (the default budget keeps rank-q ones here)
               "dad-rank4": {"mode": "rank", "rank": 4, "residual_budget": None},
               "dad-rank4-no-ef": {"mode": "rank", "rank": 4, "error_feedback": False},
               "dad-rank4-ef-rank16": {"mode": "rank", "rank": 4, "error_feedback_rank": 16}}
METHODS = ("engine",) + tuple(DAD_CONFIGS)
ENGINES = ("fsdp2", "zero2", "zero3")
PRESETS = {
    # width, layers, heads, sequences per rank x length (one entry per token count), steps
    "default": {"width": 256, "layers": 4, "heads": 4, "shapes": [(1, 128), (4, 256), (8, 512)], "steps": 3,
                "repeats": 3},
    "quick": {"width": 128, "layers": 2, "heads": 2, "shapes": [(1, 128), (4, 256)], "steps": 3, "repeats": 1},
    "smoke": {"width": 64, "layers": 1, "heads": 2, "shapes": [(1, 32)], "steps": 2, "repeats": 1},  # for the tests
}
log = logging.getLogger("benchmarks.sharded_memory")


class AllocationPeak:
    """The peak of tensor bytes alive inside a ``with`` block, above those alive at its start.

    Reads the profiler's allocation and free events (``profile_memory=True``) of the threads it
    sees, summed in time order. FSDP2's and dAD's sharded paths run on the thread that calls
    ``backward`` on CPU, so a CPU step is seen whole.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.net = 0

    def __enter__(self) -> "AllocationPeak":
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        self._prof.__exit__(*exc)
        events, stack = [], list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if e.tag == _EventType.Allocation:
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
        running = 0
        for _, size in sorted(events):
            running += size
            self.peak = max(self.peak, running)
        self.net = running


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes training keeps between steps: parameter shards, gradients, the optimizer's state."""
    params = list(model.parameters())
    params += [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]  # ZeRO-3's partitions
    inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the client's optimizer
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(params + [p.grad for p in params] + states)


def dad_state_bytes(sync) -> int:
    """Bytes of dAD's own state between steps (the rank routes' residuals and warm starts)."""
    if sync is None:
        return 0
    routes = sync.state_dict().get("rank_routes") or {}
    held = [v for state in routes.values() for v in state.values()]
    # a low-rank residual (error_feedback_rank) is a pair (U, V)
    return tensor_bytes(t for v in held for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor))


# -- the ranks ---------------------------------------------------------------------------------

def _gpt2(preset: dict, seq_len: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    from dad_examples.text_data import VOCAB_SIZE

    cfg = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=seq_len, n_embd=preset["width"], n_layer=preset["layers"],
                     n_head=preset["heads"], bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


class _Run:
    """What both engines' runs share: ``sync`` is dAD's synchroniser (None for the engine's own
    reduction), with ``last_step_report``, ``state_dict`` and ``close``."""

    sync = None

    def sent(self) -> Optional[float]:
        return self.sync.last_step_report().totals["sent_bytes"] if self.sync else None

    def dad_state(self) -> int:
        return dad_state_bytes(self.sync)

    def close(self) -> None:
        if self.sync:
            self.sync.close()


class FSDP2Run(_Run):
    """A copy of the model under FSDP2 (every block and the root ``fully_shard``-ed), AdamW."""

    def __init__(self, base: torch.nn.Module, dad: Optional[dict]):
        from torch.distributed.fsdp import fully_shard

        from dad_integrations.fsdp import enable_dad_fsdp

        self.model = copy.deepcopy(base)
        for block in self.model.transformer.h:
            fully_shard(block)
        fully_shard(self.model)
        self.sync = enable_dad_fsdp(self.model, dad) if dad else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, ids: torch.Tensor) -> float:
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # the gradients' memory is state, as for the engine
        return float(loss.detach())


class ZeroRun(_Run):
    """A copy of the model under DeepSpeed ZeRO ``stage`` (CPU accelerator), AdamW; dAD through the
    config's ``"dad"`` block."""

    def __init__(self, base: torch.nn.Module, dad: Optional[dict], stage: int, micro: int):
        import torch.distributed as dist

        import deepspeed_dad

        model = copy.deepcopy(base)
        # buckets of a million elements (DeepSpeed's default, 5e8, would allocate 2 GB buffers)
        zero = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True,
                "reduce_bucket_size": 10 ** 6, "allgather_bucket_size": 10 ** 6}
        if stage == 3:
            zero["stage3_param_persistence_threshold"] = 0  # shard every parameter, small ones too
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "train_batch_size": micro * dist.get_world_size(), "zero_optimization": zero,
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
        if dad:
            config["dad"] = dad
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.engine, self.optimizer, _, _ = deepspeed_dad.initialize(model=model, optimizer=optimizer,
                                                                     config=config)
        self.model = self.engine.module
        self.sync = deepspeed_dad.get_attachment(self.engine)  # ZeroDAD: close() detaches it

    def step(self, ids: torch.Tensor) -> float:
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.detach())

    def close(self) -> None:
        super().close()
        self.engine.destroy()


def run_method(engine: str, method: str, base: torch.nn.Module, batches: Sequence[torch.Tensor],
               steps: int) -> dict:
    """Train a copy of ``base`` under ``engine`` on ``batches``; per step the state, peak and bytes."""
    dad = DAD_CONFIGS.get(method)
    run = FSDP2Run(base, dad) if engine == "fsdp2" else ZeroRun(base, dad, int(engine[-1]), batches[0].shape[0])
    out: Dict[str, List] = {"state": [], "peak": [], "loss": [], "sent": []}
    for step in range(steps):
        ids = batches[step % len(batches)]
        state = training_state(run.model, run.optimizer) + run.dad_state()
        with AllocationPeak() as mem:
            loss = run.step(ids)
        out["state"].append(state)
        out["peak"].append(mem.peak)
        out["loss"].append(loss)
        out["sent"].append(run.sent())
    run.close()
    return out


def rank_main(rank: int, world: int, port: int, spec: dict) -> None:
    """One rank (``torch.multiprocessing.spawn``): every shape and method; rank 0 writes JSON."""
    import torch.distributed as dist

    from dad_examples.text_data import byte_lm_batches, stdlib_source_bytes

    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # DeepSpeed reads them
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    if rank != 0:
        logging.getLogger("dad_integrations").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    preset, records = spec["preset"], []
    try:
        text = stdlib_source_bytes(max_bytes=400_000)
        for batch, seq in preset["shapes"]:
            torch.manual_seed(0)
            base = _gpt2(preset, seq)
            data = byte_lm_batches(text, batch, seq, rank=rank, world_size=world, seed=0)
            batches = [next(data) for _ in range(preset["steps"])]
            for engine in spec["engines"]:
                # methods take turns, repeat after repeat: what varies from run to run falls on all alike
                for repeat in range(spec.get("repeats", 1)):
                    for method in spec["methods"]:
                        res = run_method(engine, method, base, batches, preset["steps"])
                        gathered = [None] * world
                        dist.all_gather_object(gathered, res)
                        if rank == 0:
                            records.append({"engine": engine, "method": method, "batch": batch, "seq": seq,
                                            "tokens": batch * seq, "repeat": repeat, "ranks": gathered})
                            log.info("%s %s, %d x %d tokens per rank, repeat %d: peak %s", engine, method,
                                     batch, seq, repeat, [max(r["peak"][1:]) for r in gathered])
        if rank == 0:
            with open(spec["out"], "w") as fh:
                json.dump(records, fh)
    finally:
        dist.destroy_process_group()
    # End without interpreter finalisation: FSDP2 (its DTensors) and DeepSpeed ZeRO keep the gloo group
    # alive in C++ past destroy_process_group, and freeing it while Python is torn down once in a
    # while aborts the process ("terminate called without an active exception") after its work is
    # done. The records are on disk.
    logging.shutdown()
    os._exit(0)


# -- the report ------------------------------------------------------------------------------------

def summarise(records: Sequence[dict]) -> List[dict]:
    """Per shape and method: the worst rank's ``state + peak`` over the steps after the first, the
    median over repeats (the same step's peak moves by up to a fifth from run to run at the smallest
    shape, the engine's own too), and its ratio to the engine's own."""
    groups: Dict[tuple, List[dict]] = {}
    for rec in records:
        groups.setdefault((rec["engine"], rec["method"], rec["batch"], rec["seq"]), []).append(rec)
    rows = []
    for (engine, method, batch, seq), recs in groups.items():
        def worst(rec: dict, key) -> int:
            return max(key(r) for r in rec["ranks"])

        totals = [worst(rec, lambda r: max(s + p for s, p in zip(r["state"][1:], r["peak"][1:]))) for rec in recs]
        peaks = [worst(rec, lambda r: max(r["peak"][1:])) for rec in recs]
        sent = [r["sent"][-1] for r in recs[0]["ranks"]]
        rows.append({"engine": engine, "method": method, "batch": batch, "seq": seq, "tokens": batch * seq,
                     "repeats": len(recs), "total_bytes": statistics.median(totals),
                     "total_bytes_range": [min(totals), max(totals)],
                     "step_peak_bytes": statistics.median(peaks),
                     "state_bytes": max(worst(rec, lambda r: max(r["state"][1:])) for rec in recs),
                     "sent_bytes": None if sent[0] is None else max(sent)})
    for row in rows:
        engine = next(r for r in rows if (r["engine"], r["tokens"], r["method"]) == (row["engine"], row["tokens"], "engine"))
        row["ratio"] = row["total_bytes"] / engine["total_bytes"]
        row["step_peak_ratio"] = row["step_peak_bytes"] / engine["step_peak_bytes"]
    return rows


def markdown(rows: Sequence[dict], preset_name: str, preset: dict, world: int, repeats: int = 1) -> str:
    from benchmarks.workload import fmt_bytes

    lines = [f"# Peak memory of a sharded step ({world} gloo ranks, preset {preset_name})", "",
             f"Byte-level GPT-2, width {preset['width']}, {preset['layers']} layers, AdamW; FSDP2 with every block "
             f"and the root `fully_shard`-ed, DeepSpeed ZeRO-2/3 on the CPU accelerator. *engine*: the engine's "
             f"own reduction. Worst rank, steps after the first. *state*: parameter shards, gradients and "
             f"optimizer state at the step's start; *step peak*: the most tensor bytes alive above that during "
             f"forward, backward and step (profiler allocation events). Every method ran {repeats} time(s), "
             f"the methods taking turns; each figure is the median over those runs (*range*: the least and the "
             f"most state + peak).", "",
             "| engine | tokens/rank | method | state | step peak | state + peak | range | vs engine "
             "| step peak vs engine | sent/step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r.get("total_bytes_range", [r["total_bytes"]] * 2)
        lines.append(f"| {r['engine']} | {r['batch']}x{r['seq']} | {r['method']} | {fmt_bytes(r['state_bytes'])} | "
                     f"{fmt_bytes(r['step_peak_bytes'])} | {fmt_bytes(r['total_bytes'])} | "
                     f"{fmt_bytes(lo)}-{fmt_bytes(hi)} | {r['ratio']:.3f} | "
                     f"{r['step_peak_ratio']:.3f} | {fmt_bytes(r['sent_bytes'])} |")
    lines += ["", "Target (issue 12): state + peak within 10 % of the engine's own. Worst per method:", ""]
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "engine"):
        worst = max((r for r in rows if r["method"] == method), key=lambda r: r["ratio"])
        verdict = "met" if worst["ratio"] <= 1.10 else "**missed**"
        lines.append(f"- {method}: {worst['ratio']:.3f} ({worst['engine']}, {worst['batch']}x{worst['seq']} tokens): "
                     f"{verdict}")
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--repeats", type=int, help="runs of every method, taking turns (default: the preset's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch.multiprocessing as mp

    methods = [m for m in args.methods.split(",") if m]
    if "engine" not in methods:
        methods.insert(0, "engine")  # the baseline every ratio needs
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES)) + sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown engines/methods {unknown}; engines {ENGINES}, methods {METHODS}")
    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"preset": preset, "engines": engines, "methods": methods, "out": os.path.join(tmp, "records.json"),
                "repeats": args.repeats or preset["repeats"]}
        mp.spawn(rank_main, args=(args.ranks, _free_port(), spec), nprocs=args.ranks, join=True)
        with open(spec["out"]) as fh:
            records = json.load(fh)
    rows = summarise(records)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sharded_memory.json", "w") as fh:
        json.dump({"preset": args.preset, "ranks": args.ranks, "repeats": spec["repeats"], "rows": rows,
                   "records": records}, fh, indent=1)
    table = markdown(rows, args.preset, preset, args.ranks, spec["repeats"])
    (out / "sharded_memory.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
