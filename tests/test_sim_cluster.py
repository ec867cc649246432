"""benchmarks/sim_cluster.py: several nodes on one machine (network namespaces + veth + tc tbf).

Real jobs on a real simulated cluster: torchrun 2x2 and Horovod 2x2 (no ssh) with their topology
and collectives checked, bytes counted on the inter-node link, the rate shaping measured, and the
cleanup checked after success, failure, timeout, Ctrl-C and a missing ``with``. Skipped (with the
reason) where namespaces cannot be made (not root, no iproute2); CI runs as root and runs them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT, WORKERS

from benchmarks import net_shaping, sim_cluster
from benchmarks.sim_cluster import SimCluster, SimClusterError, inter_node_bytes, parse_rate, tbf_args

WORKER = WORKERS / "sim_cluster_worker.py"
PREFIX = "dadsimtest"
NUMEL = 1 << 20  # a 4 MiB fp32 tensor


@pytest.fixture
def cluster_ok() -> None:
    """Skip, saying why, where this machine cannot build a cluster."""
    ok, why = sim_cluster.probe()
    if not ok:
        pytest.skip(why)


def leftovers(cluster: SimCluster) -> List[str]:
    """What of ``cluster`` is still on the machine: its namespaces, its /etc/netns overlays."""
    names = [ns for ns in sim_cluster.list_namespaces() if ns.startswith(cluster.name + "-")]
    if sim_cluster.NETNS_ETC.is_dir():
        names += [str(p) for p in sim_cluster.NETNS_ETC.iterdir() if p.name.startswith(cluster.name + "-")]
    return names


def ok_lines(text: str) -> List[dict]:
    """The ``ok {json}`` records the worker's ranks printed."""
    return [json.loads(line[3:]) for line in text.splitlines() if line.startswith("ok ")]


def pid_gone(pid: int) -> bool:
    """No such process, or only its zombie (the container's init may reap late)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_rates_and_bucket_follow_net_shaping():
    """The one-node helper and the cluster shape alike: same bucket and queue for its RATES."""
    for name, bits in net_shaping.RATES.items():
        assert parse_rate(name) == bits
        theirs, ours = net_shaping.tbf_args(name), tbf_args("lo", bits)
        for key in ("burst", "latency"):
            assert ours[ours.index(key) + 1] == theirs[theirs.index(key) + 1], (name, key)
    assert parse_rate("2.5gbit") == 2.5e9 and parse_rate(3e8) == 3e8 and parse_rate("500kbit") == 5e5
    for bad in ("fast", "-1gbit", 0):
        with pytest.raises(ValueError):
            parse_rate(bad)


def test_torchrun_two_nodes_two_ranks(cluster_ok):
    """2 nodes x 2 ranks: torchrun's topology variables, a checked gloo all-reduce, and its bytes
    on the veth (a ring over 4 ranks, 2 hops crossing: about 3x the tensor)."""
    with SimCluster(nodes=2, prefix=PREFIX) as cluster:
        before = cluster.counters()
        results = cluster.torchrun(WORKER, ["torch", NUMEL], nproc_per_node=2, timeout=240)
        crossed = inter_node_bytes(before, cluster.counters())
    assert not leftovers(cluster)
    assert [r.node for r in results] == [0, 1] and all(r.returncode == 0 for r in results)
    ranks = sorted((rec for r in results for rec in ok_lines(r.stdout)), key=lambda rec: rec["rank"])
    assert [rec["rank"] for rec in ranks] == [0, 1, 2, 3], results
    for r in results:
        for rec in ok_lines(r.stdout):
            assert rec["node"] == r.node
            assert (rec["world"], rec["local_world"], rec["group_world"]) == (4, 2, 2)
            # ranks are laid out node by node, node 0 (the rendezvous host) first
            assert rec["group_rank"] == rec["rank"] // 2 == r.node
            assert rec["layout"] == [[0, 0, 0], [0, 0, 1], [1, 1, 0], [1, 1, 1]]
    tensor = 4 * NUMEL
    assert tensor < crossed < 5 * tensor, crossed


def test_horovod_two_nodes_two_ranks(cluster_ok):
    """Horovod 2x2 started without ssh: size/local/cross topology, an allreduce, and process sets
    per node (reduce-scatter, all-gather) and across nodes (allreduce) that compose to the flat
    all-reduce."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Horovod is not importable: {e}")
    with SimCluster(nodes=2, rate="10gbit", prefix=PREFIX) as cluster:
        before = cluster.counters()
        results = cluster.horovod(WORKER, ["horovod", NUMEL], local_size=2, timeout=240)
        crossed = inter_node_bytes(before, cluster.counters())
    assert not leftovers(cluster)
    assert [(r.node, r.rank) for r in results] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    for r in results:
        (rec,) = ok_lines(r.stdout)
        assert (rec["rank"], rec["size"], rec["local_size"], rec["cross_size"]) == (r.rank, 4, 2, 2)
        assert rec["cross_rank"] == rec["node"] == r.node and rec["local_rank"] == r.rank % 2
        assert rec["local_set"] == [2 * r.node, 2 * r.node + 1]
        assert rec["cross_set"] == [r.rank % 2, r.rank % 2 + 2]
    assert crossed > 4 * NUMEL, crossed


def test_cleanup_after_exit_interrupt_and_stale(cluster_ok):
    """Nothing is left: after the block, after Ctrl-C inside it, after a process that never left
    its cluster (the atexit hook), and `cleanup_stale` removes a dead owner's namespaces only."""
    with SimCluster(nodes=3, prefix=PREFIX) as cluster:
        assert len(leftovers(cluster)) == 3 + 1 + 3  # nodes, switch, hosts files
    assert not leftovers(cluster)

    with pytest.raises(KeyboardInterrupt):
        with SimCluster(nodes=2, prefix=PREFIX) as cluster:
            assert leftovers(cluster)
            raise KeyboardInterrupt
    assert not leftovers(cluster)

    code = ("from benchmarks.sim_cluster import SimCluster\n"
            f"c = SimCluster(2, rate='1gbit', prefix={PREFIX!r}); c.start(); print(c.name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    name = proc.stdout.split()[-1]
    assert not [ns for ns in sim_cluster.list_namespaces() if ns.startswith(name + "-")]

    dead = f"{PREFIX}-99999999-0-n0"  # no pid is that large: its owner is dead
    live = f"{PREFIX}-{os.getpid()}-999-n0"
    try:
        for ns in (dead, live):
            subprocess.run(["ip", "netns", "add", ns], check=True)
        removed = sim_cluster.cleanup_stale(PREFIX)
        assert dead in removed and live not in removed, removed
        assert live in sim_cluster.list_namespaces() and dead not in sim_cluster.list_namespaces()
    finally:
        for ns in (dead, live):
            sim_cluster.delete_namespace(ns)


def test_failed_job_kills_every_node(cluster_ok):
    """One rank exits 1 while the others hang: the error comes at once, carries the stderr, and the
    hanging node is killed; nothing is left after the block."""
    start = time.monotonic()
    with SimCluster(nodes=2, prefix=PREFIX) as cluster:
        with pytest.raises(SimClusterError) as info:
            cluster.torchrun(WORKER, ["fail"], nproc_per_node=2, timeout=120)
        assert cluster.counters()[1]["tx"] > 0  # the cluster still works after a failed job
    elapsed = time.monotonic() - start
    assert not leftovers(cluster)
    assert "a process failed" in str(info.value) and "failing on purpose" in str(info.value)
    codes = {r.node: r.returncode for r in info.value.results}
    assert codes[1] not in (None, 0) and codes[0] != 0, codes
    assert elapsed < 60, elapsed


def test_timed_out_job_is_killed(cluster_ok, tmp_path):
    """Every rank sleeps: at the timeout every node's torchrun and every rank (torchrun puts its
    ranks in sessions of their own) are killed, and the error says so. The ranks start ~5 s in on
    an idle 2-core machine: a timeout of 8 s, doubled (once, twice) where the ranks had not all
    started by then on a loaded one, so that the check waits only as long as it must."""
    with SimCluster(nodes=2, prefix=PREFIX) as cluster:
        for timeout in (8, 16, 32):
            pid_dir = tmp_path / f"timeout{timeout}"
            pid_dir.mkdir()
            start = time.monotonic()
            with pytest.raises(SimClusterError, match=f"timed out after {timeout} s"):
                cluster.torchrun(WORKER, ["sleep", pid_dir], nproc_per_node=2, timeout=timeout)
            elapsed = time.monotonic() - start
            pids = [int(p.name) for p in pid_dir.iterdir()]
            assert all(pid_gone(pid) for pid in pids), pids  # killed by the job, not by the cleanup
            assert elapsed < timeout + 20, elapsed
            if len(pids) == 4:
                break
    assert not leftovers(cluster)
    assert len(pids) == 4, "the ranks had not started: the test checked less than it should"


def test_rate_shaping_takes_effect(cluster_ok):
    """One TCP stream of 4 MiB between the nodes: at most the rate when shaped (and near it), and
    far faster unshaped; the veth counters see the bytes. The best of 2 runs, against load."""
    nbytes = 4 << 20
    with SimCluster(nodes=2, prefix=PREFIX) as cluster:
        measured = {}
        for rate in ("100mbit", "1gbit", None):
            cluster.shape(rate)
            before = cluster.counters()
            measured[rate] = max(cluster.throughput(0, 1, nbytes) for _ in range(2))
            assert inter_node_bytes(before, cluster.counters()) > 2 * nbytes
    assert not leftovers(cluster)
    print({k: f"{v / 1e6:.0f} Mbit/s" for k, v in measured.items()})
    assert 0.4e8 < measured["100mbit"] < 1.1e8, measured
    assert 0.3e9 < measured["1gbit"] < 1.1e9, measured
    assert measured[None] > 3 * measured["100mbit"], measured


def test_three_nodes_through_a_switch(cluster_ok):
    """More than 2 nodes: every node reaches every other through the bridge, each link shaped both
    ways, and a node's counters see only its own traffic."""
    with SimCluster(nodes=3, rate="100mbit", prefix=PREFIX) as cluster:
        assert cluster.switch_netns in sim_cluster.list_namespaces()
        before = cluster.counters()
        forth = cluster.throughput(0, 2, 1 << 20)
        back = cluster.throughput(2, 1, 1 << 20)
        after = cluster.counters()
    assert not leftovers(cluster)
    assert forth < 1.1e8 and back < 1.1e8, (forth, back)
    sent = {i: after[i]["tx"] - before[i]["tx"] for i in after}
    assert sent[0] > 1 << 20 and sent[2] > 1 << 20 and sent[1] < 1 << 19, sent


def test_cli_iperf(cluster_ok):
    """The command line builds a cluster, measures it and removes it."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sim_cluster", "--rate", "100mbit", "--prefix", PREFIX,
                           "iperf", "--bytes", str(2 << 20)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "node 0 -> node 1, 100mbit:" in proc.stdout, proc.stdout
    mbit = float(proc.stdout.split(":")[-1].split()[0])
    assert 40 < mbit < 110, proc.stdout
