"""Per-rank dAD state files (dad_integrations.checkpoint) and the engine-adapter registry, in one
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
from dad_integrations.checkpoint import load_rank_state, save_rank_state, state_file


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


def test_changed_world_size_is_an_error_naming_the_file(tmp_path):
    for rank in range(2):
        save_rank_state(FakeSync(0.0), str(tmp_path), rank, 2)
    with pytest.raises(ValueError, match=r"dad_state_rank0\.pt was saved by a job of 2 processes, this one has 1"):
        load_rank_state(FakeSync(0.0), str(tmp_path), 0, 1)
    with pytest.raises(FileNotFoundError, match=r"dad_state_rank2\.pt does not exist"):
        load_rank_state(FakeSync(0.0), str(tmp_path), 2, 3)


def test_checkpoint_without_dad_loads_with_a_note(tmp_path, caplog):
    sync = FakeSync(5.0)
    with caplog.at_level(logging.INFO, logger="dad_integrations.checkpoint"):
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
    from dad_integrations.engines import get_engine
    with pytest.raises(LookupError, match="no dAD adapter for engine 'nosuch'"):
        get_engine("nosuch")
