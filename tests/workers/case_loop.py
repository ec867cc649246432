"""The loop the DeepSpeed workers share: run each case on every rank, gather the ranks' results,
rank 0 writes them as JSON; then the process leaves the group and exits (`models.write_and_exit`)."""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, Mapping

import torch.distributed as dist

import models  # the workers put tests/workers on sys.path


def run_cases(runners: Mapping[str, Callable[[dict], dict]], cases: Mapping[str, dict], out_path: str,
              label: str) -> None:
    """Run ``cases`` (a case's ``kind`` picks its runner; ``DAD_CASES`` selects ids), an exception
    becoming that case's ``{"exception": traceback}``; write ``{case id: [result per rank]}``."""
    only = os.environ.get("DAD_CASES")
    results: Dict[str, Any] = {}
    start = time.time()
    for case_id, case in cases.items():
        if only and case_id not in only.split(","):
            continue
        try:
            mine = runners[case["kind"]](case)
        except Exception:
            mine = {"exception": traceback.format_exc()}
            # also here: should the other ranks then hang in a collective, the gather below never returns
            print(f"[{label}] {case_id} raised on rank {dist.get_rank()}:\n{mine['exception']}", file=sys.stderr,
                  flush=True)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        results[case_id] = per_rank
        if dist.get_rank() == 0:
            print(f"[{label}] {case_id} done at {time.time() - start:.1f}s", flush=True)
    models.write_and_exit(out_path, results)
