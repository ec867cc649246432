"""The sharded rank-r routes' algebra on one process (`dad_integrations.codecs.sharded_rank`).

The pure functions are checked against the unsharded codecs' rebuild directly. The codec itself
runs S simulated ranks as threads over an in-process aggregator (`_ThreadAggregator`: every
collective meets at a barrier), beside the unsharded codecs (`codecs.rank`,
`codecs.rank_allreduce`) fed the same local gradients: each rank's shard must be its rows of the
unsharded rebuild, step after step (warm starts and error feedback included), for ragged and empty
shards, and the exact average at full rank.
"""
import threading
from typing import Callable, List

import pytest
import torch
from torch import nn

from dad_integrations.comm.aggregator import EqualSizeAggregator
from dad_integrations.codecs.rank import RankCodec
from dad_integrations.codecs.rank_allreduce import RankAllReduceCodec
from dad_integrations.codecs.exact import decode_sliced, encode_sliced, shard_span
from dad_integrations.codecs.sharded_rank import ShardedRankCodec, reduced_elements, reduced_shard
from dad_integrations.config import DADConfig
from dad_integrations.codecs.route_state import RouteState
from dad_integrations.report import ParamReport
from dad_integrations.capture.assign import build_plan

F64 = torch.float64
# (m, n, S): even shards, ragged ones, an empty last shard (3 rows over 4 ranks: 1/1/1/0; 5: 2/2/1/0)
LAYOUTS = [(8, 6, 2), (7, 5, 2), (7, 5, 3), (5, 4, 4), (3, 6, 4), (9, 4, 4)]


class _ThreadAggregator(EqualSizeAggregator):
    """Rank ``rank`` of S threads: every collective posts its tensor, meets the others at a barrier,
    and reads theirs (sums in rank order, so every rank gets the same bits)."""

    def __init__(self, board: dict, rank: int, world: int):
        super().__init__()
        self._rank, self._world, self.board = rank, world, board

    def _meet(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        self.board["slots"][self._rank] = tensor.clone()
        self.board["barrier"].wait()
        got = list(self.board["slots"])
        self.board["barrier"].wait()
        return got

    def _engine_all_gather(self, out, tensor, async_op=False):
        for o, t in zip(out, self._meet(tensor)):
            o.copy_(t)

    def _engine_all_reduce(self, tensor, async_op=False):
        got = self._meet(tensor)
        total = got[0].clone()
        for t in got[1:]:
            total += t
        tensor.copy_(total)

    def _engine_all_to_all(self, out, tensor, async_op=False):
        for s, t in enumerate(self._meet(tensor)):
            out[s].copy_(t[self._rank])


def _run_ranks(world: int, fn: Callable[[int, _ThreadAggregator], object]) -> list:
    """``fn(rank, aggregator)`` on ``world`` threads; their results by rank (a raise fails the test)."""
    board = {"barrier": threading.Barrier(world), "slots": [None] * world}
    results, errors = [None] * world, []

    def body(rank):
        try:
            results[rank] = fn(rank, _ThreadAggregator(board, rank, world))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others are released
            errors.append(exc)
            board["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def _unit(kind: str, m: int, n: int, rank: int):
    """A real factor unit of one layer (weight m x n), and its plan (captures to remove)."""
    torch.manual_seed(0)
    layer = nn.Linear(n, m, bias=False).double() if kind == "linear" else nn.Embedding(m, n).double()
    plan = build_plan(layer, DADConfig(mode="rank", rank=rank))
    return plan.units[0], plan


def _local_grads(world: int, m: int, n: int, step: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + 7)
    # a shared component plus noise per site: a gradient a low rank does not capture exactly
    common = torch.randn(m, 2, generator=g, dtype=F64) @ torch.randn(2, n, generator=g, dtype=F64)
    return [common + 0.3 * torch.randn(m, n, generator=g, dtype=F64) for _ in range(world)]


def _check_shard(shard: torch.Tensor, full: torch.Tensor, rank: int, world: int, tol: float = 1e-10) -> None:
    a, b, _ = shard_span(rank, world, full.shape[0])
    assert shard.shape == (b - a, full.shape[1])
    torch.testing.assert_close(shard, full[a:b], rtol=tol, atol=tol)


@pytest.mark.parametrize("m,n,world", LAYOUTS)
def test_row_blocks_are_the_shards_zero_padded(m, n, world):
    p, q = torch.randn(m, 3, dtype=F64), torch.randn(n, 3, dtype=F64)
    q_flat, blocks = encode_sliced([(p.t(), q.t())], [[3]] * world, m, world, F64)  # P^T, Q^T as 3 rows
    c = -(-m // world)
    assert blocks.shape == (world, 3, c) and torch.equal(q_flat, q.t().reshape(-1))
    for d in range(world):
        a, b, _ = shard_span(d, world, m)
        assert torch.equal(blocks[d, :, :b - a], p[a:b].t()) and not blocks[d, :, b - a:].any()


@pytest.mark.parametrize("m,n,world", LAYOUTS)
def test_sliced_p_and_gathered_q_give_the_rows_of_the_unsharded_rebuild(m, n, world):
    """``sum_s P_s[a:b] Q_s^T`` from the all-to-all's P rows and the gathered Q's equals rows a:b of
    the all-gather codec's rank-S·r rebuild (`RankCodec.decode`)."""
    r, scale = 2, 1.0 / world
    unit, plan = _unit("linear", m, n, r)
    ps = [torch.randn(m, r, dtype=F64) for _ in range(world)]
    qs = [torch.randn(n, r, dtype=F64) for _ in range(world)]
    left, right = RankCodec.decode(unit, torch.cat([torch.cat([p.t(), q.t()], 1) for p, q in zip(ps, qs)]), scale)
    full = left @ right
    for d in range(world):
        sent = [encode_sliced([(p.t(), q.t())], [[r]] * world, m, world, F64) for p, q in zip(ps, qs)]
        received = torch.stack([blocks[d] for _, blocks in sent])  # the all-to-all, by hand
        shard = decode_sliced(("linear",), (m, n), [q for q, _ in sent], received, [[r]] * world, d, (), F64)[0]
        shard *= scale
        a, b, c = shard_span(d, world, m)
        assert shard.shape == (c, n) and not shard[b - a:].any()
        _check_shard(shard[:b - a], full, d, world, 1e-12)
        _check_shard(reduced_shard(ps[0], qs[0], d, world, scale), scale * ps[0] @ qs[0].t(), d, world, 1e-12)
    for c in plan.captures:
        c.remove()


@pytest.mark.parametrize("lo,hi", [(0, 35), (3, 4), (4, 17), (10, 10), (30, 35), (5, 10)])
def test_reduced_elements_are_the_flat_range_of_the_rebuild(lo, hi):
    """A ZeRO partition's elements ``[lo, hi)`` of ``scale P^ Q'^T`` (7 x 5, cut mid-row too), from
    the covering rows only."""
    basis, q = torch.randn(7, 2, dtype=F64), torch.randn(5, 2, dtype=F64)
    got = reduced_elements(basis, q, lo, hi, 0.5)
    torch.testing.assert_close(got, (0.5 * basis @ q.t()).reshape(-1)[lo:hi], rtol=1e-12, atol=1e-12)


def _step_both(route: str, unit, config: DADConfig, grads: List[torch.Tensor], steps: int):
    """Per thread-rank: run the unsharded codec and the sharded one on the same local gradients
    for ``steps`` steps; returns per step (unsharded rebuild, this rank's shard) and the residuals."""
    world = len(grads[0])
    scale = 1.0 / world

    def body(rank, agg):
        u, plan = _unit("linear" if unit.factors_only else "embedding", *unit.param.shape, config.rank)
        whole_state = RouteState(config)
        whole = (RankCodec(config, None, whole_state) if route == "rank"
                 else RankAllReduceCodec(config, None, whole_state))
        sharded = ShardedRankCodec(config, None)
        out = []
        for step in range(steps):
            m_s = grads[step][rank]
            local_grad = (lambda p, dtype, g=m_s: g.to(dtype))
            entry = ParamReport(u.name, route, tuple(u.param.shape))
            if route == "rank":
                payload = whole.encode(u, [], local_grad, entry, step)
                stacked = torch.cat(agg.all_gather(payload, name="whole").wait())
                left, right = whole.decode(u, stacked, scale)
                full = left @ right
            else:
                item = whole.queue_item(u, [], local_grad, entry, step)
                left, right = whole.start([item], agg, lambda t: t)(scale)[0]
                full = left @ right
            sharded.state.start_step()
            sharded.state.note_local(m_s)
            item = sharded.local(u, [], local_grad, route)
            shard = sharded.exchange([item], agg, scale, step, F64)[0].shard
            sharded.state.end_step(aggregator=agg)
            whole_state.end_step()
            out.append((full, shard, whole_state.memory.dense(u.name), sharded.memory.dense(u.name)))
        for c in plan.captures:
            c.remove()
        return out

    return _run_ranks(world, body)


@pytest.mark.parametrize("route", ["rank", "rank_allreduce"])
@pytest.mark.parametrize("kind", ["linear", "embedding"])
@pytest.mark.parametrize("m,n,world", [(7, 5, 2), (7, 5, 3), (5, 4, 4), (3, 6, 4)])
@pytest.mark.parametrize("ef_rank", [None, 1])
def test_codec_shards_are_rows_of_the_unsharded_codecs_rebuild(route, kind, m, n, world, ef_rank):
    """Three steps (warm starts, error feedback whole or at rank 1) with rank 2: every rank's shard
    is its rows of what the unsharded codec rebuilds from the same local gradients, and the
    residuals agree."""
    config = DADConfig(mode="rank", rank=2, rank_route="allgather" if route == "rank" else "allreduce",
                       error_feedback_rank=ef_rank)
    unit, plan = _unit(kind, m, n, 2)
    grads = [_local_grads(world, m, n, step) for step in range(3)]
    per_rank = _step_both(route, unit, config, grads, steps=3)
    for rank, steps in enumerate(per_rank):
        for step, (full, shard, residual, sharded_residual) in enumerate(steps):
            _check_shard(shard, full, rank, world)
            torch.testing.assert_close(sharded_residual, residual, rtol=1e-10, atol=1e-10)
            exact = sum(grads[step]) / world
            assert float((full - exact).norm()) > 1e-3 * float(exact.norm())  # rank 2 is lossy here
    for c in plan.captures:
        c.remove()


@pytest.mark.parametrize("route", ["rank", "rank_allreduce"])
@pytest.mark.parametrize("m,n,world", [(7, 5, 3), (3, 6, 4), (9, 4, 4)])
def test_full_rank_gives_the_exact_average(route, m, n, world):
    """With r >= min(m, n) both routes rebuild the exact average. The all-gather route leaves no
    residual; the all-reduce route's residuals ``M_s - P^ P^^T M_s`` need not vanish (P^ spans the
    sum's columns, not each site's) but sum to zero over sites."""
    config = DADConfig(mode="rank", rank=max(m, n), rank_route="allgather" if route == "rank" else "allreduce")
    unit, plan = _unit("linear", m, n, config.rank)
    grads = [_local_grads(world, m, n, step) for step in range(2)]
    per_rank = _step_both(route, unit, config, grads, steps=2)
    for step in range(2):
        norm = float(sum(grads[step]).norm())
        for rank, steps in enumerate(per_rank):
            _check_shard(steps[step][1], sum(grads[step]) / world, rank, world)
            if route == "rank":
                assert float(steps[step][3].norm()) < 1e-10 * norm
        assert float(sum(steps[step][3] for steps in per_rank).norm()) < 1e-10 * norm
    for c in plan.captures:
        c.remove()


@pytest.mark.parametrize("route", ["rank", "rank_allreduce"])
def test_factor_products_equal_dense_products_and_rebuild_at_full_rank(route):
    """Without error feedback and with few rows, ``M_s`` stays as factors: ``M Q = D^T (X Q)`` and
    ``M^T P = X^T (D P)`` equal the dense products, and at full rank the shards are exact."""
    m, n, world, rows = 9, 7, 3, 2
    config = DADConfig(mode="rank", rank=7, error_feedback=False,
                       rank_route="allgather" if route == "rank" else "allreduce")
    g = torch.Generator().manual_seed(3)
    factors = [(torch.randn(rows, m, generator=g, dtype=F64), torch.randn(rows, n, generator=g, dtype=F64))
               for _ in range(world)]
    dense = [d.t() @ x for d, x in factors]

    def body(rank, agg):
        unit, plan = _unit("linear", m, n, config.rank)
        codec = ShardedRankCodec(config, None)
        item = codec.local(unit, [factors[rank]], lambda p, dtype: dense[rank], route)
        assert item.method in (("svd", "factors") if route == "rank" else ("factors",))
        q, p = torch.randn(n, 3, dtype=F64), torch.randn(m, 3, dtype=F64)
        torch.testing.assert_close(item.local.mm(q), dense[rank] @ q)
        torch.testing.assert_close(item.local.rmm_t(p), (dense[rank].t() @ p).t())
        codec.state.start_step()
        shard = codec.exchange([item], agg, 1.0 / world, 0, F64)[0].shard
        codec.state.end_step(aggregator=agg)
        for c in plan.captures:
            c.remove()
        return shard

    for rank, shard in enumerate(_run_ranks(world, body)):
        _check_shard(shard, sum(dense) / world, rank, world)


@pytest.mark.parametrize("route", ["rank", "rank_allreduce"])
@pytest.mark.parametrize("ef_rank", [None, 2])
def test_a_non_finite_step_leaves_residuals_and_warm_starts_untouched(route, ef_rank):
    """Rank 1's gradient is NaN at step 1: no rank raises, every non-empty shard is non-finite, and
    every rank keeps the state of step 0; step 2 is finite and moves the state again."""
    m, n, world = 7, 5, 3
    config = DADConfig(mode="rank", rank=2, rank_route="allgather" if route == "rank" else "allreduce",
                       error_feedback_rank=ef_rank)

    def state(codec):  # a low-rank residual is a pair (U, V): one entry each
        flat = {}
        for name, s in codec.state.state_dict().items():
            for k, v in s.items():
                for i, t in enumerate(v if isinstance(v, tuple) else (v,)):
                    if t is not None:
                        flat[(name, k, i)] = t.clone()
        return flat

    def body(rank, agg):
        unit, plan = _unit("linear", m, n, 2)
        codec = ShardedRankCodec(config, None)
        states, finite = [], []
        for step in range(3):
            m_s = _local_grads(world, m, n, step)[rank]
            if step == 1 and rank == 1:
                m_s = m_s * float("nan")
            codec.state.start_step()
            codec.state.note_local(m_s)
            item = codec.local(unit, [], lambda p, dtype, g=m_s: g, route)
            shard = codec.exchange([item], agg, 1.0 / world, step, F64)[0].shard
            traffic = codec.state.end_step(aggregator=agg)
            assert traffic.calls == 1  # the finiteness agreement: one all-reduce of one number
            states.append(state(codec))
            finite.append(bool(torch.isfinite(shard).all()))
        for c in plan.captures:
            c.remove()
        return states, finite

    for rank, (states, finite) in enumerate(_run_ranks(world, body)):
        assert finite == [True, False, True]  # shards of 3, 3 and 1 rows: none is empty
        assert states[0] and states[0].keys() == states[1].keys()
        assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])     # step 1 left no trace
        assert any(not torch.equal(states[1][k], states[2][k]) for k in states[1])  # step 2 moved on
