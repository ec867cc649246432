"""Error-feedback memories on one process (`dad_integrations.codecs.error_feedback`): the whole residual,
and the residual kept at rank q (`error_feedback_rank`)."""
import pytest
import torch

from dad_integrations.config import DADConfig
from dad_integrations.codecs.error_feedback import (ErrorFeedback, LowRankErrorFeedback, error_feedback_for,
                                              sharded_residual_note)

F64 = torch.float64


def _low_rank(m: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g, dtype=F64) @ torch.randn(k, n, generator=g, dtype=F64)


def test_config_picks_the_memory_and_validates_the_rank():
    assert type(error_feedback_for(DADConfig(rank=2))) is ErrorFeedback
    low = error_feedback_for(DADConfig(rank=2, error_feedback_rank=3))
    assert isinstance(low, LowRankErrorFeedback) and low.matrix_rank == 3
    assert not error_feedback_for(DADConfig(rank=2, error_feedback=False, error_feedback_rank=3)).enabled
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="error_feedback_rank"):
            DADConfig(error_feedback_rank=bad)


def test_a_residual_of_rank_at_most_q_is_kept_exactly_in_q_m_plus_n_numbers():
    memory = LowRankErrorFeedback(True, 3)
    grad, sent = torch.randn(20, 15, dtype=F64), _low_rank(20, 15, 4, seed=1)
    residual = _low_rank(20, 15, 3)
    memory.keep("w", memory.pack("w", (grad + residual) - grad))  # what was not sent: exactly `residual`
    torch.testing.assert_close(memory.dense("w"), residual, rtol=1e-10, atol=1e-10)
    assert memory.numel() == 3 * (20 + 15)
    torch.testing.assert_close(memory.compensate("w", sent), sent + residual, rtol=1e-10, atol=1e-10)
    assert memory.compensate("other", sent) is sent  # nothing held: the gradient itself


def test_a_higher_rank_residual_keeps_its_strongest_directions():
    """Warm-started from the last residual's V, the kept subspace converges to the residual's top q
    (a residual that stays put, as one whose strong directions the compressor keeps missing)."""
    u, _ = torch.linalg.qr(torch.randn(30, 6, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(20, 6, dtype=F64))
    residual = u @ torch.diag(torch.tensor([10., 8., 6., 0.5, 0.4, 0.3], dtype=F64)) @ v.t()
    memory = LowRankErrorFeedback(True, 3)
    for _ in range(30):
        memory.keep("w", memory.pack("w", residual))
    best = u[:, :3] @ torch.diag(torch.tensor([10., 8., 6.], dtype=F64)) @ v[:, :3].t()
    torch.testing.assert_close(memory.dense("w"), best, rtol=1e-6, atol=1e-6)


def test_state_loads_bitwise_and_converts_between_the_two_memories():
    like = torch.nn.Parameter(torch.zeros(20, 15, dtype=F64))
    low = LowRankErrorFeedback(True, 3)
    low.keep("w", low.pack("w", _low_rank(20, 15, 3) - torch.zeros(20, 15, dtype=F64)))
    again = LowRankErrorFeedback(True, 3)
    again.load("w", low.state("w"), like)
    assert all(torch.equal(a, b) for a, b in zip(again.state("w"), low.state("w")))  # as saved
    whole = ErrorFeedback(True)
    whole.load("w", low.state("w"), like)  # a low-rank residual expanded
    torch.testing.assert_close(whole.dense("w"), low.dense("w"), rtol=1e-12, atol=1e-12)
    back = LowRankErrorFeedback(True, 3)
    back.load("w", whole.state("w"), like)  # a whole residual (here of rank 3) reduced to rank 3
    torch.testing.assert_close(back.dense("w"), whole.dense("w"), rtol=1e-10, atol=1e-10)
    back.load("w", None, like)
    assert back.state("w") is None


def test_a_disabled_memory_keeps_nothing():
    memory = LowRankErrorFeedback(False, 2)
    memory.keep("w", memory.pack("w", torch.randn(4, 3, dtype=F64) - torch.zeros(4, 3, dtype=F64)))
    assert memory.state("w") is None and memory.numel() == 0


def test_at_q_of_the_smaller_side_the_residual_is_kept_whole():
    """``q >= min(m, n)``: a pair would hold more numbers than the residual and lose round-off."""
    memory = LowRankErrorFeedback(True, 8)
    residual = torch.randn(12, 5, dtype=F64)
    memory.keep("w", memory.pack("w", residual - torch.zeros(12, 5, dtype=F64)))
    assert isinstance(memory.state("w"), torch.Tensor) and torch.equal(memory.dense("w"), residual)
    grad = torch.randn(12, 5, dtype=F64)
    assert torch.equal(memory.compensate("w", grad), grad + residual)


def test_the_sharded_note_says_what_whole_residuals_cost_and_how_to_bound_them():
    shapes = [(4096, 1024), (8, 8)]  # 16 MiB and 256 B of fp32 residuals; rank 16 keeps 16 x 5120 numbers
    note = sharded_residual_note(DADConfig(mode="rank", rank=2), shapes, 4, 4)
    assert "up to 16.0 MiB a rank (2 of 2 weights), 4.0x a rank's gradient shards of these weights (4.0 MiB)" in note, note
    assert "'error_feedback_rank': 16 would keep 0.3 MiB" in note, note
    for quiet in (DADConfig(mode="rank", rank=2, error_feedback_rank=4), DADConfig(mode="rank", rank=2,
                  error_feedback=False), DADConfig(mode="exact")):
        assert sharded_residual_note(quiet, shapes, 4, 4) is None
