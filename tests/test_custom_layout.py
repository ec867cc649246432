"""A sharded layout defined entirely in this file plugs into an existing engine (FSDP2).

The layout, `GatheredRows`, moves exact factors over FSDP2's row shards as the flat layout moves
them: every rank's factors all-gathered, each rank rebuilding the average and keeping its own rows;
the engine's own reduce-scatter takes the rest. It is the layout part of a call only
(`exchange.sharded.ShardedCall`): FSDP2's engine part (`fsdp_calls.FSDPEngineCall`: units, rows,
its reduce-scatter, the step's end) and the `ShardedExchanger` (row counts, the first call's check,
routes, finiteness) are reused as they are (docs/architecture.md, "Adding a sharded layout").

One ``torchrun`` job of 2 CPU ranks (this file is its worker: ``python tests/test_custom_layout.py
OUT.json``) runs one backward under FSDP2 alone and under FSDP2 with dAD on this layout: every
weight went through the layout, and each rank's sharded gradients equal FSDP2's own to fp32 round-off.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dad_integrations.capture.rows import compute_dtype
from dad_integrations.codecs.exact import ExactCodec, rebuild_unit
from dad_integrations.exchange.row_shards import RowShardCall
from dad_integrations.exchange.sharded import CallRoutes


# --8<-- [start:layout]
class GatheredRows(RowShardCall):
    """Exact factors on FSDP2's row shards, moved as the flat layout moves them: every rank's factors
    all-gathered, each rank rebuilding the average and keeping its own rows; the rest by the engine."""

    def exchange(self, routes: CallRoutes) -> None:
        codec, covered, rank = ExactCodec(self.route_wire, self.sink.inp.device), set(), self.aggregator.rank
        for unit in routes.exact:
            stacked, traffic = codec.gather_rows(unit, self.rows[unit.index], routes.counts[unit.index],
                                                 self.aggregator, f"dad.gathered.{unit.name}")
            c = self.sink.slot(unit.param).rows  # rows [rank c, (rank+1) c) are this rank's
            shards = {p: g[rank * c:(rank + 1) * c] * self.scale
                      for p, g in rebuild_unit(unit, stacked, compute_dtype(unit.param)).items()}
            self._put_exact(unit, shards, routes.report, covered).add_traffic(traffic)
        self.reduce_rest([s for s in self.slots if id(s.param) not in covered], routes.report)
# --8<-- [end:layout]


class _Counted(GatheredRows):
    """`GatheredRows`, counting the weights it exchanged (the job checks the layout really ran)."""

    exchanged = 0

    def exchange(self, routes: CallRoutes) -> None:
        _Counted.exchanged += len(routes.exact)
        super().exchange(routes)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8, bias=False))


def _sharded_grads(with_dad: bool):
    """One backward under FSDP2 (with dAD on `GatheredRows`, or alone): this rank's gradient shards."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from dad_integrations.fsdp import enable_dad_fsdp
    model = _model()
    for block in (model[0], model[2]):
        fully_shard(block)
    fully_shard(model)
    sync = None
    if with_dad:
        sync = enable_dad_fsdp(model, {"mode": "exact"})
        sync.row_layout = _Counted  # the engine part stays FSDP2's; the layout is this file's
    x = torch.randn(6 + dist.get_rank(), 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    out = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    report = sync.last_step_report() if sync is not None else None
    if sync is not None:
        sync.close()
    return out, report


def worker(out: Path) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ref, _ = _sharded_grads(False)
    got, report = _sharded_grads(True)
    errors = {n: float((got[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref.items()}
    result = {"errors": errors, "exchanged": _Counted.exchanged,
              "routes": {p.name: p.representation for p in report.params}}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, result)
    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    from models import write_and_exit
    write_and_exit(str(out), every)


def test_a_layout_defined_in_this_file_gives_the_engines_gradients(tmp_path):
    from conftest import run_torchrun
    out = tmp_path / "layout.json"
    run_torchrun(Path(__file__), 2, [out], timeout=600)
    for rank in json.loads(out.read_text()):
        assert rank["exchanged"] == 2, rank  # both weights went through the layout
        assert rank["routes"]["0.weight"] == rank["routes"]["2.weight"] == "exact", rank
        for name, err in rank["errors"].items():
            assert err < 1e-5, (name, err, rank)


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
