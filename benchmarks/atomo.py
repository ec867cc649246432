"""Spectral ATOMO (Wang et al., NeurIPS 2018) as a DDP communication hook: the baseline that
sparsifies each gradient matrix's singular-value decomposition without bias.

For a gradient matrix ``M = sum_i sigma_i u_i v_i^T`` and a budget of ``s`` atoms (here the same
rank ``r`` the low-rank methods use), atom ``i`` is kept with probability ``p_i`` and scaled by
``1 / p_i``, so that the estimate ``sum_i [kept_i] / p_i * sigma_i u_i v_i^T`` has expectation
``M``. The variance ``sum_i sigma_i^2 (1/p_i - 1)`` is smallest, subject to ``sum_i p_i = s`` and
``0 < p_i <= 1``, for ``p_i = min(1, c * sigma_i)`` with ``c`` set so that the probabilities add up
to ``s`` (the paper's Algorithm 2: cap the largest atoms at 1 and share the rest of the budget in
proportion to sigma among the others).

Each rank samples its own atoms (its own generator); the number kept varies, so one small
all-gather per bucket agrees the counts, then one all-gather moves every rank's kept atoms
(``sigma_i / p_i * u_i`` and ``v_i``), zero-padded to the longest rank for each matrix. Every rank
rebuilds the same average from the same gathered atoms in the same order, so all ranks end with
identical gradients. Vectors (biases, norms), and matrices the budget would not shrink, are
all-reduced densely in the same hook.
"""

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed as dist


def atomo_probabilities(sigma: torch.Tensor, budget: float) -> torch.Tensor:
    """Variance-minimising keep probabilities for singular values ``sigma`` (any order).

    Returns ``p`` with ``0 <= p_i <= 1``, ``sum p = min(budget, #nonzero sigma)`` and
    ``p_i = min(1, c sigma_i)``; atoms with ``sigma_i = 0`` get ``p_i = 0``.
    """
    sigma = sigma.clamp_min(0)
    nonzero = int((sigma > 0).sum())
    p = torch.zeros_like(sigma)
    if nonzero == 0 or budget <= 0:
        return p
    if budget >= nonzero:
        return (sigma > 0).to(sigma.dtype)
    order = torch.argsort(sigma, descending=True)
    s = sigma[order]
    tail = torch.flip(torch.cumsum(torch.flip(s, [0]), 0), [0])  # tail[k] = sum_{j >= k} s_j
    for k in range(int(budget) + 1):  # k largest atoms capped at 1
        if k < s.numel() and tail[k] > 0 and (budget - k) * s[k] <= tail[k]:
            ps = torch.ones_like(s)
            ps[k:] = (budget - k) * s[k:] / tail[k]
            p[order] = ps.clamp_(max=1.0)
            return p
    p[order[:nonzero]] = 1.0
    return p


def atomo_sample(matrix: torch.Tensor, budget: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """One unbiased ATOMO estimate of ``matrix`` as factors ``(left, right)``, ``left^T right``.

    ``left`` is (k, m) = the kept ``sigma_i / p_i * u_i``, ``right`` is (k, n) = the kept ``v_i``.
    """
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    p = atomo_probabilities(s, budget)
    draw = torch.rand(p.shape, generator=generator, device=p.device, dtype=p.dtype)
    keep = torch.nonzero(draw < p).flatten()
    scale = s[keep] / p[keep]
    return (u[:, keep] * scale).t().contiguous(), vh[keep].contiguous()


@dataclass
class AtomoState:
    """State of the ATOMO hook: group, atom budget per matrix, this rank's generator."""

    process_group: Optional[dist.ProcessGroup]
    budget: int
    seed: int = 0
    generator: torch.Generator = field(init=False)
    atoms_sent: int = 0

    def __post_init__(self) -> None:
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        self.generator = torch.Generator().manual_seed(1_000_003 * self.seed + rank)


def _layout(bucket: dist.GradBucket, budget: int):
    """Per parameter of the bucket: (offset, numel, shape as a matrix or None for dense)."""
    out, offset = [], 0
    for p in bucket.parameters():
        n = p.numel()
        mat = None
        if p.dim() >= 2:
            m, k = p.shape[0], n // p.shape[0]
            if budget * (m + k) < m * k:  # compress only where the budget is smaller than the matrix
                mat = (m, k)
        out.append((offset, n, mat))
        offset += n
    return out


def atomo_hook(state: AtomoState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: spectral ATOMO for matrices, dense all-reduce for the rest."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    layout = _layout(bucket, state.budget)
    mats = [(off, n, mat) for off, n, mat in layout if mat is not None]
    dense_idx = torch.cat([torch.arange(off, off + n) for off, n, mat in layout if mat is None]) \
        if any(mat is None for _, _, mat in layout) else None

    # cast to fp32 for the SVD, sample this rank's atoms
    samples = []
    for off, n, (m, k) in mats:
        grad = buffer[off:off + n].view(m, k).float()
        samples.append(atomo_sample(grad, state.budget, state.generator))
    counts = torch.tensor([a.shape[0] for a, _ in samples], dtype=torch.int64)
    state.atoms_sent += int(counts.sum())

    dense_fut = None
    if dense_idx is not None:
        dense = buffer[dense_idx].float()
        dense_fut = dist.all_reduce(dense, group=group, async_op=True)

    if mats:
        all_counts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts, group=group)
        longest = torch.stack(all_counts).max(0).values.tolist()
        parts = []
        for (left, right), kmax in zip(samples, longest):
            pad = kmax - left.shape[0]
            block = torch.cat([left, right], dim=1)
            if pad:
                block = torch.cat([block, block.new_zeros(pad, block.shape[1])])
            parts.append(block.reshape(-1))
        payload = torch.cat(parts) if parts else torch.zeros(0)
        gathered = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload, group=group)
        pos = 0
        for (off, n, (m, k)), kmax in zip(mats, longest):
            size = kmax * (m + k)
            blocks = torch.cat([g[pos:pos + size].view(kmax, m + k) for g in gathered])  # rank order
            pos += size
            avg = (blocks[:, :m].t() @ blocks[:, m:]).div_(world)
            buffer[off:off + n].copy_(avg.reshape(-1).to(buffer.dtype))
    if dense_fut is not None:
        dense_fut.wait()
        buffer[dense_idx] = dense.div_(world).to(buffer.dtype)

    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut
