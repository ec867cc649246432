"""rank reduction on one site: exact component counts, quality against the SVD, exactness."""
import pytest
import torch

from dad_integrations.codecs.finite import finite_flag
from dad_integrations.codecs.low_rank import LocalGradient, choose_method, reduce_rank, truncated_svd
from dad_integrations.codecs.power_iteration import orthonormalize_flat, qr


def factors(n_rows=40, m=30, n=20, seed=0, decay=True):
    g = torch.Generator().manual_seed(seed)
    left = torch.randn(n_rows, m, generator=g, dtype=torch.float64)
    right = torch.randn(n_rows, n, generator=g, dtype=torch.float64)
    if decay:  # a spectrum that decays, like real gradients
        left = left * torch.logspace(0, -2, n_rows, dtype=torch.float64).unsqueeze(1)
    return left, right


def best_error(mat, r):
    s = torch.linalg.svdvals(mat)
    return float(s[r:].pow(2).sum().sqrt())


@pytest.mark.parametrize("method", ["svd", "factors", "dense"])
@pytest.mark.parametrize("r", [1, 3, 7])
def test_exactly_r_components(method, r):
    left, right = factors()
    m = LocalGradient(left=left, right=right)
    q0 = torch.randn(20, r, dtype=torch.float64)
    low = reduce_rank(m, r, method=method, q_init=q0, iterations=2)
    assert low.components == r and low.p.shape == (30, r) and low.q.shape == (20, r)


@pytest.mark.parametrize("method", ["factors", "dense"])
def test_power_iteration_reaches_svd_quality(method):
    left, right = factors()
    mat = left.t() @ right
    r = 4
    q0 = torch.randn(20, r, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    low = reduce_rank(LocalGradient(left=left, right=right), r, method=method, q_init=q0, iterations=10)
    err = float((mat - low.p @ low.q.t()).norm())
    assert err <= 1.05 * best_error(mat, r)


def test_svd_is_the_best_rank_r():
    left, right = factors()
    mat = left.t() @ right
    p, q = truncated_svd(left, right, 5)
    assert float((mat - p @ q.t()).norm()) == pytest.approx(best_error(mat, 5), rel=1e-9)


@pytest.mark.parametrize("method", ["svd", "factors", "dense"])
def test_rank_at_or_above_true_rank_rebuilds_exactly(method):
    left, right = factors(n_rows=3)  # true rank 3
    mat = left.t() @ right
    q0 = torch.randn(20, 5, dtype=torch.float64)
    low = reduce_rank(LocalGradient(left=left, right=right), 5, method=method, q_init=q0, iterations=1)
    assert low.components == 3  # fewer only because the gradient's rank is lower
    assert float((mat - low.p @ low.q.t()).norm()) <= 1e-10 * float(mat.norm())


def test_adaptive_tolerance_keeps_fewest_components():
    left, right = factors()
    mat = left.t() @ right
    low = reduce_rank(LocalGradient(left=left, right=right), 10, method="svd", q_init=None, iterations=1,
                      tolerance=0.5)
    s2 = torch.linalg.svdvals(mat).pow(2)
    share = torch.cumsum(s2, 0) / s2.sum()
    assert low.components == int((share < 0.5).sum()) + 1


def test_method_choice_follows_flops():
    assert choose_method(4, 768, 768, 4, 1, factors_available=True) == "svd"
    assert choose_method(64, 768, 768, 4, 1, factors_available=True) == "factors"
    assert choose_method(8192, 768, 768, 4, 1, factors_available=True) == "dense"
    assert choose_method(4, 768, 768, 4, 1, factors_available=False) == "dense"


def test_products_in_any_layout_and_buffer_equal_the_plain_ones():
    """``mm`` (q row- or column-major, into a buffer) and ``rmm_t`` (``p^T M``) are ``M q`` and
    ``(M^T p)^T``, dense and on factors (the layouts change the summation order only)."""
    left, right = factors()
    dense = left.t() @ right
    q, p = torch.randn(20, 3, dtype=torch.float64), torch.randn(30, 3, dtype=torch.float64)
    for m in (LocalGradient(dense=dense), LocalGradient(left=left, right=right)):
        for q_layout in (q, q.t().contiguous().t()):
            out = torch.empty(30, 3, dtype=torch.float64)
            assert m.mm(q_layout, out=out) is out
            torch.testing.assert_close(out, dense @ q, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.rmm_t(p), (dense.t() @ p).t(), rtol=1e-12, atol=1e-12)


def test_orthonormalize_flat_is_one_qr_per_block():
    """Runs of same-shape, same-dtype blocks go through one batched QR: the same bits as one QR per
    block (CPU), shapes and dtypes interleaved."""
    shapes = [(8, 2), (8, 2), (5, 3), (8, 2), (8, 2), (8, 2)]
    dtypes = [torch.float64] * 4 + [torch.float32] * 2
    blocks = [torch.randn(s, dtype=torch.float64) for s in shapes]
    flat = torch.cat([b.reshape(-1) for b in blocks])
    got = orthonormalize_flat(flat, shapes, dtypes)
    for g, b, dt in zip(got, blocks, dtypes):
        assert g.dtype == dt and torch.equal(g, qr(b.to(dt))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_finite_flag_is_isfinite_all(dtype):
    """One aminmax pass decides what ``isfinite(t).all()`` does: NaN, +Inf, -Inf anywhere, empty."""
    t = torch.randn(7, 5).to(dtype)
    assert bool(finite_flag(t)) and bool(finite_flag(t[:0]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[3, 2] = bad
        assert not bool(finite_flag(u)) and not bool(finite_flag(u[:, 2]))
    assert bool(finite_flag(torch.arange(4)))
