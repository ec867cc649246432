"""torchrun worker: the link probe on a real gloo group (tests/test_link_probe.py).

Cases, each on an aggregator that records the probe's calls (name, elements) before sending them:
- ``ladder``: `probe_link` up to 1 MiB: every size of the ladder, both ranks alike.
- ``budget``: a budget of 0 s: each kind stops after its first size, on both ranks.
- ``uneven``: rank 0 asks for 1 MiB, rank 1 for 64 KiB: both probe the agreed 1 MiB.
- ``job``: `build_timing` for a weight of 1024 x 768 (3 MiB in fp32) and 2 MiB buckets: probed up to
  the weight's 3 MiB, and a refresh (`probe_top` kept on the timing) probes the same sizes.
Every case reports the calls made and the agreed model (``to_list``).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from models import gather_per_rank, run_all, write_and_exit  # noqa: E402

from dad_integrations import DADConfig, TorchDistributedAggregator  # noqa: E402
from dad_integrations.routing.link import probe_link  # noqa: E402
from dad_integrations.routing.timing import build_timing  # noqa: E402

KINDS = ("all_reduce", "all_gather")


class Recording(TorchDistributedAggregator):
    """The gloo aggregator, noting each collective's name and elements before running it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def all_reduce(self, tensor, *, name, op="sum"):
        self.calls.append(["all_reduce", name, tensor.numel()])
        return super().all_reduce(tensor, name=name, op=op)

    def all_gather(self, tensor, *, name, first_dims=None):
        self.calls.append(["all_gather", name, tensor.numel()])
        return super().all_gather(tensor, name=name, first_dims=first_dims)

    def all_to_all(self, tensor, *, name):
        self.calls.append(["all_to_all", name, tensor.numel()])
        return super().all_to_all(tensor, name=name)


def run(case: dict) -> dict:
    agg = Recording()
    cpu = torch.device("cpu")
    if case["id"] == "job":
        cfg = DADConfig(mode="auto", rank=4, objective="time", bucket_cap_mb=2)
        timing = build_timing(cfg, [(1024, 768)], agg, cpu, link_kinds=KINDS)
        first = list(agg.calls)
        agg.calls.clear()
        probe_link(agg, cpu, kinds=KINDS, top_bytes=timing.probe_top)  # what a refresh does
        return {"calls": first, "refresh": agg.calls, "top": timing.probe_top, "model": timing.link.to_list()}
    top = case["top"][dist.get_rank()]
    link = probe_link(agg, cpu, kinds=KINDS, top_bytes=top, budget_s=case.get("budget", 1.0))
    return {"calls": agg.calls, "model": link.to_list()}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cases = {"ladder": {"id": "ladder", "top": [1 << 20] * 2},
             "budget": {"id": "budget", "top": [1 << 20] * 2, "budget": 0.0},
             "uneven": {"id": "uneven", "top": [1 << 20, 64 << 10]},
             "job": {"id": "job"}}
    write_and_exit(sys.argv[1], run_all(cases, run, gather_per_rank))


if __name__ == "__main__":
    main()
