"""Every collective of a few dAD steps, in order, per rank: a check that a refactor changed no wire.

For one named case (`CASES`: an engine, a layout and a dAD config) a worker run by ``torchrun``
(CPU, gloo) wraps the collective functions of ``torch.distributed``, ``distributed_c10d``, the
functional collectives and, for ZeRO, ``deepspeed.comm``, before any engine is built; then it
builds a tiny model (an embedding and three linear layers), attaches dAD, runs `STEPS` steps on
seeded data and writes, per rank, one JSON line per collective: the function, the group's size and
ranks, the reduce op and other plain arguments, and each tensor argument's dtype, shape and bytes
(never its values). Step marks (``{"mark": "step 2"}``) separate the steps. A torch collective
called through ``deepspeed.comm`` carries ``via``; a ``deepspeed.comm`` call that reached no torch
collective is recorded itself. Only the outermost call of a nest is recorded (``all_gather_object``,
not the ``all_gather`` inside it). Each rank also writes the routes its report gave per step
(``rank<r>.routes.json``), to read a difference, not compared.

The wrapper imports nothing from the code under test, so the same file traces any checkout:

    python -m benchmarks.collective_trace --tree /work/wt-baseline --out /tmp/trace-a
    python -m benchmarks.collective_trace --tree . --out /tmp/trace-b [--cases sync_exact ddp_auto]
    python -m benchmarks.collective_trace --compare /tmp/trace-a /tmp/trace-b

The driver copies this file to a temporary folder and runs it there with ``PYTHONPATH=TREE``: the
tool is this tree's, the code under test TREE's. ``--compare`` prints per case ``identical`` with
the number of collectives, or the first differing record (index, rank, both records).
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

STEPS = 4
LOSSLESS = 2  # steps 0-1 lossless, 2-3 on the rank routes

EXACT = {"mode": "exact", "objective": "bytes"}
RANK_AG = {"mode": "rank", "rank": 4, "rank_route": "allgather", "objective": "bytes", "lossless_steps": LOSSLESS}
RANK_AR = {**RANK_AG, "rank_route": "allreduce"}
AUTO = {"mode": "auto", "rank": 4, "objective": "bytes", "lossless_steps": LOSSLESS}


def _case(engine: str, nproc: int, config: dict, **extra: Any) -> dict:
    return {"engine": engine, "nproc": nproc, "config": config, **extra}


#: case name -> engine ("sync", "ddp", "fsdp", "hsdp", "zero"), ranks, dAD config (+ ZeRO's stage)
CASES: Dict[str, dict] = {
    **{f"sync_{k}": _case("sync", 2, c) for k, c in
       (("exact", EXACT), ("rank_allgather", RANK_AG), ("rank_allreduce", RANK_AR), ("auto", AUTO))},
    **{f"ddp_{k}": _case("ddp", 2, c) for k, c in
       (("exact", EXACT), ("rank_allgather", RANK_AG), ("rank_allreduce", RANK_AR), ("auto", AUTO))},
    **{f"fsdp_{k}": _case("fsdp", 2, c) for k, c in
       (("exact", EXACT), ("rank_allgather", RANK_AG), ("rank_allreduce", RANK_AR), ("auto", AUTO))},
    **{f"zero{s}_{k}": _case("zero", 2, c, stage=s) for s in (2, 3) for k, c in
       (("exact", EXACT), ("rank_allgather", RANK_AG), ("rank_allreduce", RANK_AR))},
    **{f"two_level_{k}": _case("sync", 4, {**c, "topology": 2}) for k, c in
       (("exact", EXACT), ("rank_allreduce", RANK_AR), ("rank_allgather", RANK_AG))},
    **{f"hsdp_{k}": _case("hsdp", 4, c) for k, c in
       (("rank_allreduce", RANK_AR), ("rank_allgather", RANK_AG), ("exact", EXACT))},
    # ZeRO's partitions across 2 nodes of 2 ranks (`exchange.node_partitions`)
    **{f"zero{s}_nodes_{k}": _case("zero", 4, {**c, "topology": 2}, stage=s) for s in (2, 3) for k, c in
       (("exact", EXACT), ("rank_allreduce", RANK_AR), ("rank_allgather", RANK_AG))},
}


# -- the tracer (no import of the code under test) -----------------------------------------------

TORCH_NAMES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
               "all_gather_coalesced", "all_gather_object", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
               "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object", "scatter",
               "scatter_object_list", "barrier", "monitored_barrier", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "_broadcast_coalesced", "_verify_params_across_processes")
FUNCOL_NAMES = ("all_reduce", "all_reduce_coalesced", "all_gather_tensor", "all_gather_tensor_autograd",
                "all_gather_into_tensor_coalesced", "reduce_scatter_tensor", "reduce_scatter_tensor_autograd",
                "reduce_scatter_tensor_coalesced", "all_to_all_single", "all_to_all_single_autograd",
                "broadcast", "permute_tensor")
DEEPSPEED_NAMES = ("all_reduce", "inference_all_reduce", "all_reduce_coalesced", "all_gather",
                   "all_gather_into_tensor", "allgather_fn", "all_gather_coalesced", "all_gather_object",
                   "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn", "all_to_all_single",
                   "all_to_all", "broadcast", "broadcast_object_list", "reduce", "gather", "scatter",
                   "barrier", "monitored_barrier", "send", "recv", "isend", "irecv")


class Tracer:
    """Records collective calls as dicts, in call order, thread-safe; writes them as JSON lines."""

    def __init__(self) -> None:
        self.records: List[dict] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._wrapped: Dict[int, Callable] = {}  # id(original) -> its wrapper, shared by namespaces

    # -- installing ----------------------------------------------------------------------------
    def wrap_module(self, module: Any, names: tuple, ns: str) -> None:
        """Replace ``module.<name>`` for every name it has with a recording wrapper."""
        for name in names:
            fn = getattr(module, name, None)
            if fn is None or not callable(fn):
                continue
            if getattr(fn, "_traced", False):
                continue
            wrapper = self._wrapped.get(id(fn))
            if wrapper is None:
                wrapper = (self._ds_wrapper if ns == "deepspeed.comm" else self._wrapper)(ns, name, fn)
                self._wrapped[id(fn)] = wrapper
            setattr(module, name, wrapper)

    def _wrapper(self, ns: str, name: str, fn: Callable) -> Callable:
        sig = _signature(fn)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "depth", 0):  # inside another collective: the outer one counts
                return fn(*args, **kwargs)
            self.add(_describe(ns, name, sig, args, kwargs), via=getattr(self._local, "ds", None))
            self._local.depth = 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0

        traced._traced = True
        return traced

    def _ds_wrapper(self, ns: str, name: str, fn: Callable) -> Callable:
        sig = _signature(fn)

        @functools.wraps(fn)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "ds", None) or getattr(self._local, "depth", 0):
                return fn(*args, **kwargs)
            before = len(self.records)
            record = _describe(ns, name, sig, args, kwargs)
            self._local.ds = f"{ns}.{name}"
            try:
                result = fn(*args, **kwargs)
            finally:
                self._local.ds = None
            if len(self.records) == before:  # it reached no torch collective: record it itself
                self.add(record)
            return result

        traced._traced = True
        return traced

    # -- recording -----------------------------------------------------------------------------
    def add(self, record: dict, via: Optional[str] = None) -> None:
        if via:
            record["via"] = via
        with self._lock:
            record = {"i": len(self.records), "thread": threading.current_thread().name, **record}
            self.records.append(record)

    def mark(self, label: str) -> None:
        """A step mark between the records (no collective)."""
        with self._lock:
            self.records.append({"i": len(self.records), "mark": label})

    def write(self, path: Path) -> None:
        with self._lock, open(path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r, sort_keys=True) + "\n")


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a C function: positions only
        return None


def _describe(ns: str, name: str, sig: Optional[inspect.Signature], args: tuple, kwargs: dict) -> dict:
    """The call without values: tensors as dtype/shape/bytes, groups as size and ranks."""
    named: Dict[str, Any] = {}
    if sig is not None:
        try:
            named = dict(sig.bind(*args, **kwargs).arguments)
        except TypeError:
            sig = None
    if sig is None:
        named = {f"arg{i}": a for i, a in enumerate(args)}
        named.update(kwargs)
    out: dict = {"fn": name, "ns": ns, "tensors": [], "args": {}}
    group_seen = False
    for key, value in named.items():
        tensors = _tensors(value)
        if tensors is not None:
            out["tensors"].append({"arg": key, **tensors})
        elif _is_group(value) or (key in ("group", "process_group") and value is None):
            out["group"] = _group(value)
            group_seen = True
        elif key in ("group", "process_group"):  # a mesh, a rank list, (mesh, dim): funcol's forms
            out["group"] = {"repr": _plain(value)}
            group_seen = True
        elif key not in ("object_list", "obj", "object_gather_list", "scatter_object_input_list",
                         "scatter_object_output_list", "logger"):
            out["args"][key] = _plain(value)
    if not group_seen and ns != "funcol":
        out["group"] = _group(None)
    out["bytes"] = sum(t["bytes"] for t in _flat(out["tensors"]))
    return out


def _flat(items: list) -> list:
    flat = []
    for t in items:
        flat += _flat(t["list"]) if "list" in t else [t]
    return flat


def _tensors(value: Any) -> Optional[dict]:
    import torch
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape),
                "bytes": value.numel() * value.element_size()}
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return {"list": [_tensors(v) for v in value]}
    return None


def _is_group(value: Any) -> bool:
    import torch.distributed as dist
    return isinstance(value, dist.ProcessGroup)


def _group(value: Any) -> dict:
    import torch.distributed as dist
    if value is None:
        return {"size": dist.get_world_size(), "ranks": list(range(dist.get_world_size())), "default": True}
    return {"size": dist.get_world_size(value), "ranks": list(dist.get_process_group_ranks(value))}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "mesh") and hasattr(value, "mesh_dim_names"):  # a DeviceMesh
        return {"mesh": value.mesh.tolist(), "dims": list(value.mesh_dim_names or ())}
    text = str(value)
    return text if " at 0x" not in text else type(value).__name__  # no addresses: they differ per run


def install(engine: str) -> Tracer:
    """Wrap every collective namespace this engine's callers may use; before any engine exists."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed._functional_collectives as funcol
    tracer = Tracer()
    tracer.wrap_module(c10d, TORCH_NAMES, "torch")
    tracer.wrap_module(dist, TORCH_NAMES, "torch")
    tracer.wrap_module(funcol, FUNCOL_NAMES, "funcol")
    if engine == "zero":
        # deepspeed.comm's TorchBackend looks up some torch functions once, at init_distributed:
        # torch is wrapped first, so it captures the wrappers
        import deepspeed.comm as ds_comm
        import deepspeed.comm.comm as ds_comm_impl
        tracer.wrap_module(ds_comm_impl, DEEPSPEED_NAMES, "deepspeed.comm")
        tracer.wrap_module(ds_comm, DEEPSPEED_NAMES, "deepspeed.comm")
    return tracer


# -- the case (the code under test comes from PYTHONPATH) ----------------------------------------

def build_model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 32)
            self.fc1 = nn.Linear(32, 64)
            self.fc2 = nn.Linear(64, 32)
            self.head = nn.Linear(32, 10)

        def forward(self, ids):
            h = torch.tanh(self.fc1(self.emb(ids)))
            return self.head(torch.tanh(self.fc2(h)))

    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int):
    import torch
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 10, (4, 6), generator=g)


def loss_of(model, data):
    import torch
    ids, y = data
    return torch.nn.functional.cross_entropy(model(ids).reshape(-1, 10), y.reshape(-1))


def routes_of(sync: Any) -> list:
    """The last step's route per parameter, as the report gives it (for reading a difference)."""
    try:
        report = sync.last_step_report()
        return [[p.name, p.representation, str(getattr(p, "level", ""))] for p in report.params]
    except Exception as e:  # the report is a reading aid only
        return [f"no report: {type(e).__name__}: {e}"]


def run_case(name: str, out_dir: Path) -> None:
    """Trace ``name`` on this rank; write ``rank<r>.jsonl`` and ``rank<r>.routes.json``."""
    case = CASES[name]
    engine = case["engine"]
    if engine == "zero":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    tracer = install(engine)
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    config = dict(case["config"])
    tracer.mark("init")
    if engine == "zero":
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    tracer.mark("attach")
    model = build_model()
    step_fn: Callable[[Any], None]
    if engine in ("sync", "ddp"):
        from dad_integrations import DADSynchronizer, TorchDistributedAggregator, register_dad_comm_hook
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if engine == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            fwd = DDP(model)
            sync = register_dad_comm_hook(fwd, config)
        else:
            fwd, sync = model, DADSynchronizer(model, TorchDistributedAggregator(), config)

        def step_fn(data):
            loss_of(fwd, data).backward()
            if engine == "sync":
                sync.synchronize()
            opt.step()
            opt.zero_grad()
    elif engine in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import fully_shard
        from dad_integrations.fsdp import enable_dad_fsdp
        mesh = None
        if engine == "hsdp":  # one machine, 4 ranks: 2 replicas x 2 shards
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for sub in (model.fc1, model.fc2, model):
            fully_shard(sub, mesh=mesh)
        sync = enable_dad_fsdp(model, config)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step_fn(data):
            loss_of(model, data).backward()
            opt.step()
            opt.zero_grad()
    else:
        import deepspeed_dad
        zero = {"stage": case["stage"], "reduce_bucket_size": 3000, "overlap_comm": False,
                "contiguous_gradients": True}
        if case["stage"] == 3:
            zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000})
        ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "train_batch_size": 4 * dist.get_world_size(), "zero_optimization": zero,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9, "dad": config}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sync, *_ = deepspeed_dad.initialize(model=model, optimizer=opt, config=ds)
        att = deepspeed_dad.get_attachment(sync)

        def step_fn(data):
            sync.backward(loss_of(sync, data))
            sync.step()
    reporter = att if engine == "zero" else sync
    routes = []
    for step in range(STEPS):
        tracer.mark(f"step {step}")
        step_fn(batch(step, rank))
        routes.append(routes_of(reporter))
    tracer.mark("end")
    out_dir.mkdir(parents=True, exist_ok=True)
    tracer.write(out_dir / f"rank{rank}.jsonl")
    import dad_integrations
    (out_dir / f"rank{rank}.routes.json").write_text(json.dumps(
        {"dad_integrations": dad_integrations.__file__, "routes": routes}, indent=1))
    print(f"{name} rank {rank}: {sum('fn' in r for r in tracer.records)} collectives", flush=True)
    # leave at once: after FSDP2 or ZeRO gloo's group may abort the process at finalisation
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


# -- the driver and the comparison ---------------------------------------------------------------

def run_all(tree: Path, out: Path, names: List[str], timeout: float = 900) -> Dict[str, str]:
    """Run each case under torchrun with ``PYTHONPATH=tree``; returns case -> "ok" or the failure."""
    tmp = Path(tempfile.mkdtemp(prefix="collective_trace_"))
    script = tmp / "collective_trace.py"
    shutil.copy(__file__, script)  # this tree's tool, the other tree's code
    env = {k: v for k, v in os.environ.items() if k not in ("DAD_OBJECTIVE", "DAD_LOSSLESS_STEPS")}
    env.update(PYTHONPATH=str(tree.resolve()), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR="cpu")
    status = {}
    for name in names:
        case_dir = out / name
        shutil.rmtree(case_dir, ignore_errors=True)
        case_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={CASES[name]['nproc']}", str(script), "--worker", name, str(case_dir)]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout)
        (case_dir / "log.txt").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
        status[name] = "ok" if proc.returncode == 0 else f"failed ({proc.returncode}): {proc.stderr[-600:]}"
        print(f"{name}: {status[name][:200]} ({time.time() - t0:.0f} s)", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return status


def load(case_dir: Path) -> Dict[int, List[dict]]:
    """rank -> its records without the running index (compared by position)."""
    out = {}
    for f in sorted(case_dir.glob("rank*.jsonl")):
        rank = int(f.name[4:-6])
        out[rank] = [{k: v for k, v in json.loads(line).items() if k != "i"} for line in f.open()]
    return out


def compare_case(a: Dict[int, List[dict]], b: Dict[int, List[dict]]) -> Optional[str]:
    """None when identical, else the first differing record on the lowest rank that differs."""
    if not a or not b:
        return "missing trace" + (" in A" if not a else "") + (" in B" if not b else "")
    if sorted(a) != sorted(b):
        return f"ranks differ: {sorted(a)} vs {sorted(b)}"
    for rank in sorted(a):
        ra, rb = a[rank], b[rank]
        for i in range(max(len(ra), len(rb))):
            x = ra[i] if i < len(ra) else None
            y = rb[i] if i < len(rb) else None
            if x != y:
                return (f"first difference at record {i}, rank {rank} (after mark {_last_mark(ra, i)!r}):\n"
                        f"    A: {json.dumps(x, sort_keys=True)}\n    B: {json.dumps(y, sort_keys=True)}")
    return None


def _last_mark(records: List[dict], i: int) -> Optional[str]:
    return next((r["mark"] for r in reversed(records[:i]) if "mark" in r), None)


def compare(dir_a: Path, dir_b: Path) -> bool:
    """Print per case: identical (collectives per rank, bytes) or the first difference; True if all match."""
    names = sorted({p.name for d in (dir_a, dir_b) for p in d.iterdir() if p.is_dir()},
                   key=lambda n: list(CASES).index(n) if n in CASES else len(CASES))
    same = 0
    for name in names:
        a, b = load(dir_a / name), load(dir_b / name)
        diff = compare_case(a, b)
        counts = "/".join(str(sum("fn" in r for r in a[r_])) for r_ in sorted(a)) if a else "-"
        nbytes = sum(r.get("bytes", 0) for recs in a.values() for r in recs)
        if diff is None:
            same += 1
            print(f"{name:26s} identical  ({counts} collectives per rank, {nbytes} bytes handed, all ranks)")
        else:
            counts_b = "/".join(str(sum("fn" in r for r in b[r_])) for r_ in sorted(b)) if b else "-"
            print(f"{name:26s} DIFFERS    (A {counts}, B {counts_b} collectives per rank): {diff}")
    print(f"{same} of {len(names)} cases identical")
    return same == len(names)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, help="checkout whose dad_integrations / deepspeed_dad run")
    p.add_argument("--out", type=Path, help="folder for the traces (one subfolder per case)")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), metavar="CASE")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    p.add_argument("--worker", nargs=2, metavar=("CASE", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the cases")
    args = p.parse_args(argv)
    if args.worker:
        run_case(args.worker[0], Path(args.worker[1]))
        return 0
    if args.list:
        for name, case in CASES.items():
            print(f"{name:26s} {case['nproc']} ranks  {json.dumps(case)}")
        return 0
    if args.compare:
        return 0 if compare(*args.compare) else 1
    if not (args.tree and args.out):
        p.error("--tree and --out (or --compare A B)")
    status = run_all(args.tree, args.out, args.cases)
    return 0 if all(s == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
