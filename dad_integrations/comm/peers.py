"""Which rank and node sit at an address: the peer directory, and a probe of the other nodes.

gloo names a failed peer by its address only. Each process publishes once, in the job's store
(``dad/peer/<global rank>``), its node and its IPv4 addresses; the job's `PeerDirectory` reads the
entries in the background after a first collective completed (at hand when the store is gone with
a node) and maps an address to its ranks and node. After a timeout, which names no peer,
`PeerDirectory.probe` reports the other nodes that do not answer a TCP connection within a second.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Dict, List, Optional, Sequence, Tuple

from dad_integrations.comm.errors import PeerInfo

__all__ = ["PeerDirectory", "local_addresses", "node_label", "publish"]

KEY = "dad/peer/{}"
PROBE_S = 1.0  # a node that has not answered a connection in this long counts as unreachable
MAX_PROBED = 64  # nodes probed after a timeout (in parallel)

_published: Dict[int, bool] = {}  # id(store) -> published
_directories: Dict[int, "PeerDirectory"] = {}  # id(store) -> the job's directory
_lock = threading.Lock()


def node_label() -> str:
    """This process' node: ``"node <index>"`` from the launcher (torchrun's GROUP_RANK, DeepSpeed's
    CROSS_RANK, Horovod's), else ``"host <hostname>"``."""
    from dad_integrations.comm.topology import launcher_hint
    hint = launcher_hint()
    return f"node {hint[0]}" if hint is not None else f"host {socket.gethostname()}"


def _interface_address(name: str) -> Optional[str]:
    """The IPv4 address of interface ``name`` (Linux), or None."""
    try:
        import fcntl
        import struct
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError):
        return None


def local_addresses() -> Tuple[Optional[str], List[str]]:
    """``(gloo's address, every IPv4 address of this host)``: gloo's is GLOO_SOCKET_IFNAME's first
    interface's address where it is set, else what the hostname resolves to (as gloo picks it)."""
    found = set()
    try:
        for _, name in socket.if_nameindex():
            addr = _interface_address(name)
            if addr:
                found.add(addr)
    except OSError:
        pass
    gloo = None
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if iface:
        gloo = _interface_address(iface)
    try:
        resolved = [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        resolved = []
    found.update(resolved)
    if gloo is None and resolved:
        gloo = resolved[0]
    return gloo, sorted(found)


def publish(store, rank: int) -> None:
    """Write this process' entry (node, addresses) to ``store`` under global ``rank``, once per
    store. Never raises: the directory only improves error messages."""
    with _lock:
        if _published.get(id(store)):
            return
        _published[id(store)] = True
    try:
        gloo, addrs = local_addresses()
        store.set(KEY.format(rank), json.dumps({"node": node_label(), "gloo": gloo, "addrs": addrs}))
    except Exception:  # noqa: BLE001 - a store that cannot take it: messages say "unknown"
        pass


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "localhost")


class PeerDirectory:
    """The entries of the job's ranks (global ``ranks``), for this process (global rank ``me``)."""

    def __init__(self, store, ranks: Sequence[int], me: int):
        self._store = store
        self._ranks = [int(r) for r in ranks]
        self.me = int(me)
        self.label = node_label()
        self._entries: Dict[int, dict] = {}
        self._started = False
        self._done = threading.Event()
        self._start_lock = threading.Lock()
        self._reread = False

    @classmethod
    def for_job(cls, store, me: int, world: int) -> "PeerDirectory":
        """The job's directory over its ``store`` (one per process and store), for global rank
        ``me`` of ``world``, this process' entry published in it."""
        publish(store, me)
        with _lock:
            found = _directories.get(id(store))
            if found is None or found._store is not store:
                found = _directories[id(store)] = cls(store, range(world), me)
        return found

    def prefetch(self) -> None:
        """Read the entries in a daemon thread (once); call after a collective of the group
        completed, so that every member has published."""
        if self._started:  # the common case, after each collective: no lock
            return
        with self._start_lock:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._read, name="dad-peers", daemon=True).start()

    def _read(self) -> None:
        try:
            present = [r for r in self._ranks
                       if r != self.me and r not in self._entries and self._store.check([KEY.format(r)])]
            values = self._store.multi_get([KEY.format(r) for r in present]) if present else []
            for r, value in zip(present, values):
                self._entries[r] = json.loads(bytes(value).decode())
        except Exception:  # noqa: BLE001 - messages then say "unknown"
            pass
        finally:
            self._done.set()

    def entries(self, wait_s: float = 1.0) -> Dict[int, dict]:
        """The entries read so far, waiting up to ``wait_s`` for the read (started here if not yet:
        a failure before any collective completed; read again once where ranks were missing)."""
        self.prefetch()
        self._done.wait(wait_s)
        if self._done.is_set() and len(self._entries) < len(self._ranks) - 1 and not self._reread:
            self._reread, self._done = True, threading.Event()
            threading.Thread(target=self._read, name="dad-peers", daemon=True).start()
            self._done.wait(wait_s)
        return dict(self._entries)

    def lookup(self, addr: Optional[str], wait_s: float = 1.0) -> PeerInfo:
        """The ranks at ``addr`` and their node; loopback or one of this host's addresses means this
        node. Empty where unknown."""
        if not addr:
            return PeerInfo()
        entries = self.entries(wait_s)
        _, mine = local_addresses()
        if _is_loopback(addr) or addr in mine:
            ranks = tuple(sorted(r for r, e in entries.items() if e.get("node") == self.label))
            return PeerInfo(ranks=ranks, node=f"{self.label}, this node") if ranks else PeerInfo(node=self.label)
        ranks = tuple(sorted(r for r, e in entries.items() if addr == e.get("gloo") or addr in e.get("addrs", ())))
        nodes = sorted({entries[r].get("node", "?") for r in ranks})
        return PeerInfo(ranks=ranks, node=" or ".join(nodes) if nodes else None)

    def probe(self, wait_s: float = 1.0) -> PeerInfo:
        """After a timeout: the other nodes (by their gloo address) that do not take or refuse a
        TCP connection within `PROBE_S`; ``probed`` False where nothing could be probed."""
        entries = self.entries(wait_s)
        nodes: Dict[str, Tuple[str, List[int]]] = {}
        for r, e in sorted(entries.items()):
            label = e.get("node")
            addr = e.get("gloo") or next((a for a in e.get("addrs", ()) if not _is_loopback(a)), None)
            if label is None or label == self.label or addr is None or _is_loopback(addr):
                continue
            nodes.setdefault(label, (addr, []))[1].append(r)
        if not nodes:  # every rank on this node, or no entries at all
            return PeerInfo(alone=bool(entries))
        targets = list(nodes.items())[:MAX_PROBED]
        port = 9  # discard: nothing listens there as a rule, and a refusal is an answer
        pool = ThreadPoolExecutor(len(targets), thread_name_prefix="dad-probe")
        futures = {label: pool.submit(_answers, addr, port) for label, (addr, _) in targets}
        wait(list(futures.values()), timeout=PROBE_S + 0.5)
        pool.shutdown(wait=False)
        silent = tuple((label, tuple(nodes[label][1])) for label, f in futures.items()
                       if not (f.done() and f.result()))
        return PeerInfo(silent=silent, probed=True)


def _answers(addr: str, port: int) -> bool:
    """Whether ``addr`` takes or refuses a TCP connection on ``port`` within `PROBE_S`."""
    try:
        socket.create_connection((addr, port), timeout=PROBE_S).close()
        return True
    except ConnectionRefusedError:  # the host is up and reachable, the port closed
        return True
    except OSError:  # timeout, no route, network unreachable
        return False
