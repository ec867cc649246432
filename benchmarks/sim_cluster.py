"""A simulated multi-node cluster on one machine: network namespaces, veth links, ``tc tbf``.

What a "node" is here
    A network namespace. Ranks inside one namespace talk over its own ``lo`` (unshaped: the fast
    intra-node link); the namespaces are joined by veth pairs (the inter-node link), optionally
    rate-limited. Everything is private: the addresses (10.201.<k>.<i+1>/24) exist only inside the
    cluster's namespaces, so nothing on the host sees them and two clusters cannot clash.

The recipe (2 nodes; /work/shared/MULTINODE.md has the shell version, measured)::

    ip netns add A; ip netns add B
    ip -n A link add sim0 type veth peer name sim1 netns B    # one cable between the two nodes
    ip -n A addr add 10.201.k.1/24 dev sim0; ip -n B addr add 10.201.k.2/24 dev sim1
    ip -n A link set lo up; ip -n A link set sim0 up          # and the same in B
    tc -n A qdisc add dev sim0 root tbf rate 1gbit burst ... latency 200ms   # and on sim1

With more than 2 nodes each node gets one veth to a bridge in an extra "switch" namespace, and
both ends of every such link are shaped (node egress, switch-port egress), so each node has a
full-duplex link of the given rate, as behind a real switch.

Why each step
    * ``tc tbf`` on BOTH ends' egress: a qdisc shapes only what leaves an interface, so each
      direction needs its own. This kernel has no ``netem``: the rate can be limited, latency
      cannot be added. The bucket follows `benchmarks.net_shaping` (1 ms at the rate, >= 10 MTU
      packets); `tbf_args` says more.
    * IPv6 off inside the namespaces, so that the veth counters count only the job's traffic (no
      router solicitations, no MLD reports).
    * A hosts file per node, ``/etc/netns/<namespace>/hosts`` (``ip netns exec`` bind-mounts it
      over /etc/hosts): the machine's hostname resolves to the node's own address there, as on a
      real node, and every node is ``node<i>``. Horovod 0.28.1 needs it: it builds its process
      sets' gloo devices (the global one included) without HOROVOD_GLOO_IFACE, from the hostname,
      which otherwise resolves to 127.0.0.1 on every node, so ranks on other nodes cannot connect.
      torch's reverse look-ups of peers also stop warning.
    * ``torchrun --nnodes N ... --rdzv_conf is_host=1`` on node 0 (0 elsewhere): the c10d
      rendezvous otherwise decides who hosts the store from the hostname's addresses, and every
      namespace shares one hostname. ``--local_addr <node address>``: its default is
      ``socket.getfqdn()``, the same for every node. ``GLOO_SOCKET_IFNAME=<node veth>``: gloo binds
      to the veth's address; ranks in one namespace still reach each other over ``lo``, since a
      local address is routed through loopback.
    * Horovod without ssh: `SimCluster.horovod` starts each rank itself, inside its node's
      namespace, with exactly the environment ``horovodrun --gloo`` gives a rank (the variables come
      from Horovod's own ``horovod.runner.gloo_run`` functions), and runs Horovod's rendezvous
      server (``python -m benchmarks.sim_cluster rendezvous``) inside node 0's namespace, bound to
      node 0's veth address, initialised with horovodrun's host allocation plan.
    * Cleanup, always: leaving the ``with`` block (normally, on an exception, on Ctrl-C) kills every
      process left inside the namespaces and deletes them and their hosts files (deleting a
      namespace removes its veth end, and so the link); an ``atexit`` hook is the backstop (it
      does not run on SIGKILL, nor on a SIGTERM the program does not handle: the CLI turns SIGTERM
      into Ctrl-C); `cleanup_stale` removes what a killed run left behind (names carry the
      creating pid, so only dead owners' are removed).

Bytes on the wire: ``/sys/class/net/<veth>/statistics/tx_bytes`` read INSIDE a node's namespace
(``ip netns exec`` remounts /sys) counts what left that node, TCP/IP headers included; the nodes'
tx deltas added together are the inter-node traffic (`SimCluster.counters`, `inter_node_bytes`).

Needs root, ``ip`` and ``tc`` (`probe` says why not). Use from Python::

    with SimCluster(nodes=2, rate="1gbit") as cluster:
        before = cluster.counters()
        cluster.torchrun("train.py", ["--steps", "10"], nproc_per_node=2)
        print(inter_node_bytes(before, cluster.counters()))

or from the shell (prints the inter-node bytes at the end)::

    python -m benchmarks.sim_cluster --nodes 2 --rate 1gbit torchrun -- train.py --steps 10
    python -m benchmarks.sim_cluster --nodes 2 --rate 100mbit horovod --local-size 2 -- train.py
    python -m benchmarks.sim_cluster --nodes 2 --rate 1gbit iperf      # measured link throughput
    python -m benchmarks.sim_cluster cleanup                           # leftovers of killed runs
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

from benchmarks.net_shaping import MTU, RATES

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
NETNS_ETC = Path("/etc/netns")  # ip-netns' per-namespace /etc overlay
DEFAULT_PREFIX = "dadsim"
SUBNET = "10.201"  # private (RFC 1918); the third octet is per cluster
Rate = Union[str, float, None]

_serials = itertools.count()
_live: Set["SimCluster"] = set()  # open clusters, for the atexit backstop
_live_lock = threading.Lock()


class SimClusterError(RuntimeError):
    """A cluster could not be built, or a job on it failed or timed out (``results`` holds every
    process's outcome, their stderr tails are in the message)."""

    def __init__(self, message: str, results: Optional[List["ProcResult"]] = None):
        super().__init__(message)
        self.results = results or []


@dataclass
class ProcResult:
    """One launched process: a node's torchrun, or one Horovod rank (``rank`` set)."""
    node: int
    returncode: Optional[int]  # None: it was still running when killed
    stdout: str
    stderr: str
    rank: Optional[int] = None


# ---------------------------------------------------------------- rates and tc


def parse_rate(rate: Union[str, float]) -> float:
    """Bits per second of ``rate``: a number (bits/s) or tc's spelling ("100mbit", "1gbit", ...)."""
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        text = rate.strip().lower()
        if text in RATES:
            bits = RATES[text]
        else:
            m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(bit|kbit|mbit|gbit|tbit)", text)
            if m is None:
                raise ValueError(f"rate {rate!r}: expected bits/s or e.g. '100mbit', '1gbit', '10gbit'")
            bits = float(m.group(1)) * {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    if bits <= 0:
        raise ValueError(f"rate {rate!r} must be positive")
    return bits


def tbf_args(dev: str, bits: float) -> List[str]:
    """``tc qdisc replace dev DEV root tbf ...`` at ``bits``/s.

    The bucket is `benchmarks.net_shaping.tbf_args`'s (one rule for both helpers; a test checks
    they agree on its RATES): 1 ms of traffic at the rate, at least 10 MTU-sized packets, so every
    burst is shaped. ``latency`` bounds the queue (packets waiting longer are dropped, as at a
    congested switch port)."""
    burst = max(int(bits / 8 * 0.001), 10 * MTU)
    return ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(bits)}bit",
            "burst", str(burst), "latency", "200ms"]


# ---------------------------------------------------------------- system helpers


def _run(cmd: Sequence[str], timeout: float = 30) -> str:
    """Run a setup command; its stdout, or `SimClusterError` with its stderr."""
    log.debug("%s", " ".join(cmd))
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SimClusterError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return proc.stdout


def list_namespaces() -> List[str]:
    """Names of the network namespaces ``ip netns`` knows (created with ``ip netns add``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process inside ``ns``: all of them were started by this module (or by the job
    it launched there), and a namespace with live processes in it outlives ``ip netns del``."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    for pid in (int(p) for p in out.split()):
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it (its veth ends, and so its links, go with it) and its
    /etc/netns overlay."""
    _kill_namespace_processes(ns)
    proc = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    if proc.returncode != 0 and ns in list_namespaces():
        log.warning("could not delete namespace %s: %s", ns, proc.stderr.strip())
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()  # only when empty: other clusters may use it
    except OSError:
        pass


def cleanup_stale(prefix: str = DEFAULT_PREFIX, include_live: bool = False) -> List[str]:
    """Delete namespaces that clusters with ``prefix`` left behind (a run killed with SIGKILL runs no
    cleanup). Names are ``<prefix>-<pid>-<serial>-...``; only those whose creating process is dead
    are removed, so running clusters of other processes are left alone (``include_live``: remove
    them too). Returns the names removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-(n\d+|sw)$")
    removed = []
    overlays = [p.name for p in NETNS_ETC.iterdir()] if NETNS_ETC.is_dir() else []
    for ns in sorted(set(list_namespaces()) | set(overlays)):
        m = pattern.match(ns)
        if m and (include_live or not _pid_alive(int(m.group(1)))):
            delete_namespace(ns)
            removed.append(ns)
    if removed:
        log.info("removed stale namespaces: %s", ", ".join(removed))
    return removed


_probe_result: Optional[Tuple[bool, str]] = None


def probe() -> Tuple[bool, str]:
    """Can this machine build a cluster? ``(True, "")``, or ``(False, reason)``: not root, ``ip`` or
    ``tc`` missing, or a trial namespace with a shaped veth pair cannot be made. Cached."""
    global _probe_result
    if _probe_result is not None:
        return _probe_result
    if os.geteuid() != 0:
        _probe_result = (False, "network namespaces need root (run as root, or in CI)")
        return _probe_result
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            _probe_result = (False, f"{tool!r} is not installed (iproute2)")
            return _probe_result
    try:
        trial = SimCluster(nodes=2, rate="1gbit", prefix=f"{DEFAULT_PREFIX}probe")
        trial._log_level = logging.DEBUG  # a trial, not news
        with trial:
            pass
        _probe_result = (True, "")
    except (SimClusterError, OSError, subprocess.SubprocessError) as e:
        _probe_result = (False, f"cannot build a namespace + veth + tc tbf here: {e}")
    return _probe_result


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


# ---------------------------------------------------------------- the cluster


class SimCluster:
    """``nodes`` network namespaces linked by veth (a bridge namespace when more than 2), the links
    shaped to ``rate`` (None: unshaped). A context manager: the namespaces exist inside the
    ``with`` block only. Jobs (`torchrun`, `horovod`) run one at a time."""

    def __init__(self, nodes: int = 2, rate: Rate = None, prefix: Optional[str] = None):
        if not 2 <= nodes <= 250:
            raise ValueError(f"nodes={nodes}: 2 to 250 nodes")
        self.nodes = nodes
        self.rate_bits: Optional[float] = None if rate is None else parse_rate(rate)
        self.prefix = prefix or DEFAULT_PREFIX
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: letters, digits and _ only")
        serial = next(_serials)
        # pid + serial: unique among live clusters of every process, and cleanup_stale can tell
        # whether the owner still runs
        self.name = f"{self.prefix}-{os.getpid()}-{serial}"
        # a third octet per cluster, so that two clusters' addresses differ too (their namespaces
        # already keep them apart; distinct subnets keep logs and captures unambiguous)
        self._octet = (os.getpid() * 7 + serial) % 254 + 1
        self._namespaces: List[str] = []  # created so far, in creation order
        self._open = False
        self._log_level = logging.INFO

    # -- names and addresses

    def netns(self, i: int) -> str:
        """Node ``i``'s namespace name."""
        self._check_node(i)
        return f"{self.name}-n{i}"

    @property
    def switch_netns(self) -> Optional[str]:
        """The bridge's namespace (more than 2 nodes), else None."""
        return f"{self.name}-sw" if self.nodes > 2 else None

    def ifname(self, i: int) -> str:
        """Node ``i``'s inter-node interface (inside its namespace)."""
        self._check_node(i)
        return f"sim{i}"

    def hostname(self, i: int) -> str:
        """Node ``i``'s name, known to every node's resolver (HOROVOD_HOSTNAME of its ranks)."""
        self._check_node(i)
        return f"node{i}"

    def addr(self, i: int) -> str:
        """Node ``i``'s IPv4 address on the inter-node link."""
        self._check_node(i)
        return f"{SUBNET}.{self._octet}.{i + 1}"

    def exec_prefix(self, i: int) -> List[str]:
        """Prefix a command with this to run it inside node ``i``."""
        return ["ip", "netns", "exec", self.netns(i)]

    def namespaces(self) -> List[str]:
        """Every namespace of this cluster that exists now."""
        return list(self._namespaces)

    def _check_node(self, i: int) -> None:
        if not 0 <= i < self.nodes:
            raise IndexError(f"node {i}: the cluster has nodes 0..{self.nodes - 1}")

    # -- life cycle

    def __enter__(self) -> "SimCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces and links (undone, and re-raised, if any step fails)."""
        if self._open:
            return
        with _live_lock:
            _live.add(self)
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        log.log(self._log_level, "cluster %s: %d nodes, %s, %s.%d.0/24", self.name, self.nodes,
                self.rate_name(), SUBNET, self._octet)

    def close(self) -> None:
        """Kill what runs in the namespaces and delete them. Idempotent."""
        for ns in reversed(self._namespaces):
            delete_namespace(ns)
        if self._namespaces:
            log.log(self._log_level, "cluster %s removed", self.name)
        self._namespaces = []
        self._open = False
        with _live_lock:
            _live.discard(self)

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)
        # IPv6 off before any interface appears, so no autoconfiguration traffic inflates counters
        _run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        for i in range(self.nodes):
            self._add_namespace(self.netns(i))
        sw = self.switch_netns
        if sw is None:
            # one cable: node 0's end created in node 0, its peer directly in node 1
            _run(["ip", "-n", self.netns(0), "link", "add", self.ifname(0), "type", "veth",
                  "peer", "name", self.ifname(1), "netns", self.netns(1)])
        else:
            self._add_namespace(sw)
            _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", sw, "link", "set", "br0", "up"])
            for i in range(self.nodes):
                _run(["ip", "-n", self.netns(i), "link", "add", self.ifname(i), "type", "veth",
                      "peer", "name", f"port{i}", "netns", sw])
                _run(["ip", "-n", sw, "link", "set", f"port{i}", "master", "br0"])
                _run(["ip", "-n", sw, "link", "set", f"port{i}", "up"])
        for i in range(self.nodes):
            ns, dev = self.netns(i), self.ifname(i)
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            self._write_hosts(i)
        self.shape(self.rate_bits)

    def _write_hosts(self, i: int) -> None:
        """Node ``i``'s /etc/hosts (see the module docstring): this machine's hostname and
        ``node<i>`` are its own address, ``node<j>`` the others'."""
        lines = ["127.0.0.1 localhost"]
        for j in range(self.nodes):
            names = f"{socket.gethostname()} {self.hostname(j)}" if j == i else self.hostname(j)
            lines.append(f"{self.addr(j)} {names}")
        for attempt in range(2):  # another cluster may remove an empty /etc/netns meanwhile
            try:
                (NETNS_ETC / self.netns(i)).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / self.netns(i) / "hosts").write_text("\n".join(lines) + "\n")
                return
            except FileNotFoundError:
                if attempt:
                    raise

    def _link_ends(self) -> List[Tuple[str, str]]:
        """(namespace, device) of every inter-node link end: each is one direction's egress."""
        ends = [(self.netns(i), self.ifname(i)) for i in range(self.nodes)]
        if self.switch_netns is not None:
            ends += [(self.switch_netns, f"port{i}") for i in range(self.nodes)]
        return ends

    def shape(self, rate: Rate) -> None:
        """Set every inter-node link to ``rate`` (None: unshaped), both directions. Can be called
        between jobs, to sweep rates on one cluster."""
        bits = None if rate is None else parse_rate(rate)
        for ns, dev in self._link_ends():
            if bits is None:
                # deleting the root qdisc restores the default; it fails harmlessly when none is set
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            else:
                cmd = tbf_args(dev, bits)
                _run(cmd[:1] + ["-n", ns] + cmd[1:])
        self.rate_bits = bits

    def rate_name(self) -> str:
        """The links' rate in words."""
        if self.rate_bits is None:
            return "unshaped"
        for name, bits in RATES.items():
            if bits == self.rate_bits:
                return name
        return f"{int(self.rate_bits)}bit"

    # -- counters

    def counters(self) -> Dict[int, Dict[str, int]]:
        """Per node, ``{"tx": bytes, "rx": bytes}`` of its inter-node interface, read inside its
        namespace (its /sys shows that namespace's interfaces)."""
        result = {}
        for i in range(self.nodes):
            stats = f"/sys/class/net/{self.ifname(i)}/statistics"
            out = _run(self.exec_prefix(i) + ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"])
            tx, rx = (int(v) for v in out.split())
            result[i] = {"tx": tx, "rx": rx}
        return result

    # -- launching

    def _env(self, node: int, env: Optional[Mapping[str, str]]) -> Dict[str, str]:
        """A job's environment on ``node``: the caller's (default: ours), the repository importable
        (as tests/conftest.py does), one thread per rank, and SIM_CLUSTER_NODE=<node index>."""
        base = dict(os.environ if env is None else env)
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
        base.setdefault("OMP_NUM_THREADS", "1")
        base["SIM_CLUSTER_NODE"] = str(node)
        return base

    def _free_port(self, i: int) -> int:
        """A port free on node ``i``'s address (asked inside its namespace: ours cannot see it)."""
        code = ("import socket; s = socket.socket(); s.bind((%r, 0)); print(s.getsockname()[1])"
                % self.addr(i))
        return int(_run(self.exec_prefix(i) + [sys.executable, "-c", code]).strip())

    def torchrun(self, script: Union[str, Path], args: Sequence[str] = (), nproc_per_node: int = 2,
                 env: Optional[Mapping[str, str]] = None, timeout: float = 600,
                 check: bool = True, capture: bool = True,
                 torchrun_args: Sequence[str] = ()) -> List[ProcResult]:
        """Run ``script`` under one ``torchrun`` per node (``--nnodes N``, c10d rendezvous hosted on
        node 0), concurrently; per node, its `ProcResult`. ``capture=False``: outputs go to ours.
        A node that fails, or the timeout, kills every node's processes; then (``check``) raises
        `SimClusterError` with the stderr tails."""
        self._require_open()
        endpoint = f"{self.addr(0)}:{self._free_port(0)}"
        rdzv_id = f"{self.name}-{next(_serials)}"
        procs = []
        for i in range(self.nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                   "--nproc_per_node", str(nproc_per_node), "--rdzv_backend", "c10d",
                   "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id,
                   "--rdzv_conf", f"is_host={int(i == 0)}", "--local_addr", self.addr(i),
                   *torchrun_args, str(script), *map(str, args)]
            node_env = self._env(i, env)
            node_env["GLOO_SOCKET_IFNAME"] = self.ifname(i)
            procs.append((i, None, cmd, node_env))
        return self._run_job(procs, timeout, check, capture, what=f"torchrun {script}")

    def accelerate(self, script: Union[str, Path], args: Sequence[str] = (), local_size: int = 2,
                   config_file: Union[str, Path] = ROOT / "examples" / "accelerate" / "multi_node_cpu.yaml",
                   env: Optional[Mapping[str, str]] = None, timeout: float = 600,
                   check: bool = True, capture: bool = True) -> List[ProcResult]:
        """Run ``script`` under one ``accelerate launch`` per node, as on a real cluster: the same
        multi-node config file everywhere, ``--machine_rank`` per node and node 0's address as
        ``--main_process_ip`` (Accelerate's static rendezvous: no host election to fool)."""
        self._require_open()
        port = self._free_port(0)
        procs = []
        for i in range(self.nodes):
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
                   "--num_machines", str(self.nodes), "--num_processes", str(self.nodes * local_size),
                   "--machine_rank", str(i), "--main_process_ip", self.addr(0), "--main_process_port", str(port),
                   str(script), *map(str, args)]
            node_env = self._env(i, env)
            node_env["GLOO_SOCKET_IFNAME"] = self.ifname(i)
            node_env.setdefault("ACCELERATE_USE_CPU", "1")
            procs.append((i, None, cmd, node_env))
        return self._run_job(procs, timeout, check, capture, what=f"accelerate launch {script}")

    def horovod(self, script: Union[str, Path], args: Sequence[str] = (), local_size: int = 2,
                env: Optional[Mapping[str, str]] = None, timeout: float = 600,
                check: bool = True, capture: bool = True) -> List[ProcResult]:
        """Run ``script`` as a Horovod (gloo) job, ``local_size`` ranks per node, without ssh: each
        rank is started in its node's namespace with the environment ``horovodrun --gloo`` gives
        it, against Horovod's rendezvous server running in node 0. Per rank, its `ProcResult`;
        failure and timeout as for `torchrun`."""
        self._require_open()
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        except ImportError as e:
            raise SimClusterError(f"Horovod's runner is not importable: {e}") from e
        hosts = ",".join(f"{self.hostname(i)}:{local_size}" for i in range(self.nodes))
        plan = get_host_assignments(parse_hosts(hosts), self.nodes * local_size)
        server, port = self._start_rendezvous(hosts)
        try:
            procs = []
            for slot in plan:
                node = int(slot.hostname[len("node"):])
                rank_env = self._env(node, env)
                # horovodrun's variables, from its own functions: rendezvous address and port,
                # controller and CPU operations gloo, the NIC (HOROVOD_GLOO_IFACE), then the slot's
                # HOROVOD_HOSTNAME, RANK, SIZE, LOCAL_RANK, LOCAL_SIZE, CROSS_RANK, CROSS_SIZE
                rank_env.update({k: str(v) for k, v in
                                 create_run_env_vars(self.addr(0), [self.ifname(node)], port).items()})
                rank_env.update(create_slot_env_vars(slot))
                rank_env["PYTHONUNBUFFERED"] = "1"  # as horovodrun sets it
                procs.append((node, slot.rank, [sys.executable, str(script), *map(str, args)], rank_env))
            return self._run_job(procs, timeout, check, capture, what=f"horovod {script}")
        finally:
            _stop(server)

    def _start_rendezvous(self, hosts: str) -> Tuple[subprocess.Popen, int]:
        """Horovod's rendezvous server in node 0's namespace, bound to node 0's veth address;
        returns it and its port (its first line of output). It exits when its stdin closes, so it
        cannot outlive us."""
        cmd = self.exec_prefix(0) + [sys.executable, "-m", "benchmarks.sim_cluster", "rendezvous",
                                     "--addr", self.addr(0), "--hosts", hosts]
        server = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True,
                                  env=self._env(0, None), cwd=ROOT)
        line = _readline_within(server, 60)
        m = re.fullmatch(r"port (\d+)\s*", line or "")
        if m is None:
            _stop(server)
            raise SimClusterError(f"the rendezvous server did not start: {line!r} "
                                  f"{_tail(server.stderr.read() if server.stderr else '')}")
        return server, int(m.group(1))

    def _run_job(self, procs: List[Tuple[int, Optional[int], List[str], Dict[str, str]]], timeout: float,
                 check: bool, capture: bool, what: str) -> List[ProcResult]:
        """Start ``(node, rank, cmd, env)`` processes concurrently, each in its node's namespace and
        its own session (so one signal reaches everything it spawned); wait; on a failure or the
        timeout kill them all."""
        with tempfile.TemporaryDirectory(prefix="simcluster") as tmp:
            started = []
            try:
                for k, (node, rank, cmd, env) in enumerate(procs):
                    out = open(Path(tmp, f"{k}.out"), "w+") if capture else None
                    err = open(Path(tmp, f"{k}.err"), "w+") if capture else None
                    log.debug("node %d: %s", node, " ".join(cmd))
                    p = subprocess.Popen(self.exec_prefix(node) + cmd, env=env, stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
                    started.append((node, rank, p, out, err))
                failed, timed_out = self._wait([p for _, _, p, _, _ in started], timeout)
            except BaseException:  # Ctrl-C while waiting: nothing may be left running
                self._kill([p for _, _, p, _, _ in started])
                raise
            finally:
                results = []
                for node, rank, p, out, err in started:
                    results.append(ProcResult(node, p.poll(), _read(out), _read(err), rank))
        if failed or timed_out:
            why = f"timed out after {timeout:.0f} s" if timed_out else "a process failed"
            detail = "\n".join(
                f"--- node {r.node}{'' if r.rank is None else f' rank {r.rank}'} (exit {r.returncode}):\n"
                f"{_tail(r.stderr)}" for r in results)
            log.warning("%s: %s", what, why)
            if check:
                raise SimClusterError(f"{what}: {why}; every process was killed\n{detail}", results)
        return results

    def _wait(self, procs: List[subprocess.Popen], timeout: float) -> Tuple[bool, bool]:
        """Wait for all; returns (a process failed, timed out), having killed all in either case."""
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = any(c not in (None, 0) for c in codes)
            if all(c is not None for c in codes) and not failed:
                return False, False
            if failed or time.monotonic() > deadline:
                self._kill(procs)
                return failed, not failed
            time.sleep(0.05)

    def _kill(self, procs: List[subprocess.Popen], grace: float = 3.0) -> None:
        """SIGTERM every process group (torchrun stops its ranks on it), SIGKILL what is left after
        ``grace``, then every process still in the nodes (torchrun puts its ranks in sessions of
        their own, which a SIGKILLed torchrun would orphan)."""
        for p in procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for i in range(self.nodes):
            _kill_namespace_processes(self.netns(i))

    def _require_open(self) -> None:
        if not self._open:
            raise SimClusterError("the cluster is not started: use `with SimCluster(...) as cluster:`")

    # -- measuring

    def throughput(self, src: int = 0, dst: int = 1, nbytes: int = 4 << 20, timeout: float = 60) -> float:
        """Bits/s of one TCP stream sending ``nbytes`` from node ``src`` to node ``dst`` (an
        iperf-like check of the shaping): timed in the sender from connect to the receiver's
        acknowledgement of the last byte."""
        self._require_open()
        server = subprocess.Popen(
            self.exec_prefix(dst) + [sys.executable, "-c", _SINK, self.addr(dst), str(nbytes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            line = _readline_within(server, timeout)
            if not line or not line.startswith("port "):
                raise SimClusterError(f"the receiver did not start: {line!r}")
            port = line.split()[1]
            out = _run(self.exec_prefix(src) + [sys.executable, "-c", _SOURCE, self.addr(dst), port,
                                                str(nbytes)], timeout=timeout)
            return float(out.strip())
        finally:
            _stop(server)


# the receiver and sender of `SimCluster.throughput` (run as `python -c` inside the namespaces)
_SINK = """
import socket, sys
addr, n = sys.argv[1], int(sys.argv[2])
s = socket.socket(); s.bind((addr, 0)); s.listen(1)
print("port", s.getsockname()[1], flush=True)
c, _ = s.accept(); got = 0
while got < n:
    chunk = c.recv(1 << 20)
    if not chunk: break
    got += len(chunk)
c.sendall(b"k"); c.close()
"""
_SOURCE = """
import socket, sys, time
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = b"x" * n
c = socket.create_connection((addr, port)); t0 = time.perf_counter()
c.sendall(data); c.recv(1); t1 = time.perf_counter()
print(n * 8 / (t1 - t0))
"""


def inter_node_bytes(before: Mapping[int, Mapping[str, int]], after: Mapping[int, Mapping[str, int]]) -> int:
    """Bytes that crossed between nodes from one `SimCluster.counters` snapshot to the next: the
    sum of the nodes' tx deltas (each byte counted once, by its sender; headers included)."""
    return sum(after[i]["tx"] - before[i]["tx"] for i in after)


def _readline_within(proc: subprocess.Popen, timeout: float) -> Optional[str]:
    """``proc``'s first stdout line, or None when it exits or ``timeout`` passes first."""
    box: List[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box and box[0] else None


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(p: subprocess.Popen) -> None:
    """Stop a helper process we started (its own session) and reap it."""
    _signal_group(p, signal.SIGKILL)
    try:
        p.communicate(timeout=10)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        pass


def _read(f) -> str:
    if f is None:
        return ""
    f.seek(0)
    text = f.read()
    f.close()
    return text


@atexit.register
def _close_all() -> None:
    """Backstop: clusters still open at interpreter exit (a missing ``with``) are removed."""
    with _live_lock:
        clusters = list(_live)
    for cluster in clusters:
        cluster.close()


# ---------------------------------------------------------------- CLI


def _serve_rendezvous(addr: str, hosts: str) -> None:
    """Horovod's rendezvous HTTP server, as horovodrun starts it (`RendezvousServer.start` +
    ``init(host_alloc_plan)``), but bound to ``addr`` so that it is reachable over the inter-node
    link. Prints ``port N``; serves until stdin closes (our parent is gone) or a signal."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    host_infos = parse_hosts(hosts)
    plan = get_host_assignments(host_infos, sum(h.slots for h in host_infos))
    httpd = RendezvousHTTPServer((addr, 0), RendezvousHandler, 0)
    httpd.init(plan)
    print("port", httpd.server_address[1], flush=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    sys.stdin.read()  # returns at EOF: the parent closed the pipe, or died
    httpd.shutdown()


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C, so that the ``with`` block cleans up (the default action would not)."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sim_cluster", description=__doc__.split("\n")[0],
        epilog="e.g. --nodes 2 --rate 1gbit torchrun --nproc-per-node 2 -- train.py --steps 10 "
               "(the module docstring explains the recipe)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--rate", default=None, help="inter-node link rate, e.g. 1gbit, 100mbit (default: unshaped)")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace name prefix")
    parser.add_argument("--timeout", type=float, default=3600, help="job timeout, seconds (default 3600)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("torchrun", help="run a script under torchrun on every node")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("horovod", help="run a script as a Horovod (gloo) job, no ssh")
    p.add_argument("--local-size", type=int, default=2)
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p = sub.add_parser("iperf", help="measure one TCP stream from node 0 to node 1")
    p.add_argument("--bytes", type=int, default=16 << 20)
    sub.add_parser("probe", help="can a cluster be built here?")
    sub.add_parser("cleanup", help="delete namespaces left by killed runs")
    p = sub.add_parser("rendezvous", help="(internal) Horovod's rendezvous server, for `horovod`")
    p.add_argument("--addr", required=True)
    p.add_argument("--hosts", required=True)
    args = parser.parse_args(argv)  # `-- script.py args`: argparse drops the "--" itself
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s sim_cluster %(levelname)s %(message)s")

    if args.command == "rendezvous":
        _serve_rendezvous(args.addr, args.hosts)
        return 0
    if args.command == "cleanup":
        print("removed:", " ".join(cleanup_stale(args.prefix)) or "nothing")
        return 0
    ok, why = probe()
    if args.command == "probe" or not ok:
        print("ok" if ok else f"cannot build a cluster here: {why}")
        return 0 if ok else 1
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        with SimCluster(nodes=args.nodes, rate=args.rate, prefix=args.prefix) as cluster:
            return _run_command(cluster, args)
    except KeyboardInterrupt:
        print("interrupted: every process killed, the cluster removed", file=sys.stderr)
        return 130


def _run_command(cluster: SimCluster, args: argparse.Namespace) -> int:
    """The CLI's job on a built cluster; prints the inter-node bytes at the end."""
    if args.command == "iperf":
        bits = cluster.throughput(0, 1, args.bytes)
        print(f"node 0 -> node 1, {cluster.rate_name()}: {bits / 1e6:.1f} Mbit/s")
        return 0
    before = cluster.counters()
    start = time.perf_counter()
    try:
        if args.command == "torchrun":
            cluster.torchrun(args.script, args.args, args.nproc_per_node, timeout=args.timeout, capture=False)
        else:
            cluster.horovod(args.script, args.args, args.local_size, timeout=args.timeout, capture=False)
    except SimClusterError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        moved = inter_node_bytes(before, cluster.counters())
        print(f"inter-node bytes: {moved} ({moved / 1e6:.2f} MB) in {time.perf_counter() - start:.2f} s, "
              f"{cluster.nodes} nodes, {cluster.rate_name()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
