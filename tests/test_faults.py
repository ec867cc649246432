"""Faults across nodes, on the simulated cluster (`benchmarks.sim_cluster`): 2 nodes x 2 ranks,
each job trains a tiny model with exact dAD (`workers/fault_worker.py`) until a fault injected here
stops it, and every surviving rank must raise `CollectiveError` within the process group's timeout,
its message naming the collective, the step, the peer's node and ranks and the timeout, the
engine's error chained:

- a node lost mid-run (node 1's ranks killed with SIGKILL), under DDP's communication hook: gloo
  names the peer's address, mapped to node 1 and its ranks;
- a link cut (node 1's end of the veth taken down), under the synchroniser: gloo times out naming
  no peer, and each side names the other node as not answering.

The ranks are started here, in their nodes' namespaces, with the variables torchrun gives them
(``SimCluster.torchrun`` would end the whole job as soon as node 1's processes die). A rank that
does not raise writes ``"hung"`` after the timeout + 60 s (and the test fails), never a pass by
timing out. One cluster serves both cases; the link is restored after the cut.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.sim_cluster import ROOT, SimCluster, probe
from conftest import WORKERS

WORKER = WORKERS / "fault_worker.py"
TIMEOUT_S = 10.0   # the process group's timeout
MARGIN_S = 6.0     # above the timeout: the probe of the other nodes (1 s) and a loaded machine
START_S = 120.0    # longest wait for every rank to have trained 3 steps (2 shared cores)
NODES, LOCAL = 2, 2


@pytest.fixture(scope="module")
def cluster():
    ok, reason = probe()
    if not ok:
        pytest.skip(f"no simulated cluster here: {reason}")
    with SimCluster(nodes=NODES) as c:
        yield c


def _free_port(cluster: SimCluster) -> int:
    code = "import socket; s = socket.socket(); s.bind((%r, 0)); print(s.getsockname()[1])" % cluster.addr(0)
    return int(subprocess.check_output(cluster.exec_prefix(0) + [sys.executable, "-c", code], text=True))


def _start(cluster: SimCluster, out: Path, engine: str) -> list:
    """Every rank of a 2 x 2 job, each in its node with torchrun's variables; returns the processes."""
    port = _free_port(cluster)
    procs = []
    for rank in range(NODES * LOCAL):
        node = rank // LOCAL
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(NODES * LOCAL), LOCAL_RANK=str(rank % LOCAL),
                   LOCAL_WORLD_SIZE=str(LOCAL), GROUP_RANK=str(node), MASTER_ADDR=cluster.addr(0),
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=cluster.ifname(node), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        log = open(out / f"log.{rank}", "w")
        procs.append(subprocess.Popen(cluster.exec_prefix(node) + [sys.executable, str(WORKER), str(out), engine,
                                                                   str(TIMEOUT_S)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _wait_files(paths: list, limit_s: float, procs: list, out: Path) -> None:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {f.name}:\n{f.read_text()[-3000:]}" for f in sorted(out.glob("log.*")))
            pytest.fail(f"missing after {limit_s:.0f} s: {[p.name for p in paths if not p.exists()]}\n{logs}")
        time.sleep(0.05)


def _stop(procs: list) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        p.wait()


def _run(cluster: SimCluster, out: Path, engine: str, inject, survivors: list) -> dict:
    """Start the job, inject the fault once every rank has trained 3 steps, and return each
    survivor's result and the seconds from the fault to its error."""
    procs = _start(cluster, out, engine)
    try:
        _wait_files([out / f"ready.{r}" for r in range(NODES * LOCAL)], START_S, procs, out)
        fault_at = time.time()
        inject(procs)
        _wait_files([out / f"result.{r}.json" for r in survivors], TIMEOUT_S + 90, procs, out)
    finally:
        _stop(procs)
    results = {r: json.loads((out / f"result.{r}.json").read_text()) for r in survivors}
    for r, res in results.items():
        res["elapsed_s"] = res["raised_at"] - fault_at if res.get("raised") else None
        print(f"rank {r}: {res.get('type')} after {res['elapsed_s']} s:\n{res.get('message')}")
    return results


def _check(res: dict, rank: int, peer: str) -> None:
    assert not res["hung"], f"rank {rank} did not raise within {TIMEOUT_S + 60:.0f} s of the fault"
    assert res["raised"] and res["collective_error"], (rank, res.get("type"), res.get("message"))
    message = res["message"]
    assert f"at step {res['steps']} on rank {rank} (node {rank // LOCAL})" in message, message
    assert "all_gather of" in message or "all_reduce of" in message, message
    assert "(dad." in message, message  # the collective's dAD name
    assert peer in message, message
    assert f"process group timeout: {TIMEOUT_S:g} s" in message, message
    assert "Check:" in message, message
    assert res["cause"] and "RuntimeError" in res["cause"], res["cause"]  # gloo's error, chained


def test_node_lost_mid_run(cluster, tmp_path):
    """Node 1's ranks are killed (SIGKILL) mid-run: node 0's ranks raise at once (the connections are
    reset), naming node 1 and its ranks, under DDP's communication hook."""
    def kill_node_1(procs):
        for p in procs[LOCAL:]:
            os.killpg(p.pid, signal.SIGKILL)

    results = _run(cluster, tmp_path, "ddp", kill_node_1, survivors=list(range(LOCAL)))
    for rank, res in results.items():
        _check(res, rank, peer="(node 1)")
        assert "ranks 2, 3" in res["message"] and "node 1 is gone" in res["message"], res["message"]
        assert res["elapsed_s"] < TIMEOUT_S, res["elapsed_s"]


def test_link_cut_mid_run(cluster, tmp_path):
    """The link between the nodes goes down mid-run (node 1's veth end): every rank times out after
    the process group's timeout, each naming the other node as not answering, under the
    synchroniser (the exchange on dAD's worker thread, re-raised in the training thread)."""
    dev, ns = cluster.ifname(1), cluster.netns(1)

    def cut(procs):
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True)

    try:
        results = _run(cluster, tmp_path, "sync", cut, survivors=list(range(NODES * LOCAL)))
    finally:
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
    for rank, res in results.items():
        other = 1 - rank // LOCAL
        ranks = ", ".join(str(r) for r in range(other * LOCAL, (other + 1) * LOCAL))
        _check(res, rank, peer=f"not answering from here: node {other} (ranks {ranks})")
        assert "timed out" in res["message"], res["message"]
        assert res["elapsed_s"] < TIMEOUT_S + MARGIN_S, res["elapsed_s"]
