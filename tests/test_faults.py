"""Faults across nodes, on the simulated cluster (`benchmarks.sim_cluster`), injected from here
while the job runs (as torchft's EventInjector injects them, at steps the ranks report).

Faults that stop the job: 2 nodes x 2 ranks, each job trains a tiny model with exact dAD
(`workers/fault_worker.py`) until the fault stops it, and every surviving rank must raise
`CollectiveError` within the process group's timeout, its message naming the collective, the step,
the peer's node and ranks and the timeout, the engine's error chained:

- a node lost mid-run (node 1's ranks killed with SIGKILL), under DDP's communication hook: gloo
  names the peer's address, mapped to node 1 and its ranks;
- a link cut (node 1's end of the veth taken down), under the synchroniser: gloo times out naming
  no peer, and each side names the other node as not answering.

Faults the route choice must read right: 2 nodes x 1 rank, mode auto on the measured link
(`workers/route_fault_worker.py`), the routes and decisions read from the public `StepReport` and
`route_trials`:

- a link slowed mid-run (unshaped to 20 Mbit/s with ``tc``), from all dense chosen by the models
  (no trial): the watch sees the dense steps slow at its first check after the change, the next
  step measures the link again and routes anew, a route trial follows, and the weights move from
  all dense to a rank route within a stated number of steps;
- a slow rank (one rank stopped with SIGSTOP for 1-3 s, three times): no error, and no route trial
  (the watch does not read one slow rank as a slow link).

The ranks are started here, in their nodes' namespaces, with the variables torchrun gives them
(``SimCluster.torchrun`` would end the whole job as soon as node 1's processes die). A rank that
does not raise (or finish) writes ``"hung"`` after a bound and the test fails, never a pass by
timing out. One cluster serves every case; the link is restored after each.
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


def _start(cluster: SimCluster, out: Path, args: list, worker: Path = WORKER, local: int = LOCAL) -> list:
    """Every rank of a ``NODES x local`` job, each in its node with torchrun's variables; returns the
    processes (rank order)."""
    port = _free_port(cluster)
    procs = []
    for rank in range(NODES * local):
        node = rank // local
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(NODES * local), LOCAL_RANK=str(rank % local),
                   LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(node), MASTER_ADDR=cluster.addr(0),
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=cluster.ifname(node), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        log = open(out / f"log.{rank}", "w")
        procs.append(subprocess.Popen(cluster.exec_prefix(node) + [sys.executable, str(worker), str(out),
                                                                   *map(str, args)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _logs(out: Path) -> str:
    return "\n".join(f"--- {f.name}:\n{f.read_text()[-3000:]}" for f in sorted(out.glob("log.*")))


def _wait_files(paths: list, limit_s: float, procs: list, out: Path) -> None:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            pytest.fail(f"missing after {limit_s:.0f} s: {[p.name for p in paths if not p.exists()]}\n{_logs(out)}")
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
    procs = _start(cluster, out, [engine, TIMEOUT_S])
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
    # where the fault finds the rank: between nodes, or inside its node waiting for a peer held there
    assert any(f"{op} of" in message for op in ("all_gather", "all_reduce", "all_to_all_v")), message
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


# ---------------------------------------------------------------- faults the route choice must read right
#
# 2 nodes x 1 rank, `workers/route_fault_worker.py`: DDP + dAD's hook, mode auto on the measured link
# (unshaped veth: fast), route trials of TRIAL_STEPS steps. At step 0 the models choose every weight
# dense (the fast link), so no trial runs, and from step 1 the dense steps are watched against their
# own first interval: every TRIAL_STEPS steps (the baseline at 4, then checks at 8, 12, 16, ...) the
# ranks agree on their lower quartile.
# The faults come from here, at steps the ranks report, as torchft's EventInjector injects them
# (`_inject`); the ranks report their routes and the last decision from the public `StepReport`.

ROUTE_WORKER = WORKERS / "route_fault_worker.py"
TRIAL_STEPS = 4              # the worker's route_trial_steps: also the watch's interval
ROUTE_LIMIT_S = 120.0        # a rank gives up (writes "hung") this long after its start; ~10 s idle
NEW_TRIAL = "a new route trial"  # the watch's line, where its refresh begins a trial (`RouteTrial.begin`)


def _inject(out: Path, procs: list, events: list, limit_s: float = ROUTE_LIMIT_S + 15) -> dict:
    """Run the job to its end, firing ``events`` on the way: ``(step, rank, action)``, ``action()``
    once ``rank`` has finished ``step`` (each rank rewrites ``progress.<rank>`` after every step).
    Returns each rank's result and its steps (``steps.<rank>.jsonl``); a rank that exits without a
    result, or a job past ``limit_s``, fails the test (never a pass by timing out)."""
    ranks = range(len(procs))
    pending = sorted(events, key=lambda e: e[0])
    deadline = time.monotonic() + limit_s
    try:
        while not all((out / f"result.{r}.json").exists() for r in ranks):
            if time.monotonic() > deadline:
                pytest.fail(f"the job did not end within {limit_s:.0f} s\n{_logs(out)}")
            gone = [r for r in ranks if procs[r].poll() is not None and not (out / f"result.{r}.json").exists()]
            if gone:
                pytest.fail(f"rank(s) {gone} exited without a result\n{_logs(out)}")
            while pending:
                step, rank, action = pending[0]
                try:
                    done = json.loads((out / f"progress.{rank}").read_text())["step"]
                except (OSError, ValueError):
                    break
                if done < step:
                    break
                action()
                pending.pop(0)
            time.sleep(0.01)
    finally:
        _stop(procs)
    assert not pending, f"events never fired: {pending}"
    results = {}
    for r in ranks:
        res = json.loads((out / f"result.{r}.json").read_text())
        res["steps"] = [json.loads(line) for line in (out / f"steps.{r}.jsonl").read_text().splitlines()]
        assert not res["hung"], f"rank {r} did not finish within {ROUTE_LIMIT_S:.0f} s"
        assert res["error"] is None, f"rank {r} raised: {res['error']}"
        results[r] = res
    routes = [[s["routes"] for s in res["steps"]] for res in results.values()]
    assert all(r == routes[0] for r in routes), "the ranks' routes differ"  # agreed, step by step
    return results


def _watch_lines(steps: list) -> list:
    """The steps whose report's last decision is the watch's (a refresh it asked for began a trial)."""
    return [s["step"] for s in steps if NEW_TRIAL in s["decision"]]


# One job serves both cases (a launch costs more than the steps): rank 1 paused three times on the
# fast link, then, once the pauses' watch intervals are checked, the link slowed. Each pause in its own
# watch interval (checks at 8, 12, ..., 24): a mean over the interval would exceed the trial's figure.
PAUSES = [(8, 1.5), (14, 3.0), (20, 1.0)]  # (after rank 1's step, seconds stopped)
PARK = 24  # a watch check's step: the next interval is all on the slow link


@pytest.fixture(scope="module")
def route_job(cluster, tmp_path_factory):
    """The job's results: per rank, its route trials and each step's routes and last decision."""
    from dad_integrations.routing.trial import MAX_ROUNDS
    out = tmp_path_factory.mktemp("route_faults")
    within = TRIAL_STEPS + 3 + MAX_ROUNDS * TRIAL_STEPS  # see the link test
    steps = PARK + within + 2
    procs = _start(cluster, out, [steps, PARK, ROUTE_LIMIT_S], worker=ROUTE_WORKER, local=1)

    def pause(seconds):
        def action():
            os.killpg(procs[1].pid, signal.SIGSTOP)
            try:
                time.sleep(seconds)
            finally:
                os.killpg(procs[1].pid, signal.SIGCONT)
        return action

    def slow_the_link():
        _wait_files([out / f"parked.{r}" for r in range(NODES)], 30, procs, out)
        cluster.shape("20mbit")
        (out / "go").write_text("")

    try:
        results = _inject(out, procs, [(step, 1, pause(sec)) for step, sec in PAUSES] + [(PARK, 0, slow_the_link)])
    finally:
        cluster.shape(None)
    for r, res in results.items():
        assert [s["step"] for s in res["steps"]] == list(range(steps)), r
    res = results[0]
    print("\n".join(str((s["step"], s["routes"], round(s["seconds"] * 1e3, 1), s["link"])) for s in res["steps"]))
    print("".join(line for line in (out / "log.0").read_text().splitlines(True) if "steps" in line))
    # the premise of both cases: the models chose all dense on the unshaped link, and no trial ran
    assert res["steps"][0]["routes"] == ["dense"] and "route trial" not in res["steps"][1]["decision"], (
        f"premise: on the unshaped link the models should choose all dense: {res['steps'][:2]}")
    return out, results, within


def test_slow_rank_is_not_a_slow_link(route_job):
    """Rank 1 is stopped (SIGSTOP) for 1.5 s, 3 s and 1 s after its steps 8, 14 and 20, then
    continued (SIGCONT), on the fast link: no rank raises, every step of both ranks ends, rank 0
    waited out each pause in a step, and up to the link's change (step PARK = 24, whose interval is
    checked) the watch starts no route trial (a pause stretches one step per rank in a watch
    interval; the lower quartile reads the link, not the pause): no trial at all, and every weight
    stays dense."""
    _, results, _ = route_job  # no error, no hang: `_inject` asserted it
    for r, res in results.items():
        assert not _watch_lines(res["steps"][:PARK + 1]), f"rank {r}: the watch read a paused rank as a slow link"
        assert [t for t in res["trials"] if t["step"] <= PARK] == [], res["trials"]
    steps = results[0]["steps"]
    assert all(s["routes"] == ["dense"] for s in steps[:PARK + 1]), steps
    waited = sorted(s["seconds"] for s in steps[:PARK + 1])[-len(PAUSES):]
    print(f"rank 0's longest steps {[round(w, 2) for w in waited]} s; pauses {[p for _, p in PAUSES]} s")
    assert all(w > 0.8 for w in waited), waited  # each pause held rank 0 up mid-run


def test_link_slowed_mid_run_watch_moves_routes(route_job):
    """The link between the nodes drops from unshaped (several Gbit/s) to 20 Mbit/s between steps
    PARK (24) and 25 (the ranks park there while `tc` reshapes both ends of the veth), with every
    weight dense by the models' choice (no trial before): the watch sees the dense steps above their
    baseline at its first check whose interval holds three slow steps of four (its lower quartile),
    at most TRIAL_STEPS + 2 steps after the change (checks are TRIAL_STEPS apart; a miss on load
    before the change shifts them by the refresh it asked for); the next step measures the link
    again and routes anew (rank routes), a route trial follows (cause "watch"), the rank routes win
    it, and every weight is sent by a rank route from at most TRIAL_STEPS + 3 + MAX_ROUNDS *
    TRIAL_STEPS = 19 steps after the change (9 to 11 when the first round decides) to the end. No
    refresh falls in the run."""
    out, results, within = route_job
    res = results[0]
    trace = [(s["step"], s["routes"]) for s in res["steps"]]
    assert not _watch_lines(res["steps"][:PARK + 1]), "the watch started a trial before the link changed"
    watched = _watch_lines(res["steps"])  # the refresh the watch asked for, whose trial begins
    assert watched and PARK + 1 < watched[0] <= PARK + TRIAL_STEPS + 3, (watched, trace)
    assert res["steps"][watched[0]]["routes"] != ["dense"], trace  # routes chosen anew for the slow link
    (trial,) = res["trials"]
    assert trial["cause"] == "watch" and trial["step"] == watched[0] and trial["kept"], res["trials"]
    assert trial["routes_s"] < trial["dense_s"], trial
    # the first step from which every weight stays on a rank route to the end
    held = next((s["step"] for s in res["steps"]
                 if all("dense" not in t["routes"] for t in res["steps"][s["step"]:])), None)
    assert held is not None, f"the routes did not stay compressed to the end: {trace}"
    print(f"link slowed after step {PARK}: new routes and a trial at step {watched[0]}, rank routes held from step "
          f"{held} ({held - PARK} steps after the change; bound {within})")
    assert held - PARK <= within, (held, trace)
    assert "(watch): routes kept" in res["steps"][-1]["decision"], res["steps"][-1]["decision"]
    assert (out / "log.0").read_text().count(NEW_TRIAL) == 1  # said once, on rank 0's stderr
    assert NEW_TRIAL not in (out / "log.1").read_text()
