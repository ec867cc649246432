"""The compute model's bounded shapes: which shape is timed for each weight, that figures scale to
the full shape by the routes' flop and byte ratios, that a shape within the bound is timed as it is,
and that no probe buffer grows with the model (what objective "time" measures at attach and the
planner measures on ``--compute-device``)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dad_integrations.routing.compute_model import (BOUND_DIM, BOUND_ELEMENTS, EXACT_MAX_ROWS, bounded_shape,
                                                    measure_compute, scale)


class _LargestTensor(TorchDispatchMode):
    """Records the most numbers any tensor made under it holds (torch's own dispatch hook)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_bounded_shape():
    # within the bound: timed as it is (GPT-2's and TinyLlama's attention, a 2048 x 2048 square)
    for shape in [(32, 48), (768, 2304), (768, 3072), (256, 2048), (2048, 2048)]:
        assert bounded_shape(shape, 4) == shape
    # beyond it: each dimension capped, a thin side kept
    assert bounded_shape((50257, 768), 4) == (BOUND_DIM, 768)
    assert bounded_shape((32000, 4096), 4) == (BOUND_DIM, BOUND_DIM)
    assert bounded_shape((4096, 11008), None) == (BOUND_DIM, BOUND_DIM)
    assert bounded_shape((3000, 2048), 4) == (BOUND_DIM, 2048)
    # a rank above the cap is kept: the power iteration runs at the full shape's r
    assert bounded_shape((8192, 8192), 4096) == (4096, 4096)
    for shape in [(50257, 768), (32000, 4096), (100000, 100000)]:
        m, n = bounded_shape(shape, 16)
        assert m * n <= BOUND_ELEMENTS
    with pytest.raises(ValueError, match="positive dimensions"):
        bounded_shape((0, 8), 4)


@pytest.mark.parametrize("shape, rank", [((32000, 4096), 4), ((4096, 11008), 16), ((50257, 768), 1),
                                         ((8192, 8192), 4096)])
def test_scale_is_every_route_terms_ratio(shape, rank):
    """Each route's flops (module doc) and its passes over ``m n`` grow by the same factor from the
    bounded shape to the full one, the factor the timed seconds are multiplied by."""
    def terms(m, n, k=2, sites=64, rows=EXACT_MAX_ROWS):
        r = min(rank, m, n)
        return {"power iteration": k * 4 * m * n * r, "rebuild P Q^T": 2 * m * n * r,
                "rank-S r rebuild": 2 * sites * r * m * n, "exact rebuild": 2 * rows * m * n,
                "compensation and residual passes": 3 * m * n}

    bounded = bounded_shape(shape, rank)
    factor = scale(shape, bounded)
    assert factor > 1
    full, small = terms(*shape), terms(*bounded)
    for name in full:
        assert full[name] / small[name] == pytest.approx(factor, rel=1e-12), name


def test_measure_times_bounded_shapes_only():
    """A 50000 x 8192 weight (1.6 GB in fp32) is timed as 2048 x 2048, once for every shape mapped
    there, and scaled; no tensor of the measurement holds more than the bound; a shape within the
    bound keeps its own timing, unscaled."""
    shapes = [(50000, 8192), (2048, 2048), (3000, 2048), (256, 2048)]
    with _LargestTensor() as largest:
        model = measure_compute(shapes, rank=4, world_size=64, iterations=1, error_feedback=True,
                                device=torch.device("cpu"))
    assert largest.numel <= BOUND_ELEMENTS
    assert model.timed_as == {(50000, 8192): (2048, 2048), (2048, 2048): (2048, 2048),
                              (3000, 2048): (2048, 2048), (256, 2048): (256, 2048)}
    base = model.shapes[(2048, 2048)]
    for shape in [(50000, 8192), (3000, 2048)]:
        c, f = model.shapes[shape], shape[0] * shape[1] / 2048 ** 2
        assert c.rank_allreduce == pytest.approx(base.rank_allreduce * f, rel=1e-12)
        assert c.rank == pytest.approx(base.rank * f, rel=1e-12)
        assert c.exact_per_row == pytest.approx(base.exact_per_row * f, rel=1e-12)
    assert all(v > 0 for v in (base.rank_allreduce, base.rank, base.exact_per_row))
    # the compute model answers for the full shapes with the scaled figures
    rows = [[10]] * 64
    assert model.seconds("rank", (50000, 8192), rows_by_rank=rows, world_size=64) == \
        pytest.approx(base.rank * 50000 * 8192 / 2048 ** 2, rel=1e-12)


def test_measure_without_rank():
    """Exact only (no rank): the rank routes cost nothing and the bound is ``BOUND_DIM``."""
    model = measure_compute([(5000, 1000)], rank=None, world_size=2, iterations=1, error_feedback=False,
                            device=torch.device("cpu"))
    assert model.timed_as == {(5000, 1000): (BOUND_DIM, 1000)}
    c = model.shapes[(5000, 1000)]
    assert c.rank == 0 and c.rank_allreduce == 0 and c.exact_per_row > 0
