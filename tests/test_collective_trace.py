"""`benchmarks.collective_trace`'s comparison, on hand-written traces (the traces themselves need
torchrun: ``python -m benchmarks.collective_trace``)."""
from __future__ import annotations

import json

from benchmarks import collective_trace as ct

CALL = {"fn": "all_reduce", "ns": "torch", "group": {"size": 2, "ranks": [0, 1]}, "args": {"async_op": True},
        "tensors": [{"arg": "tensor", "dtype": "float32", "shape": [8], "bytes": 32}], "bytes": 32,
        "thread": "MainThread"}


def _write(folder, rank, records):
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{rank}.jsonl", "w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({"i": i, **r}) + "\n")


def test_identical_traces_compare_equal_and_a_changed_shape_is_found(tmp_path):
    marks = [{"mark": "step 0"}, CALL, {"mark": "step 1"}, CALL]
    for rank in (0, 1):
        _write(tmp_path / "a" / "case", rank, marks)
        _write(tmp_path / "b" / "case", rank, marks)
    assert ct.compare_case(ct.load(tmp_path / "a" / "case"), ct.load(tmp_path / "b" / "case")) is None

    other = {**CALL, "tensors": [{**CALL["tensors"][0], "shape": [4], "bytes": 16}], "bytes": 16}
    _write(tmp_path / "b" / "case", 1, marks[:3] + [other])
    diff = ct.compare_case(ct.load(tmp_path / "a" / "case"), ct.load(tmp_path / "b" / "case"))
    assert "record 3, rank 1" in diff and "'step 1'" in diff and '"bytes": 16' in diff


def test_a_missing_collective_is_a_difference(tmp_path):
    _write(tmp_path / "a", 0, [CALL, CALL])
    _write(tmp_path / "b", 0, [CALL])
    diff = ct.compare_case(ct.load(tmp_path / "a"), ct.load(tmp_path / "b"))
    assert "record 1, rank 0" in diff and "B: null" in diff


def test_every_case_names_a_known_engine():
    assert len(ct.CASES) >= 18
    assert {c["engine"] for c in ct.CASES.values()} == {"sync", "ddp", "fsdp", "hsdp", "zero"}
