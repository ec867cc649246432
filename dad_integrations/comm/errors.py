"""`CollectiveError`: a dAD collective that failed or timed out, said in words a user can act on.

An engine's own error names none of what a user needs when a node dies (gloo: ``Read error
[10.0.0.2]:41234: Connection reset by peer``). `collective_error` says the collective, the step,
the peer mapped to its rank and node (`comm.peers`), the timeout and what to check
(``docs/guides/faults.md``). It chains the engine's exception and keeps its type as a base too,
so that ``except HorovodInternalError`` or ``except DistBackendError`` still catch it.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Optional, Tuple, Type

__all__ = ["CollectiveError", "PeerInfo", "collective_error", "describe_collective", "note_step",
           "parse_engine_error"]


class CollectiveError(RuntimeError):
    """A dAD collective failed or timed out. ``collective`` (e.g. ``"all_gather"``), ``name`` (the
    collective's dAD name), ``step`` (0-based, None if unknown), ``peer`` (a description of the
    peer, or None), ``timeout`` (the process group's, or None) and ``timed_out`` say what the
    message says; the engine's exception is the ``__cause__``."""

    def __init__(self, message: str, *, collective: str = "", name: str = "", step: Optional[int] = None,
                 peer: Optional[str] = None, timeout: Optional[timedelta] = None, timed_out: bool = False):
        super().__init__(message)
        self.collective, self.name, self.step = collective, name, step
        self.peer, self.timeout, self.timed_out = peer, timeout, timed_out


# -- the step -------------------------------------------------------------------------------------
# The dAD step last begun in this process, 0-based (set by the drivers): one per process, since a
# process runs one training loop and sub-aggregators would each need it handed on.
_step: Optional[int] = None


def note_step(step: int) -> None:
    """Record that dAD's step ``step`` (0-based) has begun in this process (for error messages)."""
    global _step
    _step = int(step)


def current_step() -> Optional[int]:
    """The step last recorded by `note_step`, or None before the first."""
    return _step


# -- what the collective was ----------------------------------------------------------------------
# dAD's collective names (``dad.<kind>.<weight>``), longest prefix first matched, in words
KINDS: Dict[str, str] = {
    "dad.exact": "exact factors", "dad.rank": "rank-compressed factors", "dad.meta": "factor row counts",
    "dad.dense.native": "dense gradient buckets (DDP's own step)", "dad.dense.flags": "dense-bucket flags",
    "dad.dense": "dense gradients",
    "dad.twolevel": "a route's payload between nodes", "dad.twolevel.exact": "exact factors between nodes",
    "dad.twolevel.rank": "rank-compressed factors between nodes",
    "dad.twolevel.dense": "dense gradients between nodes", "dad.twolevel.counts": "factor row counts between nodes",
    "dad.twolevel.to_owner": "gradients to their owners inside the node",
    "dad.twolevel.from_owner": "results from their owners inside the node",
    "dad.replicate": "the replicate hop's factors", "dad.zero": "ZeRO partitions",
    "dad.sharded": "sharded factors", "dad.partition": "partitioned exact factors",
    "dad.topology": "the topology table (attach)", "dad.signature": "the model check (attach)",
    "dad.broadcast": "the initial parameters (attach)", "dad.verify": "the first-step check",
    "dad.link": "link measurements", "dad.trial": "the route trial's agreement",
    "dad.compute": "compute measurements", "dad.join": "DDP join's count of ranks training",
    "dad.leave": "copy-rate measurements (attach)", "dad.ahead": "the forward's row counts",
    "dad.powersgd": "PowerSGD's all-reduced P and Q", "dad.sharded.powersgd": "PowerSGD's P and Q of row shards",
    "dad.sharded.rank.finite": "the step's finiteness flag", "dad.zero.finite": "the step's finiteness flag",
    "dad.fsdp.finite": "the step's finiteness flag", "dad.fsdp.row_counts": "factor row counts",
    "dad.fsdp.verify": "the first-step check", "dad.zero.verify": "the first-step check",
}


def describe_collective(collective: str, name: str) -> str:
    """``"all_gather of exact factors (dad.exact.0.weight)"``: the operation, what it carries
    (from `KINDS`, by the longest matching prefix of ``name``) and the name itself."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        what = KINDS.get(".".join(parts[:n]))
        if what is not None:
            return f"{collective} of {what} ({name})"
    return f"{collective} ({name})" if name else collective


# -- what the engine said -------------------------------------------------------------------------
_PEER = re.compile(r"\[(?P<addr>[0-9A-Fa-f:.]+)\]:(?P<port>\d+)")
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_GONE = re.compile(r"connection reset|connection closed|broken pipe|connection refused|end of file|eof",
                   re.IGNORECASE)


@dataclass(frozen=True)
class EngineFault:
    """What an engine's error message says: the peer's address and port where it names one, and
    whether it is a timeout or a connection lost."""

    addr: Optional[str]
    port: Optional[int]
    timed_out: bool
    connection_lost: bool
    summary: str  # the message's first line, without gloo's source path and its generic advice
    shut_down: bool = False  # Horovod's "has been shut down": another rank failed or left


def parse_engine_error(message: str) -> EngineFault:
    """Read gloo's (or NCCL's, Horovod's) error text: ``[pair.cc:537] Read error [10.0.0.2]:41234:
    Connection reset by peer`` gives the peer 10.0.0.2:41234, a connection lost;
    ``Timed out waiting 30000ms for recv operation`` a timeout, no peer."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)  # gloo's "[.../pair.cc:537] "
    line = line.split(". This is typically caused")[0]  # gloo's generic advice: ours follows
    m = _PEER.search(message)
    return EngineFault(addr=m.group("addr") if m else None, port=int(m.group("port")) if m else None,
                       timed_out=bool(_TIMEOUT.search(message)), connection_lost=bool(_GONE.search(message)),
                       summary=line[:400], shut_down="has been shut down" in message)


# -- the peer ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerInfo:
    """What dAD found of the peer: the ranks at the engine's peer address and their node's label
    (``"node 1"``), or, after a timeout that names no peer, the nodes that did not answer a probe."""

    ranks: Tuple[int, ...] = ()
    node: Optional[str] = None
    silent: Tuple[Tuple[str, Tuple[int, ...]], ...] = ()  # (node label, its ranks) that did not answer
    probed: bool = False  # the other nodes were probed (after a timeout)
    alone: bool = False  # the directory has no other node: every rank is on this one

    def describe(self, fault: EngineFault) -> str:
        """The peer in words, e.g. ``"rank 2 (node 1), at 10.0.0.2:41234"``."""
        at = f"{fault.addr}:{fault.port}" if fault.addr else None
        if self.ranks:
            who = _ranks(self.ranks) if len(self.ranks) == 1 else f"one of {_ranks(self.ranks)}"
            return f"{who} ({self.node or 'node unknown'}){f', at {at}' if at else ''}"
        if at:
            return f"{at} (rank and node unknown)"
        if self.silent:
            nodes = "; ".join(f"{label} ({_ranks(ranks)})" for label, ranks in self.silent)
            return f"unknown (the engine names none); not answering from here: {nodes}"
        if self.alone:
            return "unknown (the engine names none); every rank is on this node"
        if self.probed:
            return "unknown (the engine names none); every other node answered a probe"
        return "unknown (the engine names none)"


def _ranks(ranks: Tuple[int, ...]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _seconds(timeout: Optional[timedelta]) -> str:
    if timeout is None:
        return "unknown"
    s = timeout.total_seconds()
    return f"{s:g} s" if s < 120 else f"{s:g} s ({s / 60:g} min)"


def _advice(fault: EngineFault, peer: PeerInfo, timeout: Optional[timedelta]) -> str:
    node = peer.node or (peer.silent[0][0] if len(peer.silent) == 1 else None)
    if fault.connection_lost:
        where = node or "the peer's node"
        return (f"Likely {where} is gone: its process died (killed, out of memory, crashed) or the node went "
                f"down or rebooted. Check: that node's logs and exit codes (dmesg for the OOM killer), the "
                f"first error any rank raised, the link between the nodes.")
    if fault.timed_out:
        if peer.silent:
            cause = f"{node or 'those nodes'} cannot be reached from here: a node lost or a cut link"
        elif peer.probed or peer.alone:
            cause = "the network answers: a rank stalled (a hang, a slow checkpoint, a debugger, an uneven loop)"
        else:
            cause = "a node lost, a cut link or a rank stalled"
        return (f"Likely {cause}. Check: that every rank is alive and in the same step, the link between "
                f"the nodes (ping, cables, switch), GLOO_SOCKET_IFNAME (the interface every rank's gloo "
                f"binds to, one all ranks can reach), and whether the timeout"
                f"{'' if timeout is None else ' of ' + _seconds(timeout)} is too short for a slow step "
                f"(init_process_group(timeout=...)).")
    if fault.shut_down:
        return ("Likely another rank failed or left (its process died, or it raised) and the engine shut "
                "down. Check: the first error any rank raised, and the exit codes and logs of every rank "
                "(dmesg for the OOM killer).")
    return ("Check: the first error any rank raised, that every rank is alive and in the same step, "
            "the link between the nodes and GLOO_SOCKET_IFNAME.")


def collective_error(exc: BaseException, *, collective: str, name: str, rank: Optional[int] = None,
                     node: Optional[str] = None, timeout: Optional[timedelta] = None,
                     peer: Optional[PeerInfo] = None, step: Optional[int] = None) -> CollectiveError:
    """The `CollectiveError` for the engine's ``exc`` in collective ``collective`` named ``name``,
    on global rank ``rank`` of node ``node``, with the process group's ``timeout`` and what was
    found of the ``peer``; ``step`` defaults to `current_step`. Raise it ``from exc``. Its class
    also derives from ``type(exc)`` where that is a subclass of RuntimeError (see the module doc)."""
    fault = parse_engine_error(str(exc))
    peer = peer or PeerInfo()
    step = current_step() if step is None else step
    here = "" if rank is None else f" on rank {rank}{f' ({node})' if node else ''}"
    what = "timed out" if fault.timed_out and not fault.connection_lost else "failed"
    lines = [f"dAD's {describe_collective(collective, name)} {what} at step "
             f"{'unknown' if step is None else step}{here}.",
             f"  peer: {peer.describe(fault)}",
             f"  process group timeout: {_seconds(timeout)}",
             f"  {_advice(fault, peer, timeout)}",
             f"  {type(exc).__name__} from the engine: {fault.summary or str(exc)[:400]}"]
    cls = _error_class(type(exc))
    return cls("\n".join(lines), collective=collective, name=name, step=step, peer=peer.describe(fault),
               timeout=timeout, timed_out=fault.timed_out and not fault.connection_lost)


_classes: Dict[type, Type[CollectiveError]] = {}
_classes_lock = threading.Lock()


def _error_class(engine: type) -> Type[CollectiveError]:
    """`CollectiveError`, also a subclass of the engine's exception type where that is a proper
    RuntimeError subclass (``DistBackendError``, ``HorovodInternalError``), so callers' ``except``
    clauses for it still match."""
    if engine is RuntimeError or not issubclass(engine, RuntimeError) or issubclass(engine, CollectiveError):
        return CollectiveError
    with _classes_lock:
        if engine not in _classes:
            try:
                _classes[engine] = type("CollectiveError", (CollectiveError, engine),
                                        {"__module__": __name__, "__doc__": CollectiveError.__doc__})
            except TypeError:  # a base whose layout cannot be combined: the plain class
                _classes[engine] = CollectiveError
        return _classes[engine]


def is_engine_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what a failing collective raises (translated), not a usage error raised
    before anything was sent (ValueError, TypeError, NotImplementedError) nor already translated."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, (NotImplementedError, CollectiveError)))
