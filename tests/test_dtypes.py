"""Every dtype a user trains in: fp32, bf16 and fp16 parameters through timing, planning, the rank
routes' orthonormalisation, and every engine (issue 25, item 7).

No QR or SVD kernel takes half precision (LAPACK's "geqrf_cpu" nor cuSOLVER's), so `low_rank.qr`
factorises fp16/bf16 in fp32; these tests check that, and that a bf16 and an fp16 model attach
with the defaults (mode auto, objective time: the compute model times the rank routes at attach)
and train in every engine: two jobs (torchrun for all torch.distributed engines, horovodrun for
Horovod) run every case once; the tests read their JSON.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import WORKERS, result, run_torchrun
from dad_integrations.codecs.low_rank import LocalGradient, reduce_rank
from dad_integrations.codecs.power_iteration import orthonormalize_flat, qr
from dad_integrations.plan import main as plan_main

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- orthonormalisation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(DTYPES))
def test_orthonormalize_in_every_dtype(name):
    """Orthonormal columns in the input's dtype, to that dtype's precision (a few ulps of 1 per
    entry of ``Q^T Q - I``), spanning the input (``Q Q^T a = a``), batched or not."""
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 4, generator=g).to(dtype)
    q = qr(a)[0]  # what orthonormalize_flat runs on each block
    assert q.dtype == dtype and q.shape == (64, 4)
    eps = torch.finfo(dtype).eps
    qf = q.double()
    assert float((qf.t() @ qf - torch.eye(4, dtype=torch.float64)).abs().max()) <= 8 * eps
    # the input's span (the projection of a onto Q's columns is a), to the dtype's rounding of a and Q
    proj = qf @ (qf.t() @ a.double())
    assert float((proj - a.double()).norm() / a.double().norm()) <= 16 * eps
    flat = torch.cat([a.reshape(-1), a.reshape(-1), torch.randn(8 * 2, generator=g).to(dtype)])
    blocks = orthonormalize_flat(flat, [(64, 4), (64, 4), (8, 2)], [dtype] * 3)
    assert [b.dtype for b in blocks] == [dtype] * 3
    assert torch.equal(blocks[0], q) and torch.equal(blocks[1], q)


def test_fp32_qr_is_the_kernels_own():
    """fp32 takes torch.linalg.qr directly: the same bits as before half precision was handled."""
    a = torch.randn(50, 6, generator=torch.Generator().manual_seed(1))
    mine, ref = qr(a), torch.linalg.qr(a, mode="reduced")
    assert torch.equal(mine[0], ref[0]) and torch.equal(mine[1], ref[1])


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
@pytest.mark.parametrize("method", ["svd", "factors", "dense"])
def test_reduce_rank_in_half_precision(name, method):
    """Each rank-reduction method (power iteration, exact truncated SVD) runs on half-precision
    factors and gives the rank-r approximation an fp32 run gives, to the dtype's precision."""
    dtype = DTYPES[name]
    g = torch.Generator().manual_seed(2)
    left, right = torch.randn(6, 24, generator=g), torch.randn(6, 20, generator=g)
    q0 = torch.randn(20, 3, generator=g)

    def approx(dt):
        low = reduce_rank(LocalGradient(left=left.to(dt), right=right.to(dt)), 3, method=method,
                          q_init=q0.to(dt), iterations=4)
        assert low.p.dtype == dt and low.components == 3
        return low.p.double() @ low.q.double().t()

    ref, mine = approx(torch.float32), approx(dtype)
    assert torch.isfinite(mine).all()
    assert float((mine - ref).norm() / ref.norm()) <= 40 * torch.finfo(dtype).eps


@pytest.mark.parametrize("name", list(DTYPES))
def test_compute_model_times_every_dtype(name):
    """The compute model (what objective "time" measures at attach) runs for every dtype."""
    from dad_integrations.routing.compute_model import measure_compute
    model = measure_compute([(32, 24)], rank=4, world_size=2, iterations=1, error_feedback=True,
                            device=torch.device("cpu"), dtype=DTYPES[name])
    costs = model.shapes[(32, 24)]
    assert costs.rank_allreduce > 0 and costs.rank > 0


# -- the planner ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_planner_dtype_with_bandwidth(capsys, tmp_path, name):
    """``--dtype`` with ``--bandwidth`` (the compute model measured on CPU): the plan prices the
    wire in the dtype (half of fp32's bytes) and routes by time."""
    tiny = tmp_path / "config.json"  # small shapes: the compute model is measured for each
    tiny.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": 256,
                                "n_positions": 64}))
    args = ["--model", str(tiny), "--sites", "64", "--tokens-per-rank", "256", "--rank", "8",
            "--bandwidth", "100gbit", "--json"]
    outs = {}
    for dtype in ("float32", name):
        assert plan_main(args + ["--dtype", dtype]) == 0
        outs[dtype] = json.loads(capsys.readouterr().out)
    assert outs[name]["allreduce"] == pytest.approx(outs["float32"]["allreduce"] / 2, rel=1e-9)
    t = outs[name]["time"]
    assert math.isfinite(t["dad"]) and t["dad"] <= t["allreduce"] + 1e-12


# -- every engine ---------------------------------------------------------------------------------------
# the defaults (the suite pins objective "bytes" and 0 lossless steps in $DAD_*: name them), with a
# rank, so that the compute model times the rank routes at attach; and the same on a stated slow
# link, so that the rank routes run on the half-precision gradients
DEFAULT = {"mode": "auto", "rank": 4, "objective": "time", "lossless_steps": 0}
SLOW = {**DEFAULT, "link": {"bandwidth": "1mbit", "latency_us": 100}}
TORCH_ENGINES = ["plain", "ddp", "accelerate", "fsdp2", "zero0", "zero1", "zero2", "zero3"]
HALF = ["bfloat16", "float16"]


def _cases(engines) -> dict:
    return {f"{e}-{d}-{c}": {"engine": e, "dtype": d, "config": cfg}
            for e in engines for d in HALF for c, cfg in (("default", DEFAULT), ("slow", SLOW))}


@pytest.fixture(scope="module")
def torch_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("dtypes")
    (work / "cases.json").write_text(json.dumps(_cases(TORCH_ENGINES)))
    run_torchrun(WORKERS / "dtype_worker.py", 2, [work / "out.json", work / "cases.json"], timeout=600)
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def horovod_job(tmp_path_factory):
    pytest.importorskip("horovod.torch")
    from test_horovod import _horovodrun
    work = tmp_path_factory.mktemp("dtypes_hvd")
    (work / "cases.json").write_text(json.dumps(_cases(["horovod"])))
    _horovodrun(2, [WORKERS / "dtype_worker.py", work / "out.json", work / "cases.json", "horovod"],
                work / "out.json", timeout=300)
    return json.loads((work / "out.json").read_text())


def _check_trains(per_rank: list, case_id: str) -> None:
    """Finite losses, parameters that moved, the same on every rank; on the slow link a rank route."""
    for rank, r in enumerate(per_rank):
        assert all(math.isfinite(x) for x in r["losses"]), (case_id, rank, r["losses"])
        assert r["finite"] and r["identical"], (case_id, rank, r)
        assert r["moved"] > 0, (case_id, rank, r)
        if case_id.endswith("-slow"):  # the rank routes ran on half-precision gradients
            assert {"rank", "rank_allreduce"} & set(r["routes"]), (case_id, r["routes"])


@pytest.mark.parametrize("case_id", list(_cases(TORCH_ENGINES)))
def test_half_precision_trains_in_torch_engines(torch_job, case_id):
    _check_trains(result(torch_job, case_id), case_id)


@pytest.mark.parametrize("case_id", list(_cases(["horovod"])))
def test_half_precision_trains_under_horovod(horovod_job, case_id):
    _check_trains(result(horovod_job, case_id), case_id)


def test_deepspeed_runs_in_the_dtype(torch_job):
    """DeepSpeed cast the model itself (its "bf16" / "fp16" config): the cases ran in half precision."""
    for cid, per_rank in torch_job.items():
        if cid.startswith("zero") and "exception" not in per_rank[0]:
            assert per_rank[0]["param_dtype"] == cid.split("-")[1], cid
