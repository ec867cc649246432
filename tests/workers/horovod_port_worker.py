"""Horovod's own optimizer tests with `DADOptimizer` (mode exact) in place of hvd.DistributedOptimizer.

Usage: horovodrun -np 2 -H localhost:2 --gloo python horovod_port_worker.py OUT.json WORK_DIR

Ported from Horovod v0.28.1 test/parallel/test_torch.py (the file is the same at Horovod's newest
commit); each function keeps the name of the test it ports and its code, with three changes:
``DADOptimizer(..., dad=EXACT)`` for ``hvd.DistributedOptimizer(...)`` (no ``model=``: Horovod's
tests never pass one), ``check()`` for ``assert`` (an assertion raised on one rank would leave the
other waiting in the next collective; every check runs on every rank and is recorded), and, where
noted, a twin run with ``hvd.DistributedOptimizer`` on a copy of the model whose parameters the
dAD run must match (fp32 round-off): Horovod's tests mostly check that a step runs, this checks
what it computes. Where a test needs what this machine lacks (GPUs, MPI) the docstring says what
runs instead. Two cases are ours: ``resume_broadcast`` (the resume pattern
``hvd.broadcast_optimizer_state`` exists for) and ``forward_before_build``.
"""
from __future__ import annotations

import copy
import faulthandler
import inspect
import itertools
import json
import os
import signal
import sys
import warnings
from collections.abc import Iterable
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

from horovod_dad import DADOptimizer  # noqa: E402

EXACT = {"mode": "exact"}
TOL = 1e-5
WORK = ""
PROCESS_SETS: Dict[str, hvd.ProcessSet] = {}


class Checks:
    """Horovod's asserts, recorded instead of raised; and the worst error against a twin run."""

    def __init__(self):
        self.failures: List[str] = []
        self.worst = 0.0
        self.compared = 0

    def check(self, cond: bool, msg: str) -> None:
        if not cond:
            self.failures.append(msg)

    def same_params(self, ref: nn.Module, mine: nn.Module, what: str) -> None:
        """Every parameter of ``mine`` against the Horovod twin's, relative, floored at 1e-6 of the
        whole model's norm; and identical on every rank."""
        total = sum(float(p.detach().norm()) ** 2 for p in ref.parameters()) ** 0.5
        for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
            err = models.rel_err(b.detach(), a.detach(), 1e-6 * total)
            self.worst = max(self.worst, err)
            self.check(err <= TOL, f"{what}: {name} differs from Horovod's by {err:.2e}")
        for name, err in models.grad_errors(ref, mine).items():  # where both still hold gradients
            self.worst = max(self.worst, err)
            self.check(err <= TOL, f"{what}: {name}'s gradient differs from Horovod's by {err:.2e}")
        self.compared += 1
        flat = torch.cat([p.detach().reshape(-1) for p in mine.parameters()])
        gathered = hvd.allgather(flat.unsqueeze(0), name=f"port.identical.{self.compared}")
        self.check(all(torch.equal(gathered[0], g) for g in gathered), f"{what}: ranks differ")

    def result(self, **extra) -> dict:
        return dict(failures=self.failures, worst=self.worst, compared=self.compared, **extra)


def torch_optimizers() -> list:
    """Horovod's list: every direct subclass of torch.optim.Optimizer in torch.optim but L-BFGS and
    SparseAdam, sorted by name."""
    optimizers = [(subclass.__name__, subclass) for subclass in torch.optim.Optimizer.__subclasses__()
                  if subclass.__module__.startswith('torch.optim') and
                  subclass != torch.optim.LBFGS and subclass != torch.optim.SparseAdam]
    optimizers.sort(key=lambda tup: tup[0])
    return optimizers


def new_optimizer(cls, opt_params, model):
    p = {k: v for k, v in opt_params.items() if k in inspect.signature(cls.__init__).parameters}
    return cls(model.parameters(), **p)


def runs_plain(opt_class, opt_params, model_fn: Callable[[], nn.Module]) -> bool:
    """Whether the plain torch optimizer can step this model at all (Muon takes 2-D parameters only)."""
    model = model_fn()
    try:
        opt = new_optimizer(opt_class, opt_params, model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        return True
    except (ValueError, RuntimeError):
        return False


OPT_PARAMS_LIST = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]


# -- the ported tests ------------------------------------------------------------------------------
def test_broadcast_state() -> dict:
    """Every optimizer: step, save on rank 0, rebuild, load on rank 0 only, broadcast_parameters and
    broadcast_optimizer_state; the state every rank ends with is rank 0's. The fresh optimizer's
    state is empty on rank 1 only: Horovod steps it locally there (hung before)."""
    c = Checks()
    N, D_in, H, D_out = 64, 100, 10, 10
    x = torch.randn(N, D_in).requires_grad_()
    y = torch.randn(N, D_out).requires_grad_()

    def new_model():
        return torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.ReLU(), torch.nn.Linear(H, D_out))

    def create_model(opt_class, opt_params):
        model = new_model()
        optimizer = new_optimizer(opt_class, opt_params, model)
        optimizer = DADOptimizer(optimizer, named_parameters=model.named_parameters(), dad=EXACT)
        return model, optimizer

    def get_model_param_values(model):
        params = sorted(model.state_dict().items())
        return [(k, v.clone()) for k, v in params]

    def get_optimizer_param_values(optimizer):
        results = []
        state_dict = optimizer.state_dict()
        for group in state_dict['param_groups']:
            for param_id in group['params']:
                if param_id not in state_dict['state']:
                    continue
                params = sorted(state_dict['state'][param_id].items())
                for k, v in params:
                    results.append((k, v.clone() if torch.is_tensor(v) else v))
        return results

    ran, skipped = [], []
    for (opt_name, opt_class), opt_params in itertools.product(torch_optimizers(), OPT_PARAMS_LIST):
        if not runs_plain(opt_class, opt_params, new_model):
            skipped.append(opt_name)
            continue
        ran.append(opt_name)
        model, optimizer = create_model(opt_class, opt_params)
        y_pred = model(x)
        loss = F.mse_loss(y_pred, y, reduction='sum')  # Horovod's size_average=False
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        model_param_values = get_model_param_values(model)
        for name, model_param_value in model_param_values:
            hvd.broadcast_(model_param_value, root_rank=0, name=name)

        opt_param_values_updated = []
        opt_param_values = get_optimizer_param_values(optimizer)
        for name, opt_param_value in opt_param_values:
            is_tensor = torch.is_tensor(opt_param_value)
            if is_tensor:
                hvd.broadcast_(opt_param_value, root_rank=0, name=f"{name}_tensor")
            else:
                opt_param_value = hvd.broadcast_object(opt_param_value, name=name)
            opt_param_values_updated.append((name, opt_param_value))
        opt_param_values = opt_param_values_updated

        fname = os.path.join(WORK, f"broadcast_state.rank{hvd.rank()}.pt")  # Horovod's temppath()
        if hvd.rank() == 0:
            state = {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}
            torch.save(state, fname)

        model, optimizer = create_model(opt_class, opt_params)
        if hvd.rank() == 0:
            checkpoint = torch.load(fname, weights_only=False)
            model.load_state_dict(checkpoint['model'])
            optimizer.load_state_dict(checkpoint['optimizer'])
            os.remove(fname)

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        model_param_value_after = get_model_param_values(model)
        for before, after in zip(model_param_values, model_param_value_after):
            name, model_param_value = before
            name_after, model_param_value_after = after
            c.check(name == name_after, f"{opt_name}: {name} != {name_after}")
            c.check(type(model_param_value) == type(model_param_value_after), f"{opt_name}: type of {name}")
            c.check(bool((model_param_value == model_param_value_after).all()), f"{opt_name}: {name} after broadcast")

        expected_tensors = hvd.broadcast_object(len(optimizer.state_dict()['state'].values()))
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        c.check(len(optimizer.state_dict()['state'].values()) == expected_tensors, f"{opt_name}: state size")

        opt_param_values_after = get_optimizer_param_values(optimizer)
        for before, after in zip(opt_param_values, opt_param_values_after):
            name, opt_param_value = before
            name_after, opt_param_value_after = after
            c.check(name == name_after, f"{opt_name}: state {name} != {name_after}")
            c.check(type(opt_param_value) == type(opt_param_value_after), f"{opt_name}: type of state {name}")
            if torch.is_tensor(opt_param_value):
                c.check(bool((opt_param_value == opt_param_value_after).all()), f"{opt_name}: state {name}")
            else:
                c.check(opt_param_value == opt_param_value_after, f"{opt_name}: state {name}")
    return c.result(ran=sorted(set(ran)), skipped=sorted(set(skipped)))


def test_broadcast_state_options() -> dict:
    """Options that differ per rank (lr, momentum, betas...) are rank 0's after
    broadcast_optimizer_state, and their types still work in a step."""
    c = Checks()
    N, D_in, H, D_out = 64, 100, 10, 10
    x = torch.randn(N, D_in).requires_grad_()
    y = torch.randn(N, D_out).requires_grad_()

    params_0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True,
                    betas=(0.9, 0.999), etas=(0.8, 2.4), step_sizes=(1e-5, 100))
    params_1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False,
                    betas=(0.8, 0.9), etas=(0.25, 1.75), step_sizes=(1e-7, 5))

    def new_model():
        return torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.ReLU(), torch.nn.Linear(H, D_out))

    def create_model(opt_class):
        model = new_model()
        params = params_0 if hvd.rank() == 0 else params_1
        p = {k: v for k, v in params.items() if k in inspect.signature(opt_class.__init__).parameters}
        opt = opt_class(model.parameters(), **p)
        opt = DADOptimizer(opt, named_parameters=model.named_parameters(), dad=EXACT)
        return model, opt

    ran = []
    for opt_name, opt_class in torch_optimizers():
        if not runs_plain(opt_class, {}, new_model):
            continue
        ran.append(opt_name)
        model, optimizer = create_model(opt_class)
        y_pred = model(x)
        loss = F.mse_loss(y_pred, y, reduction='sum')
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        p0 = {k: v for k, v in params_0.items() if k in inspect.signature(opt_class.__init__).parameters}
        for k, p in p0.items():
            p_actual = optimizer.param_groups[0][k]
            if not isinstance(p, Iterable):
                p_actual = [p_actual]
                p = [p]
            for i in range(len(p)):
                c.check(type(p_actual[i]) == type(p[i]), f"{opt_name}: type of {k}")
                c.check(abs(p_actual[i] - p[i]) <= 1e-5, f"{opt_name}: {k} {p_actual[i]} != {p[i]}")

        # Ensure that the parameter option types are compatible with ops
        y_pred = model(x)
        loss = F.mse_loss(y_pred, y, reduction='sum')
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return c.result(ran=ran)


def test_broadcast_state_no_grad() -> dict:
    """A parameter without requires_grad keeps grad None through broadcast_optimizer_state; the
    other's zero gradient is the same on every rank."""
    c = Checks()

    class ModelNoGrad(nn.Module):
        def __init__(self, a, b):
            super(ModelNoGrad, self).__init__()
            self.a = nn.Parameter(a.int(), requires_grad=False)
            self.b = nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    a = torch.Tensor([1, 3])
    b = torch.rand(4)
    model = ModelNoGrad(a, b)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    optimizer = DADOptimizer(optimizer, named_parameters=model.named_parameters(), dad=EXACT)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    grad = optimizer.param_groups[0]['params'][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    c.check(optimizer.param_groups[0]['params'][0].grad is None, "a.grad is not None")
    c.check(bool(torch.all(torch.eq(grad, bgrad)).item()), "b.grad differs across ranks")
    return c.result()


def test_force_allreduce() -> dict:
    """Every optimizer: rank 0's loss leaves fc3 without a gradient, rank 1's uses it; step() must
    still reduce every gradient (Horovod's test: no hang). Twin: parameters equal Horovod's."""
    c = Checks()
    rank = hvd.rank()
    N, D_in, H, D_out = 64, 100, 10, 10
    x = torch.randn(N, D_in).requires_grad_()
    y = torch.randn(N, D_out).requires_grad_()

    class Net(torch.nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.fc1 = torch.nn.Linear(D_in, H)
            self.fc2 = torch.nn.Linear(H, D_out)
            self.fc3 = torch.nn.Linear(D_out, D_out)

        def forward(self, x_):
            x_ = F.relu(self.fc1(x_))
            x1_ = self.fc2(x_)
            x2_ = self.fc3(F.relu(x1_))
            return x1_, x2_

    def create_model(opt_class, opt_params, wrap):
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        twin = copy.deepcopy(model)
        opt = wrap(new_optimizer(opt_class, opt_params, model), named_parameters=model.named_parameters())
        opt_twin = hvd.DistributedOptimizer(new_optimizer(opt_class, opt_params, twin),
                                            named_parameters=twin.named_parameters())
        return (model, opt), (twin, opt_twin)

    ran = []
    for (opt_name, opt_class), opt_params in itertools.product(torch_optimizers(), OPT_PARAMS_LIST):
        if not runs_plain(opt_class, opt_params, Net):
            continue
        ran.append(opt_name)
        pairs = create_model(opt_class, opt_params, lambda o, **kw: DADOptimizer(o, dad=EXACT, **kw))
        for model, optimizer in pairs:
            y_pred1, y_pred2 = model(x)
            if rank == 0:
                loss = F.mse_loss(y_pred1, y, reduction='sum')
            else:
                loss = F.mse_loss(y_pred2, y, reduction='sum')
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        c.same_params(pairs[1][0], pairs[0][0], f"{opt_name} {sorted(opt_params)}")
    return c.result(ran=sorted(set(ran)))


def test_model_parallelism() -> dict:
    """Horovod's test places conv1 and conv2 on two GPUs per rank (skipped without them); here both
    are on the CPU and the input is 32x32 instead of 1000x1000. Twin: parameters equal Horovod's."""
    c = Checks()

    class Net(torch.nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.conv1 = torch.nn.Conv2d(1, 100, 1)
            self.conv2 = torch.nn.Conv2d(100, 1, 1)

        def forward(self, x):
            x = self.conv1(x)
            x = self.conv2(x)
            return x

    model = Net()
    twin = copy.deepcopy(model)
    torch.manual_seed(100 + hvd.rank())  # per-rank input, so that the average is not trivial
    inp = torch.rand([1, 1, 32, 32])

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DADOptimizer(opt, named_parameters=model.named_parameters(), dad=EXACT)
    opt_twin = hvd.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                        named_parameters=twin.named_parameters())
    for m, o in ((model, opt), (twin, opt_twin)):
        loss = m(inp).sum()
        o.zero_grad()
        loss.backward()
        o.step()
    c.same_params(twin, model, "model_parallelism")
    reps = sorted({p.representation for p in opt.last_step_report().params})
    return c.result(representations=reps)


def test_delta_optimizer() -> dict:
    """op=hvd.Adasum (Horovod's test also needs MPI and GPUs): dAD rebuilds sums of factors and
    cannot express Adasum, so DADOptimizer refuses it with a ValueError at construction."""
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        DADOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum, dad=EXACT)
        error = ""
    except ValueError as e:
        error = str(e)
    hvd.barrier()
    return Checks().result(error=error)


def test_duplicate_names() -> dict:
    """Duplicate names in named_parameters raise ValueError."""
    c = Checks()
    net1 = torch.nn.Conv2d(1, 1, 1)
    net2 = torch.nn.Conv2d(1, 1, 1)
    parameters = itertools.chain(net1.parameters(), net2.parameters())
    opt = torch.optim.SGD(parameters, lr=0.1)
    named_parameters = itertools.chain(net1.named_parameters(), net2.named_parameters())
    try:
        DADOptimizer(opt, named_parameters=named_parameters, dad=EXACT)
        c.check(False, 'DADOptimizer did not throw error')
    except ValueError:
        pass
    return c.result()


def test_missing_named_parameters() -> dict:
    """Naming half of the parameters raises ValueError."""
    c = Checks()
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        DADOptimizer(opt, named_parameters=list(model.named_parameters())[0:1], dad=EXACT)
        c.check(False, 'DADOptimizer did not throw error')
    except ValueError:
        pass
    return c.result()


def test_no_named_parameters() -> dict:
    """named_parameters=None (and no model=) works; the input is 100x100 instead of Horovod's
    1000x1000 (400 MB of activations). Twin: parameters equal Horovod's."""
    c = Checks()

    class Net(torch.nn.Module):
        def __init__(self):
            super(Net, self).__init__()
            self.conv1 = torch.nn.Conv2d(1, 100, 1)
            self.conv2 = torch.nn.Conv2d(100, 1, 1)

        def forward(self, x):
            x = self.conv1(x)
            x = self.conv2(x)
            return x

    model = Net()
    twin = copy.deepcopy(model)
    torch.manual_seed(200 + hvd.rank())
    inp = torch.rand([1, 1, 100, 100])

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DADOptimizer(opt, dad=EXACT)
    opt_twin = hvd.DistributedOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1))
    for m, o in ((model, opt), (twin, opt_twin)):
        loss = m(inp).sum()
        o.zero_grad()
        loss.backward()
        o.step()
    c.same_params(twin, model, "no_named_parameters")
    return c.result()


def test_optimizer_no_named_parameters() -> dict:
    """Two param groups, no names: unique names, the same on every rank. Ours besides: three
    steps with different data per rank equal Horovod's."""
    c = Checks()
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}, ],
                                lr=0.001)
    optimizer = DADOptimizer(optimizer, dad=EXACT)

    params = optimizer._parameter_names
    c.check(len(params) == len(set(params.values())), "names not unique")
    all_param_names = hvd.allgather_object(set(params.values()))
    c.check(len(all_param_names) == hvd.size(), "allgather_object")
    for param_names in all_param_names:
        c.check(all_param_names[0] == param_names, "names differ across ranks")

    opt_twin = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": twin[0].parameters()}, {"params": twin[1].parameters()}, ], lr=0.001))
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + hvd.rank())
        x, y = torch.randn(4 + 2 * hvd.rank(), 10, generator=g), torch.randn(4 + 2 * hvd.rank(), 10, generator=g)
        for m, o in ((model, optimizer), (twin, opt_twin)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    c.same_params(twin, model, "optimizer_no_named_parameters")
    return c.result(attached=optimizer.dad_synchronizer is not None)


def test_dynamic_requires_grad() -> dict:
    """A GAN's pattern: generator and discriminator each with their own optimizer, requires_grad
    switched off for the half not trained. Twin (ours): parameters equal Horovod's after the first
    two rounds (the values overflow later, Horovod's too), with per-rank inputs. Run with Horovod's
    Conv2d layers (dense in dAD) and, ours, with Linear layers (through factors: the frozen half
    still runs its forward, whose rows must not join its next trained step), in Horovod's order
    and with the discriminator trained first (its first step, the one dAD verifies, is clean)."""
    c = Checks()
    gen = torch.nn.Conv2d(1, 10, 1)
    disc = torch.nn.Conv2d(10, 1, 1)
    torch.manual_seed(300 + hvd.rank())
    inp = torch.rand([1, 1, 100, 100])
    _dynamic_requires_grad(c, gen, disc, inp, "conv")
    torch.manual_seed(301 + hvd.rank())
    inp = torch.rand([4 + 2 * hvd.rank(), 3])
    for disc_first in (False, True):
        torch.manual_seed(0)
        gen, disc = torch.nn.Linear(3, 10), torch.nn.Linear(10, 1)
        _dynamic_requires_grad(c, gen, disc, inp, f"linear{', disc first' if disc_first else ''}", disc_first)
    return c.result()


def _dynamic_requires_grad(c: Checks, gen: nn.Module, disc: nn.Module, inp: torch.Tensor, what: str,
                           disc_first: bool = False) -> None:
    twin_gen, twin_disc = copy.deepcopy(gen), copy.deepcopy(disc)

    def make(gen, disc, wrap):
        gen_opt = torch.optim.SGD(gen.parameters(), lr=0.1)
        gen_opt = wrap(gen_opt, named_parameters=gen.named_parameters())
        disc_opt = torch.optim.SGD(disc.parameters(), lr=0.1)
        disc_opt = wrap(disc_opt, named_parameters=disc.named_parameters())
        return gen_opt, disc_opt

    def train_step(gen, disc, gen_opt, disc_opt, train_generator=False, train_discriminator=False):
        for p in gen.parameters():
            p.requires_grad_(train_generator)
        for p in disc.parameters():
            p.requires_grad_(train_discriminator)

        gen_opt.zero_grad()
        disc_opt.zero_grad()

        loss = disc(gen(inp)).sum()
        loss.backward()

        for p in gen.parameters():
            c.check(train_generator == (p.grad is not None and p.grad.max().is_nonzero()),
                    'Gradient for generator is zero but it should be trained or vice versa.')
        for p in disc.parameters():
            c.check(train_discriminator == (p.grad is not None and p.grad.max().is_nonzero()),
                    'Gradient for discriminator is zero but it should be trained or vice versa.')

        if train_generator:
            gen_opt.step()
        if train_discriminator:
            disc_opt.step()

    runs = [(gen, disc, *make(gen, disc, lambda o, **kw: DADOptimizer(o, dad=EXACT, **kw))),
            (twin_gen, twin_disc, *make(twin_gen, twin_disc, hvd.DistributedOptimizer))]
    for x in range(10):
        for run in runs:
            if disc_first:
                train_step(*run, train_discriminator=True)
            # Step 1: train generator.
            train_step(*run, train_generator=True)
            # Step 2: train discriminator.
            if not disc_first:
                train_step(*run, train_discriminator=True)
        if x < 2:  # lr=0.1 on a sum over 10^4 pixels: Horovod's run overflows from the 7th round on
            c.same_params(twin_gen, gen, f"{what} generator, round {x}")
            c.same_params(twin_disc, disc, f"{what} discriminator, round {x}")
    for opt in runs[0][2:]:  # nothing fell back to dense (the first-step check saw clean factors)
        if opt.dad_synchronizer is not None:
            c.check(not any(u.dense_only for u in opt.dad_synchronizer.units), f"{what}: a weight went dense")


def test_gradient_clipping() -> dict:
    """synchronize(), clip_grad_norm_, step() inside skip_synchronize(). Twin: the same gradient
    before clipping as Horovod's."""
    c = Checks()
    x = torch.ones(1, 1).requires_grad_()
    y = torch.ones(1, 1).requires_grad_()

    def build(wrap):
        model = torch.nn.Linear(1, 1)
        model.weight = torch.nn.Parameter(torch.zeros(1, 1) + 0.5)
        model.bias = torch.nn.Parameter(torch.zeros(1))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, wrap(optimizer, named_parameters=model.named_parameters())

    grads = []
    for wrap in (lambda o, **kw: DADOptimizer(o, dad=EXACT, **kw), hvd.DistributedOptimizer):
        model, optimizer = build(wrap)
        y_pred = model(x)
        loss = F.mse_loss(y_pred, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.synchronize()
        prior_grad = model.weight.grad.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        clipped_grad = model.weight.grad.item()
        c.check(abs(prior_grad) > abs(clipped_grad), "not clipped")
        with optimizer.skip_synchronize():
            optimizer.step()
        grads.append(prior_grad)
    c.check(abs(grads[0] - grads[1]) <= TOL * abs(grads[1]), f"gradient {grads[0]} != Horovod's {grads[1]}")
    return c.result(grads=grads)


def test_synchronize_step_warning() -> dict:
    """synchronize() then step() outside skip_synchronize() warns once, with Horovod's words."""
    c = Checks()
    x = torch.zeros(1, 1).requires_grad_()
    y = torch.ones(1, 1).requires_grad_()

    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = DADOptimizer(optimizer, named_parameters=model.named_parameters(), dad=EXACT)

    y_pred = model(x)
    loss = F.mse_loss(y_pred, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as ws:
        optimizer.step()
        c.check(len(ws) == 1, f"{len(ws)} warnings: {[str(w.message) for w in ws]}")
        c.check(len(ws) >= 1 and 'optimizer.step() called without optimizer.skip_synchronize()'
                in str(ws[0].message), "message")
    return c.result()


def test_sparse_embeddings() -> dict:
    """SparseAdam on a sparse embedding: with sparse_as_dense=True it steps and equals Horovod's
    (twin); with False (Horovod all-gathers sparse gradients) dAD refuses, a ValueError at the
    first forward, which is where it meets the model."""
    c = Checks()
    errors = {}
    for sparse_as_dense in [False, True]:
        class Net(torch.nn.Module):
            def __init__(self):
                super(Net, self).__init__()
                self.embedding = nn.Embedding(10, 3, sparse=True)

            def forward(self, x):
                x = self.embedding(x)
                return x

        model = Net()
        twin = copy.deepcopy(model)

        if hvd.rank() == 0:
            inp = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]])
        else:
            inp = torch.LongTensor([[1, 3, 4], [4, 7, 9]])

        opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
        opt = DADOptimizer(opt, sparse_as_dense=sparse_as_dense, dad=EXACT)
        opt_twin = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(twin.parameters()), lr=0.1),
                                            sparse_as_dense=sparse_as_dense)
        try:
            loss = model(inp).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
        except ValueError as e:
            errors[str(sparse_as_dense)] = str(e)
            continue
        loss = twin(inp).sum()
        opt_twin.zero_grad()
        loss.backward()
        opt_twin.step()
        c.same_params(twin, model, f"sparse_as_dense={sparse_as_dense}")
    return c.result(errors=errors)


def test_optimizer_process_sets() -> dict:
    """An optimizer restricted to the even or the odd ranks (per-rank data): ranks of one set agree.
    The sets are given to hvd.init (Horovod's test adds them dynamically)."""
    c = Checks()
    even_set, odd_set = PROCESS_SETS["even"], PROCESS_SETS["odd"]
    this_set = even_set if hvd.rank() % 2 == 0 else odd_set

    N, D_in, H, D_out = 64, 100, 10, 10
    torch.manual_seed(hvd.rank())
    x = torch.randn(N, D_in).requires_grad_()
    y = torch.randn(N, D_out).requires_grad_()

    def create_model(opt_class, opt_params, process_set):
        model = torch.nn.Sequential(torch.nn.Linear(D_in, H), torch.nn.ReLU(), torch.nn.Linear(H, D_out))
        optimizer = new_optimizer(opt_class, opt_params, model)
        optimizer = DADOptimizer(optimizer, named_parameters=model.named_parameters(),
                                 process_set=process_set, dad=EXACT)
        return model, optimizer

    model, optimizer = create_model(torch.optim.SGD, dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True),
                                    even_set)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    y_pred = model(x)
    loss = F.mse_loss(y_pred, y, reduction='sum')
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    v = model.state_dict()["2.weight"]
    all_v = hvd.allgather(v, process_set=this_set)
    if this_set == even_set:
        for start in range(0, all_v.numel(), v.numel()):
            c.check(torch.allclose(v.flatten(), all_v.flatten()[start:start + v.numel()]), "even set differs")
    else:
        for start in range(0, all_v.numel(), v.numel()):
            if start // v.numel() == this_set.rank():
                continue
            c.check(not torch.allclose(v.flatten(), all_v.flatten()[start:start + v.numel()]), "odd set agrees")
    return c.result()


# -- ours ------------------------------------------------------------------------------------------
RESUME_SAVE_AT, RESUME_STEPS = 3, 6


def resume_broadcast() -> dict:
    """Horovod's resume recipe: train, rank 0 saves; everything built anew (different weights per
    rank), rank 0 loads, broadcast_parameters and broadcast_optimizer_state (rank 1's state is
    empty, so Horovod steps it locally: before the fix it waited in dAD's exchange for ever),
    then the remaining steps. The run must end where the uninterrupted one ends."""
    path = os.path.join(WORK, "resume.pt")

    def new(seed):
        model = models.build("mlp", seed=seed)
        # model= given, so that this checks broadcast_optimizer_state alone (the ported tests go without)
        opt = DADOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                           named_parameters=model.named_parameters(), model=model, dad=EXACT)
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            data = models.batch("mlp", 2 + 2 * hvd.rank(), seed=10_000 * step + hvd.rank())
            opt.zero_grad()
            models.loss_of("mlp", model, data).backward()
            opt.step()

    model, opt = new(0)
    train(model, opt, range(RESUME_SAVE_AT))
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    train(model, opt, range(RESUME_SAVE_AT, RESUME_STEPS))
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    hvd.barrier()

    model, opt = new(1 + hvd.rank())
    if hvd.rank() == 0:
        checkpoint = torch.load(path, weights_only=False)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state_steps = [float(s["step"]) for s in opt.state.values()]
    train(model, opt, range(RESUME_SAVE_AT, RESUME_STEPS))
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(resumed.unsqueeze(0), name="resume.identical")
    return {"rel": float((resumed - straight).norm() / straight.norm()),
            "identical": all(torch.equal(gathered[0], g) for g in gathered),
            "state_steps": state_steps, "attached": opt.dad_synchronizer is not None}


def forward_before_build() -> dict:
    """The model ran before the optimizer was built, and that forward's backward comes after: the
    first step all-reduces as Horovod does (no forward was seen), dAD attaches at the next forward.
    Three steps with per-rank data against Horovod's, with param groups."""
    c = Checks()
    model = models.build("mlp")
    twin = copy.deepcopy(model)
    data = [models.batch("mlp", 2 + 2 * hvd.rank(), seed=10_000 * s + hvd.rank()) for s in range(3)]
    losses = [models.loss_of("mlp", m, data[0]) for m in (model, twin)]

    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
                {"params": [p for n, p in m.named_parameters() if not n.endswith("bias")]}]

    opt = DADOptimizer(torch.optim.AdamW(groups(model), lr=1e-2, weight_decay=0.1),
                       named_parameters=model.named_parameters(), dad=EXACT)
    opt_twin = hvd.DistributedOptimizer(torch.optim.AdamW(groups(twin), lr=1e-2, weight_decay=0.1),
                                        named_parameters=twin.named_parameters())
    attached = []
    for step in range(3):
        for m, o, i in ((model, opt, 0), (twin, opt_twin, 1)):
            loss = losses[i] if step == 0 else models.loss_of("mlp", m, data[step])
            loss.backward()
            o.step()
            o.zero_grad()
        attached.append(opt.dad_synchronizer is not None)
        c.same_params(twin, model, f"step {step}")
    report = opt.last_step_report()
    return c.result(attached=attached, representations=sorted({p.representation for p in report.params}))


def two_optimizers_one_model() -> dict:
    """One model, two DADOptimizers over disjoint parts of it (Adam for the layers, SGD for the
    norm and the head), no model=: both find the same model, and each synchronises its own
    parameters only, as Horovod's two optimizers do. Three steps with per-rank data against
    Horovod's."""
    c = Checks()
    model = models.build("mlp")
    twin = copy.deepcopy(model)

    def split(m):
        first = [p for n, p in m.named_parameters() if n.startswith(("inp", "hidden"))]
        return first, [p for p in m.parameters() if all(p is not q for q in first)]

    opts = []
    for m, wrap in ((model, lambda o, **kw: DADOptimizer(o, dad=EXACT, **kw)), (twin, hvd.DistributedOptimizer)):
        first, second = split(m)
        names = {id(p): n for n, p in m.named_parameters()}
        opts.append([wrap(torch.optim.Adam(first, lr=1e-2), named_parameters=[(names[id(p)], p) for p in first]),
                     wrap(torch.optim.SGD(second, lr=0.1), named_parameters=[(names[id(p)], p) for p in second])])
    for step in range(3):
        data = models.batch("mlp", 2 + 2 * hvd.rank(), seed=10_000 * step + hvd.rank())
        for m, pair in ((model, opts[0]), (twin, opts[1])):
            for o in pair:
                o.zero_grad()
            models.loss_of("mlp", m, data).backward()
            for o in pair:
                o.step()
        c.same_params(twin, model, f"step {step}")
    covered = [sorted(u.name for u in o.dad_synchronizer.units) for o in opts[0]]
    return c.result(units=covered)


CASES = {name: fn for name, fn in list(globals().items())
         if callable(fn) and (name.startswith("test_") or name in ("resume_broadcast", "forward_before_build",
                                                        "two_optimizers_one_model"))}


def main() -> None:
    global WORK
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # a hang killed shows where
    out_path, WORK = sys.argv[1], sys.argv[2]
    size = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "2")))
    PROCESS_SETS["even"] = hvd.ProcessSet(list(range(0, size, 2)))
    PROCESS_SETS["odd"] = hvd.ProcessSet(list(range(1, size, 2)))
    hvd.init(process_sets=list(PROCESS_SETS.values()))
    torch.set_num_threads(1)
    only = sys.argv[3].split(",") if len(sys.argv) > 3 and sys.argv[3] else list(CASES)

    def run(name: str) -> dict:
        torch.manual_seed(0)  # each test as in a fresh process: the same default generator on every rank
        return CASES[name]()

    results = models.run_all({n: n for n in only}, run,
                             lambda case_id, mine: hvd.allgather_object(mine, name=f"results.{case_id}"))
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
