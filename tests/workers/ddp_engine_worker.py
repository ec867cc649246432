"""Runs inside `torchrun` (gloo): PyTorch's own DDP test cases with dAD's communication hook
(`register_dad_comm_hook`, mode exact) in place of DDP's reduction; writes JSON results.

Usage: torchrun --standalone --nproc_per_node 2 ddp_engine_worker.py OUT.json [CASE ...]

Where PyTorch's test code runs on CPU and gloo, it runs as shipped: the methods of
``torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`` on an
instance of it, with every ``DistributedDataParallel`` they build getting the dAD hook (`dad_ddp`).
Where it needs CUDA (``.cuda(rank)``, ``device_ids``, ``torch.cuda.synchronize``), the case is a
port that keeps the test's model, data, loop and assertions, named after the PyTorch test.
Besides, the cases compare dAD against DDP's own all-reduce (PyTorch's ``allreduce_hook`` or
DDP's built-in reduction) gradient by gradient, every step, to fp32 round-off.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import os
import sys
import tempfile
import traceback
from typing import Callable, Dict, Iterator, List, Optional

os.environ.setdefault("BACKEND", "gloo")  # read by distributed_test at import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from dad_integrations import register_dad_comm_hook  # noqa: E402
from dad_integrations.ddp_hook import DDPDriver  # noqa: E402

EXACT = {"mode": "exact"}


# -- PyTorch's test class, with the dAD hook on every DDP it builds -------------------------------
class DADDistTest(TestCase, dt.DistributedTest._DistTestBase):
    """PyTorch's DDP test methods, run on this rank (one instance per case)."""

    def __init__(self, method: str):
        super().__init__(method)
        self.rank = dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def _barrier(self, *args, **kwargs) -> None:
        # PyTorch's file-based barrier needs its harness's TEMP_DIR; a collective one does the same job
        dist.barrier()

    def _test_DistributedDataParallel_on_cpu(self, gradient_as_bucket_view: bool = False) -> None:
        """Port of PyTorch's ``_test_DistributedDataParallel`` (CUDA only) to CPU, its code less the
        ``.cuda()`` calls: ``torch.save`` / ``torch.load`` of the DDP model before training, then
        `_test_DDP_niter` with ``test_save`` (saved and loaded again after its third step; 5 steps,
        parameters against one process's after each)."""
        model = dt.Net()
        model_base = copy.deepcopy(model)
        model_DDP = nn.parallel.DistributedDataParallel(copy.deepcopy(model),
                                                        gradient_as_bucket_view=gradient_as_bucket_view)
        with tempfile.NamedTemporaryFile() as tmp:
            torch.save(model_DDP, tmp.name)
            model_DDP = torch.load(tmp.name, weights_only=False)
        local_bs = 2  # as _test_DistributedDataParallelCPU
        global_bs, input_cpu, target, loss = self._prepare_dummy_data(local_bs)
        self._test_DDP_niter(model_base, model_DDP, input_cpu, target, loss, local_bs, self.rank, global_bs, True)
        self._barrier()

    def test_ddp_grad_div_uneven_inputs_on_cpu(self) -> None:
        """Port of PyTorch's ``test_ddp_grad_div_uneven_inputs`` (CUDA only): under ``join``, each
        step's gradient is divided by the ranks still training (``divide_by_initial_world_size=False``)
        or by the initial world size, joined ranks adding zeros; its code less the device placement."""
        dim, batch, grad_scale = 5, 1, 50
        model = nn.Linear(dim, dim, bias=False)
        inp = torch.ones(batch, dim) * grad_scale
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
        n_iters = 3 + (2 if self.rank > 0 else 0)
        with net.join(divide_by_initial_world_size=False):
            for _ in range(n_iters):
                net(inp).sum().backward()
                expected_grad = torch.ones(dim, dim) * grad_scale
                self.assertEqual(expected_grad, next(iter(net.parameters())).grad)
                net.zero_grad()
        with net.join(divide_by_initial_world_size=True):
            for i in range(n_iters):
                net(inp).sum().backward()
                effective_ws = dist.get_world_size() - (1 if i >= 3 else 0)
                expected_grad = torch.ones(dim, dim) * grad_scale * effective_ws / dist.get_world_size()
                self.assertEqual(expected_grad, next(iter(net.parameters())).grad)
                net.zero_grad()

    def test_ddp_uneven_input_join_disable_on_cpu(self) -> None:
        """Port of PyTorch's ``test_ddp_uneven_input_join_disable`` (CUDA only)."""
        torch.manual_seed(self.rank)
        net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
        inp = torch.ones(1) * self.rank
        world_size = dist.get_world_size()
        with net.join(enable=False):
            for _ in range(5):
                grad = net.module.weight.grad
                if grad is not None:
                    grad.requires_grad_(False)
                    grad.zero_()
                net(inp).sum().backward()
                self.assertEqual(net.module.weight.grad.item(), sum(range(world_size)) / world_size)
        self.assertFalse(net._join_config.enable)
        self.validate_net_equivalence(net)

    def test_ddp_uneven_input_exception_on_cpu(self) -> None:
        """Port of PyTorch's ``test_ddp_uneven_input_exception`` (CUDA only): an error in forward
        inside ``join`` comes out as it is."""
        error_str = "Intentional error"

        class ExceptionModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.param = nn.Parameter(torch.ones(1, requires_grad=True))

            def forward(self, _):
                raise ValueError(error_str)

        net = torch.nn.parallel.DistributedDataParallel(ExceptionModule())
        with self.assertRaisesRegex(ValueError, error_str):
            with net.join():
                net(torch.ones(1)).sum().backward()

    def test_ddp_uneven_inputs_on_cpu(self) -> None:
        """PyTorch's ``test_ddp_uneven_inputs`` (CUDA only) on CPU, a selection: its models but
        the large conv model (minutes on CPU) and the two with hooks of their own (dAD is the
        hook here); each with sync every step, with ``no_sync`` every (index + 2) steps as it
        does, and with ``throw_on_early_termination``; iteration mappings {0: 0, 1: 2} and {0: 5, 1: 8}."""
        dim, batch, rank = 1000, 1, self.rank
        small_model = nn.Linear(dim, dim, bias=False)
        bn_net = dt.BatchNormNet()

        class UnusedParamModule(nn.Module):
            def __init__(self, unused_params_rank):
                super().__init__()
                self.t0, self.t1 = dt.Task(), dt.Task()
                self.unused_params_rank = unused_params_rank

            def forward(self, x, rank):
                return self.t1(self.t0(x)) if rank != self.unused_params_rank else self.t1(x)

        models_to_test = [
            dt.DDPUnevenTestInput(name="batch_norm_net", model=bn_net, inp=torch.ones(batch, 2), sync_interval=1),
            dt.DDPUnevenTestInput(name="small_model", model=small_model, inp=torch.ones(batch, dim), sync_interval=1),
            dt.DDPUnevenTestInput(name="unjoined_rank_with_unused_params_model", model=UnusedParamModule(1),
                                  inp=(torch.ones(batch, 2), rank), sync_interval=1),
            dt.DDPUnevenTestInput(name="joined_rank_with_unused_params_model", model=UnusedParamModule(0),
                                  inp=(torch.ones(batch, 2), rank), sync_interval=1),
        ]
        index = {"batch_norm_net": 0, "small_model": 2, "unjoined_rank_with_unused_params_model": 3,
                 "joined_rank_with_unused_params_model": 4}  # their place in PyTorch's list: sync every i + 2
        models_to_test += ([t._replace(sync_interval=index[t.name] + 2) for t in models_to_test]
                           + [t._replace(throw_on_early_termination=True) for t in models_to_test])
        for test_case in models_to_test:
            for iteration_mapping in ({0: 0, 1: 2}, {0: 5, 1: 8}):
                self._run_uneven_inputs_test_on_cpu(test_case, iteration_mapping,
                                                    find_unused_params="unused_params_model" in test_case.name)

    def _run_uneven_inputs_test_on_cpu(self, test_case, iteration_mapping, find_unused_params) -> None:
        """Port of PyTorch's ``_run_uneven_inputs_test``: its code less the device placement and
        ``torch.cuda.synchronize`` calls."""
        model, inp, rank, sync_interval = test_case.model, test_case.inp, self.rank, test_case.sync_interval
        dist.barrier()
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1, find_unused_parameters=find_unused_params)
        num_iters = iteration_mapping[rank]
        num_iters_tensor = torch.tensor([num_iters])
        dist.all_reduce(num_iters_tensor, op=dist.ReduceOp.MIN)
        min_num_iters = num_iters_tensor.item()
        total_iters = 0
        if test_case.throw_on_early_termination:
            if min_num_iters == num_iters:
                exception_ctx = self.assertRaisesRegex(RuntimeError, f"Rank {self.rank} exhausted all inputs")
            else:
                exception_ctx = self.assertRaisesRegex(RuntimeError, "Detected at least one rank that exhausted inputs.")
        else:
            exception_ctx = contextlib.nullcontext()
        with exception_ctx:
            with net.join(throw_on_early_termination=test_case.throw_on_early_termination):
                for i in range(num_iters):
                    context = net.no_sync() if i % sync_interval != 0 else contextlib.nullcontext()
                    with context:
                        loss = net(*inp).sum() if isinstance(inp, tuple) else net(inp).sum()
                        loss.backward()
                        self._model_step(net)
                    total_iters += 1
        if test_case.throw_on_early_termination:
            self.assertEqual(total_iters, min_num_iters)
        else:
            self.assertGreaterEqual(total_iters, min_num_iters)
        if not test_case.throw_on_early_termination:
            self.assertTrue(net._authoritative_rank)
            final_rank_tensor = torch.tensor([net._authoritative_rank])
            tensor_list = [torch.zeros_like(final_rank_tensor) for _ in range(dist.get_world_size())]
            dist.all_gather(tensor_list, final_rank_tensor)
            self.assertSetEqual({dist.get_world_size() - 1}, {tensor.item() for tensor in tensor_list})
            self.validate_net_equivalence(net)
            self.assertTrue(net._get_ddp_logging_data().get("join_uneven_inputs"))
            dist.barrier()


class DADDistributedDataParallel(DDP):
    """A DDP whose reduction is dAD's communication hook (what the cases' code builds instead of
    DDP). A module-level class: ``torch.save`` of the model pickles it by reference."""

    dad_config: dict = EXACT

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        register_dad_comm_hook(self, self.dad_config)


@contextlib.contextmanager
def dad_ddp(config: dict = EXACT) -> Iterator[None]:
    """Every ``DistributedDataParallel(...)`` built inside (by name or through ``nn.parallel``)
    gets dAD's hook."""
    saved = (torch.nn.parallel.DistributedDataParallel, dt.DistributedDataParallel,
             DADDistributedDataParallel.dad_config)
    torch.nn.parallel.DistributedDataParallel = dt.DistributedDataParallel = DADDistributedDataParallel
    DADDistributedDataParallel.dad_config = config
    try:
        yield
    finally:
        (torch.nn.parallel.DistributedDataParallel, dt.DistributedDataParallel,
         DADDistributedDataParallel.dad_config) = saved


@contextlib.contextmanager
def recording_reattached() -> Iterator[List[DDPDriver]]:
    """The hooks of loaded DDP models that attached dAD again, in order (to see them train)."""
    found: List[DDPDriver] = []
    reattach = getattr(DDPDriver, "_reattach", None)
    if reattach is None:  # a dAD without pickling (to see these cases fail before it): nothing to record
        yield found
        return

    def recorded(driver: DDPDriver, ddp: DDP) -> None:
        reattach(driver, ddp)
        found.append(driver)

    DDPDriver._reattach = recorded
    try:
        yield found
    finally:
        DDPDriver._reattach = reattach


# -- PyTorch's own tests, as shipped ----------------------------------------------------------------
def run_pytorch(case: dict) -> dict:
    """Call one of PyTorch's test methods (``method``, with ``kwargs``) with the dAD hook on;
    report the loaded models' re-attached hooks: steps run and routes of their last step."""
    test = DADDistTest(case["method"])
    torch.manual_seed(case.get("seed", 0))  # as PyTorch's harness: the same model on every rank
    saved_init = dt.INIT_METHOD
    if case.get("file_init"):  # _test_DDP_niter saves mid-training only under a file:// init method
        dt.INIT_METHOD = "file://unused"
    try:
        with dad_ddp(), recording_reattached() as reattached:
            getattr(test, case["method"])(**case.get("kwargs", {}))
    finally:
        dt.INIT_METHOD = saved_init
    return {"ok": True, "reattached": [{"steps": d.sync._steps, "routes": _routes(d.sync)} for d in reattached]}


def _routes(sync) -> List[str]:
    report = sync.last_step_report()
    return sorted({p.representation for p in report.params}) if report is not None else []


# -- torch.save of a DDP model with the dAD hook: the loaded model trains on ------------------------
def run_save_load(case: dict) -> dict:
    """Train a DDP model with the dAD hook 2 steps, ``torch.save`` it (each rank its own file, as
    PyTorch's DDP tests do), ``torch.load`` it and train the original, the loaded copy and a DDP
    with its own all-reduce 3 more steps on the same data: the loaded copy's gradients against
    DDP's, its parameters and dAD state against the original's."""
    config = case["config"]
    torch.manual_seed(0)
    base = models.build("mlp")
    ddp_kwargs = {"gradient_as_bucket_view": case.get("bucket_view", False)}
    ref = DDP(copy.deepcopy(base), **ddp_kwargs)
    original = DDP(copy.deepcopy(base), **ddp_kwargs)
    sync = register_dad_comm_hook(original, config)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, original)}

    def step(model: DDP, it: int) -> None:
        x, y = _data("mlp", it)
        F.mse_loss(model(x), y).backward()

    def update(model: DDP) -> None:
        opts[id(model)].step()
        opts[id(model)].zero_grad()

    for it in range(2):
        for model in (ref, original):
            step(model, it)
            update(model)
    saved_state = sync.state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"ddp_rank{dist.get_rank()}.pt")
        torch.save(original, path)
        with recording_reattached() as reattached:
            loaded = torch.load(path, weights_only=False)
            opts[id(loaded)] = torch.optim.SGD(loaded.parameters(), lr=0.1)
            worst, params_diff = [], []
            for it in range(2, 5):
                for model in (ref, original, loaded):
                    step(model, it)
                worst.append(max(models.grad_errors(ref.module, loaded.module).values()))
                for model in (ref, original, loaded):
                    update(model)
                params_diff.append(max(float((a - b).abs().max())
                                       for a, b in zip(original.parameters(), loaded.parameters())))
    (driver,) = reattached
    return {"worst_vs_ddp": worst, "params_diff_vs_original": params_diff, "steps": driver.sync._steps,
            "original_steps": sync._steps, "routes": _routes(driver.sync),
            "state_diff_vs_original": _state_diff(sync.state_dict(), driver.sync.state_dict()),
            "saved_state_norm": _state_norm(saved_state),
            "hooks_per_module": max(len(m._forward_hooks) for m in loaded.module.modules()),
            "params_equal_across_ranks": _equal_across_ranks(list(loaded.parameters()))}


# -- uneven inputs with join, against DDP's own reduction -------------------------------------------
def run_join_vs_ddp(case: dict) -> dict:
    """Rank 0 runs out of inputs after 2 steps, rank 1 trains 5 (``ddp.join()``); gradients are
    never zeroed (so the joined rank's ``.grad`` holds its last step's, which DDP's shadow does not
    send) and some steps accumulate in ``no_sync``. The same loop with DDP's own reduction and
    with the dAD hook: every step's gradients on each rank, and the final parameters, compared."""
    torch.manual_seed(0)
    base = models.build("mlp")
    iters = 2 if dist.get_rank() == 0 else 5
    runs = {}
    for name in ("ddp", "dad"):
        model = DDP(copy.deepcopy(base))
        if name == "dad":
            register_dad_comm_hook(model, EXACT)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads = []
        with model.join(divide_by_initial_world_size=case["divide_by_initial_world_size"]):
            for it in range(iters):
                x, y = _data("mlp", it)
                with model.no_sync() if it % case.get("sync_interval", 1) else contextlib.nullcontext():
                    F.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
        runs[name] = (model, grads)
    (ref, ref_grads), (mine, my_grads) = runs["ddp"], runs["dad"]
    worst = []
    for a, b in zip(ref_grads, my_grads):
        total = sum(float(g.norm()) ** 2 for g in a) ** 0.5
        worst.append(max(models.rel_err(gb, ga, 1e-6 * total) for ga, gb in zip(a, b)))
    params = max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), mine.parameters()))
    return {"worst_per_step": worst, "final_params_max_abs_diff": params,
            "params_equal_across_ranks": _equal_across_ranks(list(mine.parameters()))}


# -- one model wrapped in DDP after DDP (as PyTorch's tests do) -------------------------------------
def run_rewrap(case: dict) -> dict:
    """Wrap one model in a DDP with the dAD hook, train a step, wrap it in a new one, train on:
    the first hook is closed (its DDP raises if used), one capture hook per module is left, and
    the gradients equal a plain DDP's."""
    torch.manual_seed(0)
    model = models.build("mlp")
    ref = DDP(copy.deepcopy(model))
    first = DDP(model)
    first_sync = register_dad_comm_hook(first, EXACT)
    x, y = _data("mlp", 0)
    F.mse_loss(first(x), y).backward()
    second = DDP(model)
    register_dad_comm_hook(second, EXACT)
    worst = []
    for it in range(2):
        x, y = _data("mlp", it)
        for m in (ref, second):
            m.zero_grad()
            F.mse_loss(m(x), y).backward()
        worst.append(max(models.grad_errors(ref.module, second.module).values()))
    try:
        F.mse_loss(first(x), y).backward()
        old_hook_error = ""
    except Exception as e:  # raised by the hook, inside DDP's backward
        old_hook_error = str(e)
    return {"first_closed": first_sync._closed, "hooks_per_module": max(len(m._forward_hooks) for m in model.modules()),
            "worst": worst, "old_hook_error": old_hook_error}


def _tensors(state) -> List[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for k in sorted(state) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _state_diff(a: dict, b: dict) -> float:
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb) and a["steps"] == b["steps"], (len(ta), len(tb), a["steps"], b["steps"])
    return max([float((x - y).abs().max()) for x, y in zip(ta, tb) if x.numel()] + [0.0])


def _state_norm(state: dict) -> float:
    return float(sum(float(t.float().norm()) ** 2 for t in _tensors(state)) ** 0.5)


# -- accumulation with no_sync, against DDP's all-reduce hook ---------------------------------------
def run_accumulate_vs_allreduce(case: dict) -> dict:
    """`_test_accumulate_gradients_no_sync` against PyTorch's ``allreduce_hook`` instead of a
    single-process model: grads never zeroed, a ``no_grad`` forward in ``no_sync`` first, then
    no_sync and synchronised backwards in turn; every gradient compared on every step."""
    name, view = case["model"], case["bucket_view"]
    torch.manual_seed(0)
    base = dt.Net() if name == "net" else models.build(name)
    ddp_kwargs = {"bucket_cap_mb": case.get("bucket_cap_mb", 0.001), "gradient_as_bucket_view": view}
    ref = DDP(copy.deepcopy(base), **ddp_kwargs)
    ref.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    mine = DDP(copy.deepcopy(base), **ddp_kwargs)
    register_dad_comm_hook(mine, EXACT)
    x0, _ = _data(name, 0)
    for model in (ref, mine):
        with torch.no_grad(), model.no_sync():
            model(x0)
    worst: List[float] = []
    synced_equal = []
    for it in range(case.get("iters", 6)):
        x, y = _data(name, it)
        sync = it % 2 == 1
        for model in (ref, mine):
            if sync and case.get("zero_before_sync"):  # a change between micro-steps: DDP averages what is left
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
            with contextlib.nullcontext() if sync else model.no_sync():
                F.mse_loss(model(x), y).backward()
        worst.append(max(models.grad_errors(ref.module, mine.module).values()))
        if sync:
            synced_equal.append(_equal_across_ranks([p.grad for p in mine.parameters()]))
    return {"worst_per_iter": worst, "synced_grads_equal_across_ranks": synced_equal}


def _data(name: str, it: int):
    g = torch.Generator().manual_seed(1000 * it + dist.get_rank())
    if name == "net":
        return torch.randn(2, 2, generator=g), torch.randn(2, 4, generator=g)
    d = models.batch(name, 3, seed=1000 * it + dist.get_rank())
    return d["x"], d["y"]


def _equal_across_ranks(tensors: List[torch.Tensor]) -> bool:
    """Bit for bit the same on every rank."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors if t is not None])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


RUNNERS: Dict[str, Callable[[dict], dict]] = {"pytorch": run_pytorch, "accumulate": run_accumulate_vs_allreduce,
                                              "save_load": run_save_load, "join": run_join_vs_ddp,
                                              "rewrap": run_rewrap}

CASES: Dict[str, dict] = {
    # PyTorch: test_accumulate_gradients_no_sync(_grad_is_view); num_iters=4 as its hook variants
    "accumulate_gradients_no_sync": {"kind": "pytorch", "method": "_test_accumulate_gradients_no_sync",
                                     "kwargs": {"num_iters": 4}},
    "accumulate_gradients_no_sync_grad_is_view": {"kind": "pytorch", "method": "_test_accumulate_gradients_no_sync",
                                                  "kwargs": {"num_iters": 4, "gradient_as_bucket_view": True}},
    "accumulate_vs_allreduce_hook_net": {"kind": "accumulate", "model": "net", "bucket_view": False},
    "accumulate_vs_allreduce_hook_net_grad_is_view": {"kind": "accumulate", "model": "net", "bucket_view": True},
    "accumulate_vs_allreduce_hook_mlp": {"kind": "accumulate", "model": "mlp", "bucket_view": False},
    "accumulate_vs_allreduce_hook_mlp_grad_is_view": {"kind": "accumulate", "model": "mlp", "bucket_view": True},
    "accumulate_vs_allreduce_hook_mlp_grad_is_view_zero_between": {"kind": "accumulate", "model": "mlp",
                                                                   "bucket_view": True, "zero_before_sync": True},
    # PyTorch: test_DistributedDataParallelCPU(_grad_is_view): 5 steps against one process, torch.save at the end
    "DistributedDataParallelCPU": {"kind": "pytorch", "method": "_test_DistributedDataParallelCPU"},
    "DistributedDataParallelCPU_grad_is_view": {"kind": "pytorch", "method": "_test_DistributedDataParallelCPU",
                                                "kwargs": {"gradient_as_bucket_view": True}},
    # PyTorch: _test_DistributedDataParallel (CUDA), ported: saved and loaded before training and mid-training
    "DistributedDataParallel_save_load_on_cpu": {"kind": "pytorch", "method": "_test_DistributedDataParallel_on_cpu",
                                                 "file_init": True},
    "DistributedDataParallel_save_load_on_cpu_grad_is_view": {
        "kind": "pytorch", "method": "_test_DistributedDataParallel_on_cpu", "file_init": True,
        "kwargs": {"gradient_as_bucket_view": True}},
    "ddp_create_graph": {"kind": "pytorch", "method": "test_ddp_create_graph"},
    # PyTorch: the uneven-inputs tests (CUDA), ported
    "ddp_grad_div_uneven_inputs": {"kind": "pytorch", "method": "test_ddp_grad_div_uneven_inputs_on_cpu"},
    "ddp_uneven_input_join_disable": {"kind": "pytorch", "method": "test_ddp_uneven_input_join_disable_on_cpu"},
    "ddp_uneven_input_exception": {"kind": "pytorch", "method": "test_ddp_uneven_input_exception_on_cpu"},
    "ddp_uneven_inputs": {"kind": "pytorch", "method": "test_ddp_uneven_inputs_on_cpu"},
    "join_vs_ddp": {"kind": "join", "divide_by_initial_world_size": True},
    "join_vs_ddp_divide_by_ranks_training": {"kind": "join", "divide_by_initial_world_size": False},
    "join_vs_ddp_no_sync": {"kind": "join", "divide_by_initial_world_size": True, "sync_interval": 2},
    "rewrap": {"kind": "rewrap"},
    "save_load_exact": {"kind": "save_load", "config": EXACT},
    "save_load_exact_grad_is_view": {"kind": "save_load", "config": EXACT, "bucket_view": True},
    "save_load_rank_error_feedback": {"kind": "save_load", "config": {"mode": "rank", "rank": 2}},
}


def _gather(case_id: str, mine: dict) -> list:
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, mine)
    if dist.get_rank() == 0:
        print(f"[ddp_engine] {case_id}: {'raised' if any('exception' in r for r in per_rank) else 'done'}",
              flush=True)
    return per_rank


def main() -> None:
    out_path, only = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("DAD_TEST_TIMEOUT", 120))))
    torch.set_num_threads(1)
    cases = {k: v for k, v in CASES.items() if not only or k in only}
    models.write_and_exit(out_path, models.run_all(cases, _run, _gather))


def _run(case: dict) -> dict:
    try:
        return RUNNERS[case["kind"]](case)
    except Exception:
        # also here: should the other rank then wait in a collective, its gather never returns
        print(f"[ddp_engine] rank {dist.get_rank()} raised in {case}:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    main()
