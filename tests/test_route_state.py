"""The rank routes' state on one process (`dad_integrations.codecs.route_state.RouteState`): flushed
residuals owed again after a step that is not finite, HSDP's residual rows through a checkpoint,
and checkpoints in the formats written before it (a `DADSynchronizer`'s versions 2 and 1, written
here literally as that code wrote them) loading bitwise into a synchroniser of today. FSDP2's
version 1 is loaded by the FSDP2 job (`test_fsdp2.py::test_rank_routes_state_survives_a_resume`).
"""
import pytest
import torch
from torch import nn

from dad_integrations import DADSynchronizer, TorchDistributedAggregator
from dad_integrations.codecs.route_state import RouteState
from dad_integrations.config import DADConfig

F64 = torch.float64


@pytest.mark.parametrize("ef_rank", [None, 2])
def test_a_flushed_residual_is_owed_again_after_a_non_finite_step(ef_rank):
    """FSDP2 and ZeRO add the residual of a weight leaving the rank routes to that step's dense
    reduction (`RouteState.flush`); a step that is not finite sends nothing, so `end_step` puts the
    residual back, as does a step that never ended (the next `start_step`); a finite step leaves it
    sent, owed no more."""
    state = RouteState(DADConfig(mode="rank", rank=2, error_feedback_rank=ef_rank))
    residual = state.memory.pack("w", torch.randn(6, 4, dtype=F64))
    for verdict in ("not finite", "never ended", "finite"):
        state.memory.keep("w", residual)
        expected = state.memory.dense("w").clone()
        state.start_step()
        taken = []
        assert state.flush("w", taken.append) and torch.equal(taken[0], expected)
        assert state.memory.dense("w") is None and not state.flush("w", taken.append)  # flushed once
        assert state.pending
        if verdict == "not finite":
            state.end_step(finite=False)
            assert torch.equal(state.memory.dense("w"), expected)
        elif verdict == "never ended":
            state.start_step()
            assert torch.equal(state.memory.dense("w"), expected)
        else:
            state.end_step(finite=True)
            state.start_step()
            assert state.memory.dense("w") is None
        state.memory.residuals.pop("w", None)


def test_hsdp_residual_rows_through_a_checkpoint():
    """Under HSDP each rank keeps rows s of L of its node's residual: saved tagged ``shard: [s, L]``;
    a merge at another node count hands every rank its own rows (``residual_shards``); another width
    or another rank's rows raise."""
    like = {"w": nn.Parameter(torch.zeros(2, 3))}
    config = DADConfig(mode="rank", rank=1)
    saved = RouteState(config, shard=(1, 2))
    saved.memory.keep("w", torch.full((2, 3), 7.0))
    table = saved.state_dict()
    assert table["w"]["shard"] == [1, 2] and torch.equal(table["w"]["residual"], torch.full((2, 3), 7.0))
    mine = RouteState(config, shard=(1, 2))
    mine.load_state_dict({"w": {"shard": [None, 2], "residual_shards": {0: torch.ones(2, 3),
                                                                          1: torch.full((2, 3), 5.0)}}}, like)
    assert torch.equal(mine.memory.dense("w"), torch.full((2, 3), 5.0))
    with pytest.raises(ValueError, match="2 shards per node, this job has 4"):
        RouteState(config, shard=(1, 4)).load_state_dict(table, like)
    with pytest.raises(ValueError, match="not this rank's file"):
        RouteState(config, shard=(0, 2)).load_state_dict(table, like)


def _version_2(sync: DADSynchronizer) -> dict:
    """``sync``'s state as `DADSynchronizer.state_dict` wrote it before `RouteState` (version 2)."""
    ex = sync._exchanger
    return {"version": 2, "steps": sync._steps, "verified": sync._verified,
            "units": {u.name: {"warm_q": ex.state.own.q.get(u.name), "residual": ex.state.memory.state(u.name),
                               "shared_q": ex.state.shared.q.get(u.name) if ex.rank_allreduce else None,
                               "dense_only": u.dense_only, "rows_unused": u.rows_unused,
                               "last_rows": ex.policy.last_rows.get(u.index)}
                      for u in sync.units}}


def _tensors(state: dict) -> dict:
    return {(name, k, i): t for name, entry in state["rank_routes"].items() for k, v in entry.items()
            for i, t in enumerate(v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)}


def _step(model: nn.Module, sync: DADSynchronizer, seed: int) -> list:
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    model(x).pow(2).sum().backward()
    sync.synchronize()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("version", [2, 1])
@pytest.mark.parametrize("config", [{"mode": "rank", "rank": 2, "rank_route": "allgather"},
                                    {"mode": "rank", "rank": 2, "rank_route": "allreduce", "error_feedback_rank": 1}])
def test_a_synchronizer_loads_the_formats_before_route_state(group, version, config):
    """Two steps, then the state written as versions 2 and 1 wrote it: a new synchroniser that
    loads it holds today's state bit for bit and (version 2, which holds the step count too) takes
    the next step bit for bit as the saved one did."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    sync = DADSynchronizer(model, TorchDistributedAggregator(), config)
    for seed in range(2):
        _step(model, sync, seed)
    state = sync.state_dict()
    old = _version_2(sync) if version == 2 else _version_2(sync)["units"]  # version 1: the units' table alone
    assert _tensors(state)  # warm starts and residuals to carry
    expected = _step(model, sync, 2)  # the step after the save (no optimizer: the weights stay)
    sync.close()
    resumed = DADSynchronizer(model, TorchDistributedAggregator(), config)
    resumed.load_state_dict(old)
    back = resumed.state_dict()
    if version == 1:  # no step count in version 1: it restarts, and the next step is checked again
        back["steps"], back["verified"] = state["steps"], state["verified"]
    assert back.keys() == state.keys() and back["units"] == state["units"] and back["steps"] == state["steps"]
    mine, theirs = _tensors(back), _tensors(state)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    if version == 2:
        assert all(torch.equal(a, b) for a, b in zip(_step(model, resumed, 2), expected))
    resumed.close()
