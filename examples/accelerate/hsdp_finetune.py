"""Fine-tune a Llama-config model with FSDP2 HSDP across machines through ``accelerate launch``, dAD on
the hop between machines.

    # on each machine (its own --machine_rank; machine 0's address):
    accelerate launch --config_file examples/accelerate/hsdp_multi_node_cpu.yaml \
        --machine_rank 0 --main_process_ip 10.0.0.1 examples/accelerate/hsdp_finetune.py --steps 20

The config's ``parallelism_config`` (``dp_replicate_size`` = machines, ``dp_shard_size`` = processes per
machine) makes ``accelerator.prepare`` shard every decoder layer on the mesh ``("dp_replicate",
"dp_shard_cp")``: HSDP. FSDP2 reduce-scatters the gradients inside the machine; the all-reduce of
each shard between machines is what dAD replaces, by one added line after ``prepare``::

    sync = enable_dad(accelerator, model, {"mode": "auto", "rank": 4})

Per weight and step dAD's router picks, by predicted time on the link it measured between the
machines, HSDP's own all-reduce of the shard, exact factors, or rank-``r`` factors (error feedback
keeps what they leave out). The script trains twice from the same weights on the same batches: HSDP's
own reduction (``hsdp``), then with dAD (``dad-<mode>``), and prints per run the loss, the seconds per
step, the bytes dAD's report says crossed between machines beside what HSDP's all-reduce sends, and,
where the processes see their link's counters (``GLOO_SOCKET_IFNAME`` names it, as on the simulated
cluster), the bytes that really left the machines (``/sys/class/net/<if>/statistics/tx_bytes``,
TCP/IP headers included, other traffic on that interface too). ``metrics.json`` goes to
``--output-dir``.

The model is built from a ``LlamaConfig`` and trained on the Python standard library's source (byte
tokens), so nothing is downloaded. On CPUs Accelerate does not take its FSDP path by itself (only on
GPU-class devices); the script lets it there (`dad_examples.fsdp_on_cpu`), and only there.

With ``objective: "time"`` (the default) dAD measures the link between machines at attach, and once it
compresses any weight a route trial alternates steps on its routes with all-dense steps (``R D D R``,
rounds of ``route_trial_steps``, 8) and keeps the routes only where they are faster on this job.

Measured on the simulated cluster (``benchmarks/sim_cluster.py``: 2 network namespaces of 2
processes, a veth between them; the 2-core machine shared with other jobs, so times are loose),
the defaults (Llama hidden 256, 2 layers, 1.3 M parameters; batch 4 x 64 tokens per process; dAD
auto, rank 4), means over steps 3 to the end::

    link      steps  run       loss (last 5)  s/step  MB between machines/step (veth)  steps compressed
    100mbit   30     hsdp      2.8310         0.736   11.205                           -
    100mbit   30     dad-auto  2.8720         0.392    1.940                           24 of 28
    1gbit     40     hsdp      2.6444         0.469   10.536                           -
    1gbit     40     dad-auto  2.6812         0.481    9.203                           5 of 38

At 100 Mbit/s each compressed step moved 0.076 MB per rank between machines against HSDP's 2.62 MB
(dAD's report; 0.39 MB on the veths, both machines, headers included, against 10.5 MB), and the
median step took 0.53x HSDP's; the means above include the trial's all-dense steps. At 1 Gbit/s
the trial found the rank-4 compression's compute (four ranks on two cores) no faster than HSDP's
own all-reduce of the shards, and kept that on most steps. (Run by
``SimCluster(nodes=2, rate=...).accelerate(...)`` as in the config file's comments.)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from dad_examples.fsdp_on_cpu import allow_fsdp_on_cpu, on_cpu
from dad_examples.text_data import VOCAB_SIZE, stdlib_source_bytes
from dad_integrations.accelerate import enable_dad

if on_cpu():  # Accelerate takes its FSDP path only on GPU-class devices; let it on CPUs (module doc)
    allow_fsdp_on_cpu()

from accelerate import Accelerator  # noqa: E402  (after the shim: it patches AcceleratorState)
from accelerate.utils import set_seed  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--dad-mode", choices=("exact", "rank", "auto"), default="auto")
    p.add_argument("--rank", type=int, default=4, help="rank of rank-dAD (modes rank and auto)")
    p.add_argument("--lossless-steps", type=int, default=2,
                   help="dAD's first N steps take no rank route (its default is 10; short runs here)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per process")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256, help="the Llama config's hidden size")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the run with HSDP's own reduction")
    p.add_argument("--output-dir", default="runs/hsdp_accelerate")
    return p.parse_args()


def build_model(args: argparse.Namespace):
    """A small Llama from its config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"  # the loss it would pick anyway, minus a warning
    return model


def build_dataset(args: argparse.Namespace, world: int) -> TensorDataset:
    n = args.steps * args.batch_size * world
    data = stdlib_source_bytes(max_bytes=max(n * args.seq_len, 100_000), seed=args.seed)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    tokens = tokens[: len(tokens) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    return TensorDataset(tokens, tokens)


def link_tx_bytes() -> Optional[int]:
    """Bytes that left this machine on the interface gloo uses (None where that cannot be read)."""
    name = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as f:
            return int(f.read())
    except (TypeError, OSError, ValueError):
        return None


def train(name: str, args, accelerator: Accelerator, init_state: dict, dataset, dad_config: Optional[dict]) -> dict:
    set_seed(args.seed)  # the same shuffling in both runs
    model = build_model(args)
    model.load_state_dict(init_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sync = enable_dad(accelerator, model, dad_config) if dad_config is not None else None  # <- dAD
    # one process per machine reads its link's counter (each machine's counter counts what it sent)
    reads_link = accelerator.local_process_index == 0 and link_tx_bytes() is not None
    losses: List[float] = []
    seconds: List[float] = []
    wire: List[float] = []      # bytes that left this machine during each step (the reader only)
    inter: List[float] = []     # dAD's report: bytes this rank received over the hop between machines
    replicate: List[float] = []  # dAD's report: what HSDP's all-reduce of this rank's shards sends
    model.train()
    batches = iter(loader)
    while len(losses) < args.steps:
        input_ids, labels = next(batches)
        before, start = link_tx_bytes() if reads_link else None, time.perf_counter()
        loss = model(input_ids=input_ids, labels=labels).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        wire.append(float(link_tx_bytes() - before) if reads_link else 0.0)
        losses.append(float(accelerator.reduce(loss.detach(), reduction="mean")))  # after the counter read
        if sync is not None:
            totals = sync.last_step_report().totals
            inter.append(totals.get("inter_bytes", 0.0))
            replicate.append(totals.get("replicate_bytes", 0.0))
        if accelerator.is_main_process and (len(losses) % 5 == 0 or len(losses) == 1):
            print(f"{name} step {len(losses):3d}  loss {losses[-1]:.4f}  {seconds[-1]:.3f} s", flush=True)
    # every machine's bytes per step, added up (the readers' counts; the others add zeros)
    wire_total = torch.tensor(wire, dtype=torch.float64)
    dist.all_reduce(wire_total)
    routes = "-"
    if sync is not None:
        weights = [p for p in sync.last_step_report().params if len(p.shape) == 2]
        routes = ", ".join(f"{r} {sum(p.representation == r for p in weights)}"
                           for r in ("exact", "rank", "rank_allreduce", "dense"))
        sync.close()
    accelerator.free_memory()
    return {"name": name, "losses": losses, "seconds": seconds, "wire_bytes": wire_total.tolist(),
            "link_counted": bool(accelerator.reduce(torch.tensor(float(reads_link)), reduction="sum") > 0),
            "inter_bytes": inter, "replicate_bytes": replicate, "routes_last_step": routes}


def mean(xs: List[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else 0.0


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(cpu=on_cpu())  # FSDP plugin and parallelism config: from the launcher's config
    pc = accelerator.parallelism_config
    if accelerator.is_main_process:
        mesh = accelerator.torch_device_mesh
        print(f"{accelerator.distributed_type}, mesh {dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))}"
              if pc is not None else f"{accelerator.distributed_type}, no parallelism_config: not HSDP", flush=True)
    torch.manual_seed(args.seed)
    init_state = build_model(args).state_dict()
    dataset = build_dataset(args, accelerator.num_processes)
    dad_config = {"mode": args.dad_mode, "rank": None if args.dad_mode == "exact" else args.rank,
                  "lossless_steps": args.lossless_steps}
    runs = [] if args.no_baseline else [train("hsdp", args, accelerator, init_state, dataset, None)]
    runs.append(train(f"dad-{args.dad_mode}", args, accelerator, init_state, dataset, dad_config))
    if accelerator.is_main_process:
        after = max(args.lossless_steps, 1)  # past dAD's lossless steps and its first-step check
        header = (f"{'run':<10}| final loss | s/step | MB between machines/step (veth) | dAD report per rank: "
                  f"inter / HSDP all-reduce, MB | steps compressed")
        print(f"(means over steps {after + 1}..{args.steps}; s/step: median)\n{header}\n" + "-" * len(header))
        for r in runs:
            wire = f"{mean(r['wire_bytes'][after:]) / 1e6:.3f}" if r["link_counted"] else "(not readable)"
            rep, compressed = "-", "-"
            if r["inter_bytes"]:
                inter, base = r["inter_bytes"][after:], r["replicate_bytes"][after:]
                rep = f"{mean(inter) / 1e6:.3f} / {mean(base) / 1e6:.3f}"
                compressed = f"{sum(i < b for i, b in zip(inter, base))} of {len(inter)}"
            print(f"{r['name']:<10}| {mean(r['losses'][-5:]):10.4f} | {median(r['seconds'][1:]):6.3f} | "
                  f"{wire:>31} | {rep:>47} | {compressed}")
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump({"args": vars(args), "world_size": accelerator.num_processes, "runs": runs}, f, indent=1)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
