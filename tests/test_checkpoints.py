"""Per-rank dAD state files (dad_integrations.engines.checkpoint) and the engine-adapter registry, in one
process. The engines' save/resume runs are in test_accelerate.py, test_deepspeed.py, test_horovod.py.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dad_integrations.engines.checkpoint import load_rank_state, save_rank_state, state_file
from dad_integrations.logs import SAY_LOGGER


class FakeSync:
    """Anything with the synchroniser's state API."""

    def __init__(self, value: float):
        self.state = {"h.weight": {"warm_q": torch.full((3, 2), value), "residual": None, "dense_only": False}}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_each_rank_reads_its_own_file(tmp_path):
    for rank in range(2):
        path = save_rank_state(FakeSync(float(rank)), str(tmp_path), rank, 2, global_step=7)
        assert path == state_file(str(tmp_path), rank) == str(tmp_path / f"dad_state_rank{rank}.pt")
    for rank in range(2):
        sync = FakeSync(-1.0)
        payload = load_rank_state(sync, str(tmp_path), rank, 2)
        assert payload["global_step"] == 7
        assert torch.equal(sync.state["h.weight"]["warm_q"], torch.full((3, 2), float(rank)))
    assert not list(tmp_path.glob("*.tmp"))


def _v2_state(rank: int, residual, steps: int = 9) -> dict:
    """A DADSynchronizer-shaped state of one rank: one rank-routed weight, one that went dense."""
    g = torch.Generator().manual_seed(rank)
    return {"version": 2, "steps": steps, "verified": True,
            "units": {"h.weight": {"warm_q": torch.randn(5, 2, generator=g), "residual": residual,
                                   "shared_q": torch.full((5, 2), 3.0), "dense_only": False,
                                   "rows_unused": True, "last_rows": [[4], [5], [6], [7]]},
                      "d.weight": {"warm_q": None, "residual": None, "shared_q": None, "dense_only": True,
                                   "rows_unused": False, "last_rows": [[1], [1], [1], [1]]}}}


class StateSync(FakeSync):
    def __init__(self, state: dict):
        self.state = state


def test_resumes_at_another_world_size_with_the_mean_residual(tmp_path, caplog):
    """4 ranks save, 2 and 8 ranks load: every new rank holds the old ranks' mean residual (the
    average's debt kept: sum over new / S' = sum over old / S), the shared warm start of old rank
    0, and restarts what belongs to the old size; rank 0 says so in one log line."""
    residuals = [torch.randn(3, 5, generator=torch.Generator().manual_seed(10 + r)) for r in range(4)]
    for rank in range(4):
        save_rank_state(StateSync(_v2_state(rank, residuals[rank])), str(tmp_path), rank, 4, global_step=7)
    old_mean = torch.stack(residuals).double().sum(0) / 4
    said = logging.getLogger(SAY_LOGGER)  # shown at default levels, by its own handler
    said.addHandler(caplog.handler)
    try:
        loaded_by_world = {}
        for new_world in (2, 8):
            loaded_by_world[new_world] = [None] * new_world
            for rank in range(new_world):
                sync = StateSync({})
                payload = load_rank_state(sync, str(tmp_path), rank, new_world)
                assert payload["global_step"] == 7 and payload["resized_from"] == 4 and payload["rank"] == rank
                loaded_by_world[new_world][rank] = sync.state
    finally:
        said.removeHandler(caplog.handler)
    for new_world, loaded in loaded_by_world.items():
        new_mean = torch.stack([s["units"]["h.weight"]["residual"] for s in loaded]).double().sum(0) / new_world
        assert float((new_mean - old_mean).norm() / old_mean.norm()) < 1e-6
        for s in loaded:
            assert torch.equal(s["units"]["h.weight"]["residual"], loaded[0]["units"]["h.weight"]["residual"])
            assert s["steps"] == 9 and s["verified"] is False and s["version"] == 2
            h, d = s["units"]["h.weight"], s["units"]["d.weight"]
            assert torch.equal(h["shared_q"], torch.full((5, 2), 3.0))
            assert h["warm_q"] is None and h["last_rows"] is None and h["rows_unused"] is False
            assert d["dense_only"] is False and d["residual"] is None and d["last_rows"] is None
    assert caplog.text.count("resuming on 2 processes from dAD state saved by 4") == 1
    assert "residuals of 1 weight(s) averaged over the 4 old ranks" in caplog.text


def test_low_rank_residuals_merge_to_the_means_best_rank_q():
    """Rank-q residuals (U, V): the merge keeps rank q, as the config asked, and is the best
    rank-q part of the old mean (Eckart-Young: the SVD's), equal to the mean when that has rank q."""
    from dad_integrations.engines.checkpoint import merge_rank_states
    g = torch.Generator().manual_seed(0)
    m, n, q = 12, 9, 2
    pairs = [(torch.linalg.qr(torch.randn(m, q, generator=g))[0], torch.randn(n, q, generator=g)) for _ in range(3)]
    merged, summary = merge_rank_states(_v2_state(r, pairs[r]) for r in range(3))
    u, v = merged["units"]["h.weight"]["residual"]
    assert u.shape == (m, q) and v.shape == (n, q) and "kept at their rank q" in summary
    assert torch.allclose(u.t() @ u, torch.eye(q), atol=1e-5)
    mean = sum(a.double() @ b.double().t() for a, b in pairs) / 3
    uu, ss, vh = torch.linalg.svd(mean)
    best = (uu[:, :q] * ss[:q]) @ vh[:q]
    assert float((u.double() @ v.double().t() - best).norm() / best.norm()) < 1e-5
    shared = pairs[0][0], pairs[0][1]  # every old rank's residual in one rank-q subspace
    same = [(shared[0], shared[1] * (r + 1)) for r in range(3)]
    merged, _ = merge_rank_states(_v2_state(r, same[r]) for r in range(3))
    u, v = merged["units"]["h.weight"]["residual"]
    exact = shared[0].double() @ (shared[1].double() * 2).t()
    assert float((u.double() @ v.double().t() - exact).norm() / exact.norm()) < 1e-6


def test_sharded_states_and_version_1_merge_too():
    """FSDP2's and ZeRO-2/3's states (``rank_routes``) and version 1 (the units' table alone)."""
    from dad_integrations.engines.checkpoint import merge_rank_states
    routes = [{"version": 1, "steps": 4, "rank_routes": {"w": {"warm_q": torch.ones(2, 1), "shared_q": None,
                                                                "residual": torch.full((3, 2), float(r))}}}
              for r in range(2)]
    merged, _ = merge_rank_states(routes)
    assert merged["steps"] == 4 and merged["rank_routes"]["w"]["warm_q"] is None
    assert torch.equal(merged["rank_routes"]["w"]["residual"], torch.full((3, 2), 0.5))
    merged, _ = merge_rank_states([{"w": {"warm_q": None, "residual": torch.ones(2, 2), "dense_only": True}},
                                   {"w": {"warm_q": None, "residual": None, "dense_only": True}}])
    assert torch.equal(merged["w"]["residual"], torch.full((2, 2), 0.5)) and merged["w"]["dense_only"] is False


def test_resized_resume_refuses_incomplete_or_mixed_checkpoints(tmp_path):
    """A missing old rank's file, a file of another job, unknown keys: errors naming the cause."""
    from dad_integrations.engines.checkpoint import merge_rank_states
    for rank in range(3):
        save_rank_state(StateSync(_v2_state(rank, torch.ones(3, 5))), str(tmp_path), rank, 3)
    os.remove(state_file(str(tmp_path), 1))
    with pytest.raises(FileNotFoundError, match=r"dad_state_rank1\.pt does not exist"):
        load_rank_state(StateSync({}), str(tmp_path), 0, 2)
    save_rank_state(StateSync(_v2_state(1, torch.ones(3, 5))), str(tmp_path), 1, 2)
    with pytest.raises(ValueError, match=r"dad_state_rank1\.pt was saved by a job of 2 processes, but rank 0's"):
        load_rank_state(StateSync({}), str(tmp_path), 0, 4)
    with pytest.raises(FileNotFoundError, match=r"dad_state_rank3\.pt does not exist, though the checkpoint was "
                                                r"saved by a job of 4"):
        for rank in range(4):
            save_rank_state(StateSync(_v2_state(rank, None)), str(tmp_path / "b"), rank, 4)
        os.remove(state_file(str(tmp_path / "b"), 3))
        load_rank_state(StateSync({}), str(tmp_path / "b"), 3, 4)
    with pytest.raises(ValueError, match=r"keys \['new_thing'\] that cannot be carried"):
        merge_rank_states([{"units": {"w": {"new_thing": 1}}}])
    with pytest.raises(ValueError, match="disagree"):
        merge_rank_states([_v2_state(0, None, steps=3), _v2_state(1, None, steps=4)])


def test_checkpoint_without_dad_loads_with_a_note(tmp_path, caplog):
    sync = FakeSync(5.0)
    with caplog.at_level(logging.INFO, logger="dad_integrations.engines.checkpoint"):
        assert load_rank_state(sync, str(tmp_path), 0, 2) is None
    assert "holds no dAD state" in caplog.text
    assert torch.equal(sync.state["h.weight"]["warm_q"], torch.full((3, 2), 5.0))


def test_second_model_has_its_own_files(tmp_path):
    save_rank_state(FakeSync(1.0), str(tmp_path), 0, 1, index=1)
    assert (tmp_path / "dad_state_1_rank0.pt").exists()
    assert load_rank_state(FakeSync(0.0), str(tmp_path), 0, 1) is None  # model 0's: none saved


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_core_imports_no_engine_adapter():
    """The core's Accelerate and Transformers glue import without any adapter package."""
    out = _python("import sys; sys.modules['deepspeed_dad'] = sys.modules['horovod_dad'] = None\n"
                  "import dad_integrations, dad_integrations.accelerate, dad_integrations.transformers\n"
                  "print('ok')")
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_deepspeed_adapter_found_through_entry_point():
    """Without importing deepspeed_dad, the core finds its adapter through the entry point group
    (the package is installed editable: pip install -e .); nothing imports deepspeed for it."""
    out = _python("import sys\n"
                  "from dad_integrations.engines import get_engine\n"
                  "adapter = get_engine('deepspeed')\n"
                  "assert 'deepspeed_dad' in sys.modules and 'deepspeed' not in sys.modules, sorted(sys.modules)\n"
                  "assert adapter.is_engine(object()) is False\n"
                  "print(adapter.name)")
    assert out.stdout.strip() == "deepspeed", out.stderr[-3000:]


def test_unknown_engine_says_what_to_install():
    from dad_integrations.engines.registry import get_engine
    with pytest.raises(LookupError, match="no dAD adapter for engine 'nosuch'"):
        get_engine("nosuch")
