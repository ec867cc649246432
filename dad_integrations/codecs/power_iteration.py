"""The power iteration: every rank-r reduction of dAD, a site's own or PowerSGD's shared one.

Subspace iteration (PowerSGD, Vogels et al., 2019) of ``M`` (m x n) from ``Q`` (n x r), per round

    P = M Q  (m x r)      P^ = orth(P)      Q = M^T P^  (n x r)      M ~= P^ Q^T

Warm-started from the last step's Q one round suffices once training settles; more rounds move the
error towards the truncated SVD's. `PowerIteration` runs it for a batch of local matrices that
share their groups (bytes per layout: `routes.rank_allreduce`):

- ``sites``: ``M = sum_s M_s`` over its ranks (PowerSGD): P and Q are all-reduced each round, and
  every rank ends with the same ``P^`` and Q. None: this rank's own matrix (rank-dAD, error
  feedback's rank-q residual, the compute model).
- ``rows``: each matrix split by rows over its ranks (HSDP's shard group). P's row blocks are
  all-gathered (the QR mixes all rows), each rank keeps its rows of ``P^``, ``M^T P^`` sums the
  blocks' products (an all-reduce over ``rows``: the site's own Q), and between sites each rank
  sums one piece of that (`piece_span`), the pieces then gathered: a site's Q crosses once.

Batched as PowerSGD's DDP hook batches a bucket: one collective per kind and round, one batched QR
per run of same-shaped P's (`orthonormalize_flat`), products written straight into flat buffers (Q's
as ``(r, n)`` blocks: column-major, as the next ``M Q`` reads fastest). Every rank runs the same
calls on the same shapes, so ranks agree bit for bit.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from dad_integrations.comm.aggregator import CommHandle, FactorAggregator, Traffic

# no QR or SVD kernel takes these: neither LAPACK on CPU ("geqrf_cpu" not implemented for
# 'BFloat16') nor cuSOLVER / MAGMA on CUDA
HALF = (torch.float16, torch.bfloat16)
Note = Callable[[torch.Tensor], torch.Tensor]
Shapes = Sequence[Tuple[int, int]]


class LocalGradient:
    """A weight's local gradient ``M`` (m x n), held densely or as factors ``left^T right``."""

    def __init__(self, *, dense: Optional[torch.Tensor] = None, left: Optional[torch.Tensor] = None,
                 right: Optional[torch.Tensor] = None):
        if (dense is None) == (left is None or right is None):
            raise ValueError("give either dense or both left and right")
        self.dense, self.left, self.right = dense, left, right

    @property
    def device(self) -> torch.device:
        return (self.dense if self.dense is not None else self.left).device

    @property
    def shape(self) -> torch.Size:
        if self.dense is not None:
            return self.dense.shape
        return torch.Size((self.left.shape[1], self.right.shape[1]))

    def mm(self, q: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``M @ q`` (m x r), into ``out`` where given; the thin ``q`` (n x r) read column-major (a
        copy of ``n r`` numbers where it is not): MKL's product runs faster so."""
        if self.dense is not None:
            return torch.mm(self.dense, _column_major(q), out=out)
        return torch.mm(self.left.t(), self.right @ q, out=out)

    def rmm_t(self, p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``(M^T p)^T = p^T M`` (r x n, row-major), into ``out`` where given: on CPU faster than
        ``M^T p`` with M read transposed."""
        if self.dense is not None:
            return torch.mm(p.t(), self.dense, out=out)
        return torch.mm((self.left @ p).t(), self.right, out=out)

    def energy(self) -> torch.Tensor:
        """``||M||_F^2``; on factors, ``sum((L L^T) * (R R^T))`` costs ``N^2 (m+n)``."""
        if self.dense is not None:
            return self.dense.pow(2).sum()
        return ((self.left @ self.left.t()) * (self.right @ self.right.t())).sum()

    def to_dense(self) -> torch.Tensor:
        return self.dense if self.dense is not None else self.left.t() @ self.right


def _column_major(q: torch.Tensor) -> torch.Tensor:
    """``q`` laid out column-major (itself where it already is)."""
    return q.t().contiguous().t()


def qr(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Thin QR ``a = Q R`` (batched over leading dims), in ``a``'s dtype, for any float dtype: every
    QR of the rank routes (SVDs: `low_rank.svd`). fp16/bf16 are factorised in fp32 and cast back (Q
    then orthonormal to the half dtype's rounding, where Gram-Schmidt in half precision, PowerSGD's
    hook's way, loses orthogonality on ill-conditioned inputs); fp32 and fp64 go to the kernel as is."""
    if a.dtype in HALF:
        q, r = torch.linalg.qr(a.float(), mode="reduced")
        return q.to(a.dtype), r.to(a.dtype)
    return torch.linalg.qr(a, mode="reduced")


def orthonormalize_flat(flat: torch.Tensor, shapes: Shapes, dtypes: Sequence[torch.dtype]) -> List[torch.Tensor]:
    """Orthonormal columns spanning each ``(m, r)`` block of ``flat`` (row-major blocks, one after
    another; `qr`: rank-deficient blocks stay finite), in ``dtypes``: consecutive blocks of one shape
    and dtype go through one batched QR (a transformer's layers repeat their shapes); on CPU the same
    bits as one QR each (`test_low_rank`)."""
    out: List[torch.Tensor] = []
    offset, i = 0, 0
    while i < len(shapes):
        j = i + 1
        while j < len(shapes) and shapes[j] == shapes[i] and dtypes[j] == dtypes[i]:
            j += 1
        m, r = shapes[i]
        block = flat[offset:offset + (j - i) * m * r].view(j - i, m, r).to(dtypes[i])
        out.extend(qr(block)[0].unbind(0))
        offset += (j - i) * m * r
        i = j
    return out


def piece_span(numel: int, pieces: int, index: int) -> Tuple[int, int]:
    """Elements ``[lo, hi)`` of piece ``index`` when ``numel`` is cut into ``pieces`` near-equal
    pieces (the last ones may be shorter or empty)."""
    size = -(-numel // pieces)
    return min(index * size, numel), min((index + 1) * size, numel)


class PowerIteration:
    """``rounds`` power iterations of a batch of matrices (module doc): `start` computes the first
    round's P (and starts its sum), `finish` runs the rest. ``wire``: the dtype of what crosses (None:
    the compute dtype); ``note`` sees every sum over ``sites``; ``traffic``: each item's share of the
    collectives over ``sites`` (those inside ``rows`` stay inside a node)."""

    def __init__(self, mats: Sequence[LocalGradient], dtypes: Sequence[torch.dtype], ranks: Sequence[int], rounds: int,
                 *, sites: Optional[FactorAggregator] = None, rows: Optional[FactorAggregator] = None,
                 wire: Optional[torch.dtype] = None, name: str = "dad.power", note: Optional[Note] = None):
        self.mats, self.dtypes, self.rounds = list(mats), list(dtypes), rounds
        self.sites, self.rows, self.wire, self.name, self.note = sites, rows, wire, name, note or (lambda t: t)
        self.p_shapes = [(g.shape[0], r) for g, r in zip(self.mats, ranks)]
        self.q_shapes = [(r, g.shape[1]) for g, r in zip(self.mats, ranks)]
        self.traffic = [Traffic() for _ in self.mats]
        self._p: Union[CommHandle, torch.Tensor, None] = None

    def start(self, qs: Sequence[torch.Tensor], ps: Optional[Sequence[Optional[torch.Tensor]]] = None) -> None:
        """The first round's P, from ``qs`` (n x r each, the same on every rank of ``sites``);
        ``ps`` holds each item's ``M Q`` where already computed (None: computed here)."""
        flat, _ = self._products(self.p_shapes, [(lambda out, g=g, q=q: g.mm(q, out=out)) if p is None
                                                 else (lambda out, p=p: p)
                                                 for g, q, p in zip(self.mats, qs, ps or [None] * len(qs))])
        self._p = flat if self.wire is None else flat.to(self.wire)
        if self.sites is not None:
            self._p = self._sum(self._p, "p", [a * b for a, b in self.p_shapes])

    def finish(self, before_last_wait: Optional[Callable[[List[torch.Tensor], List[torch.Tensor]], None]] = None
               ) -> Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]:
        """The remaining rounds; returns per item ``P^`` (this rank's rows of it), the site's own
        ``M_s^T P^`` and the summed Q (n x r each) of the last round. ``before_last_wait(bases,
        q_sites)`` runs while the last Q sum over ``sites`` is on the wire."""
        for i in range(self.rounds):
            bases = self._bases()
            q_flat, q_site = self._products(self.q_shapes, [lambda out, g=g, b=b: g.rmm_t(b, out=out)
                                                            for g, b in zip(self.mats, bases)])
            if self.rows is not None:  # the site's M^T P^ sums its row blocks' products
                q_flat = self.rows.all_reduce(q_flat, name=f"{self.name}.q_rows", op="sum").wait()
                q_site = split_blocks(q_flat, self.q_shapes, self.dtypes)
            q_site, handle = [q.t() for q in q_site], None
            if self.sites is not None:  # the sum is in place: the send buffer must not be the site's Q's
                lo, hi = (0, q_flat.numel()) if self.rows is None else \
                    piece_span(q_flat.numel(), self.rows.world_size, self.rows.rank)
                handle = self._sum(q_flat[lo:hi].to(self.wire or q_flat.dtype, copy=True), "q",
                                   [a * b for a, b in self.q_shapes])
            if i + 1 == self.rounds and before_last_wait is not None:
                before_last_wait(bases, q_site)
            q_all = q_site if handle is None else \
                [q.t() for q in split_blocks(self._gather_pieces(self.note(handle.wait()), q_flat.numel()),
                                             self.q_shapes, self.dtypes)]
            if i + 1 < self.rounds:
                self.start(q_all)
        return bases, q_site, q_all

    def _bases(self) -> List[torch.Tensor]:
        """``P^`` of the round's P: summed over ``sites``, its row blocks gathered over ``rows``,
        orthonormalised (one batched QR per run of shapes), this rank's rows."""
        flat = self.note(self._p.wait()) if self.sites is not None else self._p
        if self.rows is None:
            return orthonormalize_flat(flat, self.p_shapes, self.dtypes)
        L, s = self.rows.world_size, self.rows.rank
        blocks = torch.stack(self.rows.all_gather(flat, name=f"{self.name}.p_rows", first_dims=[flat.numel()] * L)
                             .wait())
        # block l holds rows [l c, (l+1) c) of every item's P
        whole = torch.cat([b.reshape(-1) for b in blocks.split([c * r for c, r in self.p_shapes], dim=1)])
        bases = orthonormalize_flat(whole, [(L * c, r) for c, r in self.p_shapes], self.dtypes)
        return [b[s * c:(s + 1) * c] for b, (c, _) in zip(bases, self.p_shapes)]

    def _gather_pieces(self, piece: torch.Tensor, numel: int) -> torch.Tensor:
        """Every rank of ``rows``' piece of a flat ``numel`` tensor (`piece_span`), joined (without
        ``rows``, ``piece`` is the whole)."""
        if self.rows is None:
            return piece
        spans = [piece_span(numel, self.rows.world_size, k) for k in range(self.rows.world_size)]
        return torch.cat(self.rows.all_gather(piece, name=f"{self.name}.q_pieces",
                                              first_dims=[hi - lo for lo, hi in spans]).wait())

    def _products(self, shapes: Shapes, products: Sequence[Callable]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """One flat buffer (the first item's dtype) holding every ``product(out)``, and each
        product in its item's dtype (a view of the buffer where that is the buffer's)."""
        flat = torch.empty(sum(a * b for a, b in shapes), dtype=self.dtypes[0], device=self.mats[0].device)
        views, offset = [], 0
        for (a, b), product, dtype in zip(shapes, products, self.dtypes):
            view = flat[offset:offset + a * b].view(a, b)
            result = product(view) if dtype == flat.dtype else product(None)
            if result is not view:  # computed before, or of another compute dtype than the buffer's
                view.copy_(result)
            views.append(result)
            offset += a * b
        return flat, views

    def _sum(self, flat: torch.Tensor, kind: str, sizes: Sequence[int]) -> CommHandle:
        """All-reduce ``flat`` over ``sites``, each item's share of its bytes by ``sizes``."""
        handle = self.sites.all_reduce(flat, name=f"{self.name}.{kind}", op="sum")
        total = float(sum(sizes)) or 1.0
        self.traffic = [t + handle.traffic.share(k / total) for t, k in zip(self.traffic, sizes)]
        return handle


def split_blocks(flat: torch.Tensor, shapes: Shapes, dtypes: Optional[Sequence[torch.dtype]] = None
                 ) -> List[torch.Tensor]:
    """``flat``'s consecutive row-major ``shapes`` blocks (views), each in its dtype where given."""
    blocks = [t.view(a, b) for t, (a, b) in zip(flat.split([a * b for a, b in shapes]), shapes)]
    return blocks if dtypes is None else [t.to(dtype) for t, dtype in zip(blocks, dtypes)]


def power_iteration(m: LocalGradient, q: torch.Tensor, iterations: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """One site's own ``iterations`` rounds from ``q`` (n x r): orthonormal ``p`` (m x r) and
    ``q = M^T p`` (`PowerIteration` of one matrix, no group)."""
    it = PowerIteration([m], [q.dtype], [q.shape[1]], iterations)
    it.start([q])
    bases, _, qs = it.finish()
    return bases[0], qs[0]
