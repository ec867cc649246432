"""A torchrun elastic job that loses a node and resumes on the survivor, on the simulated cluster
(`benchmarks.sim_cluster`: two network namespaces joined by a veth pair).

One ``torchrun --nnodes 1:2 --max-restarts 1`` per node, c10d rendezvous hosted on node 0, with
short rendezvous timeouts so the restart takes seconds, not torch's default minute. The group comes
from `dad_integrations.init_process_group` (the store keyed by attempt: torchrun's shared store
outlives a dead attempt). Node 1's processes are SIGKILLed in the middle of step 7 (its ranks park
there, `workers/elastic_node_loss_worker.py`). Skipped where namespaces cannot be made (not root).

Beside it, one process posing as a restarted rank (`workers/elastic_store_worker.py`): the attach
warns about a restart on torch's unprefixed store, not on the shipped call's, and the shipped call
fails within its timeout when a peer never comes.
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

from benchmarks.sim_cluster import SimCluster, _kill_namespace_processes, probe
from conftest import ROOT, WORKERS

WORKER = WORKERS / "elastic_node_loss_worker.py"
ACCELERATE_CONFIG = ROOT / "examples" / "accelerate" / "multi_node_cpu.yaml"
LIMIT = 150  # s for the whole job (about 30 s on 2 idle cores): the test fails, never passes, past it
# rendezvous on a lost node: the dead agent's heartbeat expires after 1 s x 2, the survivor then
# waits last_call for more nodes (at the start too: long enough for both nodes to join the first
# round); join_timeout bounds a rendezvous that never completes
RDZV_CONF = "join_timeout=30,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"


def _start(cluster: SimCluster, node: int, launcher: list, log: Path) -> subprocess.Popen:
    """``launcher`` on node ``node``: in its namespace and its own session, output to ``log``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               OMP_NUM_THREADS="1", SIM_CLUSTER_NODE=str(node), GLOO_SOCKET_IFNAME=cluster.ifname(node),
               ACCELERATE_USE_CPU="1")
    return subprocess.Popen(cluster.exec_prefix(node) + [sys.executable, "-m", *launcher], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=ROOT)


def _torchrun(cluster: SimCluster, node: int, out: Path, work: Path, log: Path) -> subprocess.Popen:
    """Node ``node``'s ``torchrun --nnodes 1:2 --max-restarts 1`` of the node-loss worker."""
    return _start(cluster, node, [
        "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1",
        "--monitor-interval", "0.5", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:29400",
        "--rdzv-id", f"{cluster.name}-elastic", "--rdzv-conf", f"is_host={int(node == 0)},{RDZV_CONF}",
        "--local-addr", cluster.addr(node), str(WORKER), str(out), str(work)], log)


def _stop_all(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_elastic_restart_after_a_node_loss_resumes_on_the_survivor(tmp_path):
    """Node 1 is lost in the middle of step 7 of 12 (world 4, checkpoints every 2 steps); node 0's
    agent restarts its ranks, which resume from the step-6 checkpoint at world 2 within 45 s of the
    kill (12-23 s measured), end with identical parameters on both ranks, and carry the loss on:
    the resumed losses stay below the first step's and end within 10 % of plain DDP resumed from
    the same checkpoint at the same world size. No restart warning (the shipped call was used)."""
    ok, reason = probe()
    if not ok:
        pytest.skip(f"no simulated cluster here: {reason}")
    out, logs = tmp_path / "out.json", [tmp_path / "node0.log", tmp_path / "node1.log"]
    with SimCluster(nodes=2) as cluster:
        started = time.time()
        procs = [_torchrun(cluster, i, out, tmp_path, logs[i]) for i in range(2)]
        try:
            deadline = time.monotonic() + LIMIT
            while len(list(tmp_path.glob("parked.*"))) < 2:
                assert procs[0].poll() is None and procs[1].poll() is None, "a node ended before the loss"
                assert time.monotonic() < deadline, "node 1 never reached step 7"
                time.sleep(0.1)
            killed_at = time.time()
            _kill_namespace_processes(cluster.netns(1))  # SIGKILL: agent and ranks, as a node dies
            procs[0].wait(timeout=max(1.0, deadline - time.monotonic()))
            ended = time.time()
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 0 did not finish within {LIMIT} s:\n{logs[0].read_text()[-6000:]}")
        finally:
            _stop_all(procs)
    text = logs[0].read_text()
    assert procs[0].returncode == 0, text[-8000:]
    assert procs[1].returncode == -signal.SIGKILL
    assert "without dad_integrations.init_process_group" not in text
    before = [json.loads(line) for line in (tmp_path / "attempt0.jsonl").read_text().splitlines()]
    r = json.loads(out.read_text())
    resumed_in = r["first_resumed_step_end"] - killed_at
    print(f"node 1 lost {killed_at - started:.1f} s after the launch, the job ended {ended - killed_at:.1f} s "
          f"after the loss; world {before[0]['world']} -> {r['world']}, resumed from step {r['resumed_from']} "
          f"{resumed_in:.1f} s after the kill; loss {before[0]['loss']:.4f} -> {before[-1]['loss']:.4f} "
          f"(step {before[-1]['step']}) -> {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}; DDP from the same "
          f"checkpoint {r['ref_losses'][-1]:.4f}; ranks identical {r['ranks_identical']}")
    assert [b["world"] for b in before] == [4] * len(before), "the nodes did not start together"
    assert before[-1]["step"] == 6
    assert r["attempt"] == 1 and r["world"] == 2 and r["resumed_from"] == r["ref_from"] == 6
    assert 0 < resumed_in < 45, resumed_in  # torch's default rendezvous settings alone take ~45 s
    assert r["ranks_identical"]
    assert len(r["losses"]) == len(r["ref_losses"]) == 6
    assert max(r["losses"]) < before[0]["loss"], (before[0], r["losses"])  # carried on, not started over
    assert abs(r["losses"][-1] - r["ref_losses"][-1]) < 0.1 * r["ref_losses"][-1], r


def test_restart_warning_at_attach_and_the_timeout_honoured():
    """Restart 1 on the agent's shared store: a DDP-hook attach warns (once, rank 0) when torch's
    ``init_process_group`` made the group, not when `dad_integrations.init_process_group` did;
    and the shipped call, asked for 2 ranks with a 3 s timeout while rank 1 never comes, raises
    within 3-10 s (the store's wait), naming the attempt's key."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
               OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="r", TORCHELASTIC_RESTART_COUNT="1",
               TORCHELASTIC_USE_AGENT_STORE="True")
    proc = subprocess.run([sys.executable, str(WORKERS / "elastic_store_worker.py")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["warned"] == {"dad": False, "torch": True}
    assert proc.stderr.count("dAD: this is torchelastic restart 1") == 1
    assert "Call dad_integrations.init_process_group(backend=...)" in proc.stderr
    assert r["error"] and "attempt_1/world_2" in r["error"] and 3 <= r["timeout_s"] < 10, r


def test_accelerate_multi_node_launch_restarts_with_the_shipped_call(tmp_path):
    """Accelerate's multi-node launch (one ``accelerate launch --max_restarts 1`` per node, its
    static rendezvous, 1 process per node), the group made by `dad_integrations.init_process_group`
    before ``Accelerator()``: node 1's rank SIGKILLs itself in the middle of step 5 of 8; both agents
    restart; Accelerate keeps the group it was given, and the job resumes from the step-4
    ``save_state`` and ends bit for bit where an uninterrupted run ends, on both ranks."""
    ok, reason = probe()
    if not ok:
        pytest.skip(f"no simulated cluster here: {reason}")
    out, logs = tmp_path / "out.json", [tmp_path / "node0.log", tmp_path / "node1.log"]
    worker = WORKERS / "elastic_accelerate_worker.py"
    with SimCluster(nodes=2) as cluster:
        procs = [_start(cluster, i, [
            "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIG), "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(i), "--main_process_ip", cluster.addr(0),
            "--main_process_port", "29401", "--max_restarts", "1", "--monitor_interval", "0.5",
            str(worker), str(out), str(tmp_path)], logs[i]) for i in range(2)]
        try:
            for p in procs:
                p.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not finish within {LIMIT} s:\n{logs[0].read_text()[-4000:]}")
        finally:
            _stop_all(procs)
    texts = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [0, 0], texts[0][-4000:] + texts[1][-4000:]
    assert "exitcode: -9" in texts[1]  # node 1's rank was killed
    ranks = json.loads(out.read_text())["ranks"]
    for r in ranks:
        assert r["attempt"] == 1 and r["resumed_from"] == 4 and r["world"] == 2, r
        assert r["group_kept"] and r["params_equal"] and r["ranks_identical"], r
    print(f"accelerate: resumed from step 4 at world 2, losses {ranks[0]['losses']} "
          f"(uninterrupted {ranks[0]['straight_losses'][4:]})")
