"""One-rank gloo group in this process: API misuse gives clear errors; the layout of the code."""
import ast
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dad_integrations import (CommHandle, DADConfig, DADSynchronizer, EqualSizeAggregator, TorchDistributedAggregator,
                              Traffic, register_dad_comm_hook)
from dad_integrations.comm.counter import CollectiveCounter

PACKAGE = Path(__file__).resolve().parents[1] / "dad_integrations"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _one_step_equals_local(model: nn.Module, ref: nn.Module, sync: DADSynchronizer) -> None:
    """One synchronised step on one rank: every gradient equals the local one (``ref``'s)."""
    x = torch.randn(5, 4)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    sync.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_one_rank_keeps_local_gradient(group):
    model = _model()
    ref = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="exact"))
    _one_step_equals_local(model, ref, sync)
    assert sync.last_step_report().totals["params_exact"] == 4
    sync.close()


def test_forgetting_synchronize_is_an_error(group):
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator())
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="synchronize"):
        model(torch.randn(2, 4))
    sync.synchronize()
    sync.close()
    with pytest.raises(RuntimeError, match="close"):
        sync.synchronize()


def test_synchronize_inside_no_sync_is_an_error(group):
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator())
    with sync.no_sync():
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="no_sync"):
            sync.synchronize()
    sync.synchronize()
    sync.close()


def test_sparse_embeddings_are_refused(group):
    model = nn.Sequential(nn.Linear(3, 3), nn.Embedding(10, 3, sparse=True))
    with pytest.raises(ValueError, match="sparse"):
        DADSynchronizer(model, TorchDistributedAggregator())
    assert not model[0]._forward_hooks, "a refused model must be left without hooks"


def test_dense_only_state_round_trip_stops_capture(group):
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), DADConfig(mode="exact"))
    state = sync.state_dict()
    state["units"]["0.weight"]["dense_only"] = True
    sync.load_state_dict(state)
    model(torch.randn(2, 4)).sum().backward()
    sync.synchronize()
    reps = {p.name: p.representation for p in sync.last_step_report().params}
    assert reps["0.weight"] == "dense" and reps["2.weight"] == "exact"
    assert not sync.units[-1].uses[0].enabled  # the units run in reverse order: 0.weight is last
    sync.close()


def test_bad_config_dict_is_refused(group):
    with pytest.raises(ValueError, match="rnak"):
        DADSynchronizer(_model(), TorchDistributedAggregator(), {"rnak": 3})


def test_rank_mode_stops_capturing_rows_it_does_not_use(group):
    """Rank-reduced from the dense gradient, a weight's rows are dropped after the checked first
    step; the step's window (forward-before-synchronize check) still opens."""
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": "rank", "rank": 1})
    x = torch.randn(64, 4)  # many rows: power iteration on the dense gradient is the cheaper
    for _ in range(2):
        model(x).pow(2).sum().backward()
        sync.synchronize()
    assert all(u.rows_unused and not any(c.enabled for c in u.uses) for u in sync.units)
    assert {p.method for p in sync.last_step_report().params
            if p.representation in ("rank", "rank_allreduce")} == {"dense"}
    model(x).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="synchronize"):
        model(x)
    sync.synchronize()
    sync.close()


def test_rows_stay_off_after_a_state_round_trip(group):
    model = _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": "rank", "rank": 1})
    x = torch.randn(64, 4)
    for _ in range(2):
        model(x).pow(2).sum().backward()
        sync.synchronize()
    sync.load_state_dict(sync.state_dict())
    assert not any(c.enabled for u in sync.units for c in u.uses)
    sync.close()


def test_mixed_dtypes_are_counted_once(group):
    """Rank payloads of another dtype go in their own all-gather; each byte is reported once."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8).double(), nn.Linear(8, 2).double())
    model[0].register_forward_hook(lambda m, i, o: o.double())
    agg = TorchDistributedAggregator()
    sync = DADSynchronizer(model, agg, {"mode": "rank", "rank": 2})
    for _ in range(2):
        before = agg.traffic()
        model(torch.randn(16, 4)).pow(2).sum().backward()
        sync.synchronize()
        handed = (agg.traffic() - before).handed
        assert sync.last_step_report().totals["handed_bytes"] == pytest.approx(handed)
    sync.close()


def test_each_handle_carries_its_own_bytes(group):
    """A collective's handle holds its own bytes, its size exchange included; the running sum is
    the sum of the handles'."""
    agg = TorchDistributedAggregator()
    before = agg.traffic()
    gathered = agg.all_gather(torch.zeros(3, 4), name="g")  # first dims exchanged: one int64 more
    known = agg.all_gather(torch.zeros(2, 5, dtype=torch.float64), name="k", first_dims=[2])
    reduced = agg.all_reduce(torch.ones(7), name="r")
    assert (gathered.traffic.handed, gathered.traffic.calls) == (3 * 4 * 4 + 8, 2)
    assert (known.traffic.handed, known.traffic.calls) == (2 * 5 * 8, 1)
    assert (reduced.traffic.handed, reduced.traffic.calls) == (7 * 4, 1)
    assert gathered.traffic.sent == gathered.traffic.received == 0  # one rank: nothing on a wire
    for h in (gathered, known, reduced):
        h.wait()
    assert agg.traffic() - before == gathered.traffic + known.traffic + reduced.traffic
    assert CommHandle(lambda: None).traffic == Traffic()


def test_collective_counter_splits_by_group_and_restores(group):
    """The counter sees what the backend hands torch.distributed, per group, and unwraps on exit."""
    agg = TorchDistributedAggregator()
    original = dist.all_reduce
    with CollectiveCounter(dist) as counter:
        handle = agg.all_gather(torch.zeros(3, 4), name="g")
        handle.wait()
        dist.all_reduce(torch.ones(5))  # on the default group
    assert dist.all_reduce is original and not counter.installed
    assert counter.traffic(group=agg.group) == handle.traffic
    assert counter.traffic(group=None) == Traffic(handed=20, calls=1)
    assert counter.by_function(exclude_group=agg.group) == {"all_reduce": Traffic(handed=20, calls=1)}
    dist.all_reduce(torch.ones(5))  # uninstalled: not counted
    assert counter.traffic().calls == handle.traffic.calls + 1
    counter.reset()
    assert counter.traffic() == Traffic()


class _Loopback(EqualSizeAggregator):
    """Three ranks holding the same tensor, without a wire: the ring model's arithmetic alone."""

    def __init__(self):
        super().__init__()
        self._rank, self._world = 1, 3

    def _engine_all_gather(self, out, tensor, async_op=False):
        for o in out:
            o.copy_(tensor)

    def _engine_all_reduce(self, tensor, async_op=False):
        tensor.mul_(self._world)


def test_handle_traffic_follows_the_ring_model():
    agg = _Loopback()
    gathered = agg.all_gather(torch.zeros(2, 4), name="g")
    reduced = agg.all_reduce(torch.ones(6), name="r", op="mean")
    exchange, rows = 8, 2 * 4 * 4
    assert gathered.traffic.handed == exchange + rows
    assert gathered.traffic.sent == gathered.traffic.received == 2 * (exchange + rows)
    assert reduced.traffic.sent == reduced.traffic.received == pytest.approx(2 * 2 / 3 * 6 * 4)
    assert torch.equal(reduced.wait(), torch.ones(6))
    assert [t.shape[0] for t in gathered.wait()] == [2, 2, 2]


def test_ddp_comm_hook_with_many_buckets(group):
    """DDP buckets of one parameter each: every unit waits for its weight's and bias's buckets."""
    model, ref = _model(), _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-6)
    sync = register_dad_comm_hook(ddp, {"mode": "exact"})
    for step in range(3):
        x = torch.randn(5, 4)
        ddp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert sync._window is None  # the step left no state behind
        model.zero_grad()
        ref.zero_grad()
    sync.close()


def test_ddp_comm_hook_replaces_allreduce(group):
    """As DDP's hook, dAD hands back the gradients, and synchronize() is refused (DDP drives it)."""
    model, ref = _model(), _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    sync = register_dad_comm_hook(ddp, {"mode": "exact"})
    assert [state.sync for _, state in ddp._comm_hooks] == [sync]
    x = torch.randn(5, 4)
    for _ in range(2):
        ddp(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert sync.last_step_report().totals["params_exact"] == 4
        model.zero_grad()
        ref.zero_grad()
    with pytest.raises(RuntimeError, match="communication hook"):
        sync.synchronize()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        register_dad_comm_hook(model)
    sync.close()


def test_algorithms_never_import_an_engine():
    """Only the engine adapters may import torch.distributed (or any engine); the algorithms not."""
    engines = ("torch.distributed", "horovod", "deepspeed", "accelerate")
    adapters = ("torch_distributed.py", "groups.py", "ddp_hook.py", "ddp_attach.py", "ddp_step.py",
                "fsdp.py", "fsdp_calls.py", "fsdp_seams.py", "fsdp_detect.py", "accelerate.py", "transformers.py",
                "elastic.py")
    for path in PACKAGE.rglob("*.py"):
        names = _imports(path)
        # dependencies point one way: no core module imports an engine adapter package
        assert not any(n.startswith(("deepspeed_dad", "horovod_dad")) for n in names), f"{path.name} imports {names}"
        if path.name not in adapters:
            assert not any(n.startswith(engines) for n in names), f"{path.name} imports {names}"


def _imports(path: Path) -> list:
    """Absolute module names imported anywhere in a file (functions' bodies included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


def test_abandoned_step_does_not_block_exit(tmp_path):
    """A step left in flight (an error before synchronize()) must not keep the process alive."""
    import subprocess
    import sys
    script = tmp_path / "abandon.py"
    script.write_text(
        "import socket, torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "from dad_integrations import DADSynchronizer, TorchDistributedAggregator\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "model = nn.Linear(3, 3)\n"
        "sync = DADSynchronizer(model, TorchDistributedAggregator())\n"
        "model(torch.randn(2, 3)).sum().backward()\n"
        "print('exiting without synchronize()')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)))
    assert proc.returncode == 0, proc.stderr
    assert "terminate called" not in proc.stderr


@pytest.mark.parametrize("through", ["synchronizer", "ddp_hook"])
@pytest.mark.parametrize("mode", ["exact", "auto"])
def test_zero_grad_between_forward_and_backward(group, through, mode):
    """PyTorch's ImageNet loop: output = model(x); optimizer.zero_grad(); loss.backward(). The
    gradient left from the last step must not be added back (it was zeroed after the forward)."""
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    if through == "ddp_hook":
        ddp = nn.parallel.DistributedDataParallel(model)
        sync, forward = register_dad_comm_hook(ddp, {"mode": mode}), ddp
    else:
        sync, forward = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": mode}), model
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(6, 4)
        loss, loss_ref = forward(x).pow(2).sum(), ref(x).pow(2).sum()
        opt.zero_grad()
        opt_ref.zero_grad()
        loss.backward()
        loss_ref.backward()
        if through == "synchronizer":
            sync.synchronize()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        opt.step()
        opt_ref.step()
    sync.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_between_micro_steps_keeps_only_the_last(group, set_to_none):
    """Inside no_sync, a zero_grad() between micro-steps drops the earlier micro-steps, as DDP does
    (it averages what .grad holds)."""
    torch.manual_seed(0)
    model, ref = _model(), _model()
    sync = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": "exact"})
    for step in range(2):
        xs = [torch.randn(3, 4) for _ in range(3)]
        with sync.no_sync():
            for x in xs[:-1]:
                model(x).pow(2).sum().backward()
        out = model(xs[-1]).pow(2).sum()
        model.zero_grad(set_to_none=set_to_none)
        out.backward()
        sync.synchronize()
        ref.zero_grad()
        ref(xs[-1]).pow(2).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        # exact, not the first-step check's dense fallback for factors that "do not rebuild"
        assert sync.last_step_report().totals["params_dense"] == 0
    sync.close()


def test_unit_waits_for_its_bias(group):
    """A unit is ready when its weight and its bias are final: here autograd finishes the weight in one
    backward and the bias in a second, so a unit started by its weight alone would write the bias
    before autograd adds to it."""
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    # without the first-step check, which would send the unit dense for good on such a step
    sync = DADSynchronizer(model, TorchDistributedAggregator(), {"mode": "exact", "verify_first_step": False})
    for _ in range(2):
        x = torch.randn(5, 4)
        loss = model(x).pow(2).sum()
        loss.backward(inputs=[model.weight], retain_graph=True)
        time.sleep(0.3)  # time for an exchange that started too early to write the bias
        loss.backward(inputs=[model.bias])
        sync.synchronize()
        ref(x).pow(2).sum().backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)
        assert sync.last_step_report().totals["params_exact"] == 2
        model.zero_grad()
        ref.zero_grad()
    sync.close()


def test_state_loads_onto_the_parameters_dtype(group):
    """load_state_dict moves warm starts and residuals to each parameter's device and dtype (a
    checkpoint mapped to the CPU, or saved in another precision, still loads)."""
    torch.manual_seed(0)
    model = _model().double()
    sync = DADSynchronizer(model, TorchDistributedAggregator(),
                           {"mode": "rank", "rank": 1, "error_feedback": True})
    model(torch.randn(9, 4, dtype=torch.float64)).pow(2).sum().backward()
    sync.synchronize()
    state = sync.state_dict()
    assert any(s["residual"] is not None for s in state["rank_routes"].values())
    for s in state["rank_routes"].values():  # as if saved from a float32 run
        s["warm_q"], s["residual"] = (None if t is None else t.float() for t in (s["warm_q"], s["residual"]))
    sync.load_state_dict(state)
    for s in sync.state_dict()["rank_routes"].values():
        assert all(t is None or t.dtype == torch.float64 for t in (s["warm_q"], s["residual"]))
    model.zero_grad()
    model(torch.randn(9, 4, dtype=torch.float64)).pow(2).sum().backward()
    sync.synchronize()
    sync.close()


def test_broadcast_in_chunks_keeps_every_dtype(group):
    """The attach broadcast copies parameters and buffers of every dtype bit for bit, in chunks."""
    from dad_integrations.exchange.checks import broadcast_model
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(torch.float64)
    model.register_buffer("flag", torch.tensor([True, False]))
    model.register_buffer("low", torch.randn(5).to(torch.bfloat16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    broadcast_model(model, TorchDistributedAggregator(), chunk_bytes=16)
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k


def test_dense_marks_keep_unused_none_and_real_nan(group):
    """The dense buckets' NaN marks: a parameter without a gradient stays None, a gradient whose
    first element really is NaN stays a (non-finite) gradient, the others are untouched."""
    from dad_integrations.codecs.dense import DenseBuckets
    from dad_integrations.capture.sink import GradSink

    def reduce(items):
        buckets = DenseBuckets(TorchDistributedAggregator(), GradSink({}), bucket_cap_mb=1, dtype=torch.float32,
                               account=lambda name, p, traffic: names.append(name))
        for name, p in items:
            buckets.add(name, p)
        return buckets.finish()

    used, unused, nan_first = (nn.Parameter(torch.ones(3)) for _ in range(3))
    used.grad = torch.tensor([1.0, 2.0, 3.0])
    nan_first.grad = torch.tensor([float("nan"), 5.0, 6.0])
    names = []
    finite = reduce([("used", used), ("unused", unused), ("nan", nan_first)])
    assert not finite
    assert unused.grad is None
    torch.testing.assert_close(used.grad, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.isnan(nan_first.grad[0]) and nan_first.grad[1:].tolist() == [5.0, 6.0]
    assert "[dense flags]" in names  # the resolving round ran (only because of the marks)
    names.clear()
    unused.grad = torch.zeros(3)
    nan_first.grad = torch.ones(3)
    assert reduce([("used", used), ("unused", unused), ("nan", nan_first)])
    assert "[dense flags]" not in names  # every gradient present: no extra round


class _Scaled(nn.Module):
    """A layer no built-in kind knows: ``2 x W^T``."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)

    def forward(self, x):
        return 2.0 * nn.functional.linear(x, self.weight)


def test_users_register_their_own_layer_kind(group):
    """`register_kind` from the package's face: a user's kind is captured by default, rebuilds the
    exact gradient, and is a name the config accepts; a wrong kind's rows are caught by the first
    step's check and its weight goes dense (never a wrong gradient)."""
    from dad_integrations import Claim, LayerKind, register_kind
    from dad_integrations import config as config_module
    from dad_integrations.capture.hooks import ModuleCapture
    from dad_integrations.capture.layers import registry

    def make_kind(name: str, factor: float):
        class ScaledKind(LayerKind):
            def accepts(self, module):
                return isinstance(module, _Scaled)

            def claims(self, module):
                return [Claim("weight")]

            def capture(self, mod_name, module, on_forward):
                def rows(mod, inputs, grad_out):  # dL/dW = 2 D^T X
                    return factor * grad_out.reshape(-1, grad_out.shape[-1]), inputs.reshape(-1, inputs.shape[-1])
                c = ModuleCapture(mod_name, module, "linear", rows, on_forward)
                return c, {"weight": c}
        ScaledKind.name = name
        return ScaledKind

    def step(config):
        torch.manual_seed(0)
        model = nn.Sequential(_Scaled(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ref = nn.Sequential(_Scaled(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ref.load_state_dict(model.state_dict())
        sync = DADSynchronizer(model, TorchDistributedAggregator(), config())
        _one_step_equals_local(model, ref, sync)
        routes = {p.name: p.representation for p in sync.last_step_report().params}
        sync.close()
        return routes

    assert step(lambda: DADConfig(mode="exact"))["0.weight"] == "dense"  # no kind knows it yet
    for name, factor, route in (("scaled", 2.0, "exact"), ("scaled_wrong", 1.0, "dense")):
        register_kind(make_kind(name, factor))
        try:
            assert name in DADConfig().layer_kinds
            assert step(lambda: DADConfig(mode="exact"))["0.weight"] == route
            assert step(lambda: DADConfig(mode="exact", layer_kinds=("linear",)))["0.weight"] == "dense"
        finally:
            registry._KINDS.pop(name)
            config_module._USER_KINDS.remove(name)
    with pytest.raises(TypeError, match="LayerKind"):
        register_kind(_Scaled)
    with pytest.raises(ValueError, match="layer_kinds"):
        DADConfig(layer_kinds=("scaled",))
