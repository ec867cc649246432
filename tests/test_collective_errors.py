"""`CollectiveError`'s message (`comm.errors`) and the peer directory (`comm.peers`), in this process:
gloo's error strings parsed, dAD's collective names in words, a peer's address mapped to its rank
and node through a real store, the nodes that do not answer after a timeout, and the error's
classes (the engine's type kept as a base, the engine's error chained). The faults themselves, on
the simulated cluster, are tests/test_faults.py.
"""
from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dad_integrations import CollectiveError
from dad_integrations.comm.errors import (PeerInfo, collective_error, describe_collective, note_step,
                                          parse_engine_error)
from dad_integrations.comm.peers import KEY, PeerDirectory, local_addresses

RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
         "[10.201.20.2]:17598: Connection reset by peer. This is typically caused by a remote worker hanging "
         "or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF!")
TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
           "10000ms for recv operation to complete")


def test_parse_gloo_reset():
    f = parse_engine_error(RESET)
    assert (f.addr, f.port, f.connection_lost, f.timed_out) == ("10.201.20.2", 17598, True, False)
    assert f.summary == "Read error [10.201.20.2]:17598: Connection reset by peer"


def test_parse_gloo_timeout_and_others():
    f = parse_engine_error(TIMEOUT)
    assert (f.addr, f.timed_out, f.connection_lost) == (None, True, False)
    assert f.summary == "Timed out waiting 10000ms for recv operation to complete"
    f = parse_engine_error("[../gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.7]:40012")
    assert (f.addr, f.port, f.connection_lost) == ("10.0.0.7", 40012, True)
    assert parse_engine_error("").addr is None
    f = parse_engine_error("Horovod has been shut down. This was caused by an exception on one of the ranks")
    assert f.shut_down and not f.timed_out and f.addr is None
    text = str(collective_error(RuntimeError(f.summary), collective="all_gather", name="dad.meta.w"))
    assert "another rank failed or left" in text


def test_collective_in_words():
    assert describe_collective("all_gather", "dad.exact.0.weight") == "all_gather of exact factors (dad.exact.0.weight)"
    assert describe_collective("all_gather", "dad.twolevel.exact.fc.weight") == \
        "all_gather of exact factors between nodes (dad.twolevel.exact.fc.weight)"
    assert describe_collective("all_reduce", "dad.dense.3") == "all_reduce of dense gradients (dad.dense.3)"
    assert describe_collective("all_to_all_v", "dad.twolevel.to_owner.fc.weight") == \
        "all_to_all_v of gradients to their owners inside the node (dad.twolevel.to_owner.fc.weight)"
    assert describe_collective("all_reduce", "user.thing") == "all_reduce (user.thing)"


def test_message_names_the_fault():
    e = collective_error(RuntimeError(RESET), collective="all_gather", name="dad.exact.0.weight", rank=1,
                         node="node 0", timeout=timedelta(seconds=10), step=7,
                         peer=PeerInfo(ranks=(2, 3), node="node 1"))
    assert type(e) is CollectiveError and isinstance(e, RuntimeError)
    text = str(e)
    assert text.startswith("dAD's all_gather of exact factors (dad.exact.0.weight) failed at step 7 on rank 1 "
                           "(node 0).")
    assert "peer: one of ranks 2, 3 (node 1), at 10.201.20.2:17598" in text
    assert "process group timeout: 10 s" in text
    assert "node 1 is gone" in text and "Check:" in text
    assert "Connection reset by peer" in text and "GLHF" not in text
    assert (e.step, e.name, e.timed_out, e.timeout) == (7, "dad.exact.0.weight", False, timedelta(seconds=10))


def test_timeout_message_and_unknowns():
    note_step(12)
    e = collective_error(RuntimeError(TIMEOUT), collective="all_reduce", name="dad.dense.0")
    text = str(e)
    assert "timed out at step 12." in text  # the step noted last; no rank given
    assert "peer: unknown (the engine names none)" in text and "process group timeout: unknown" in text
    assert "a node lost, a cut link or a rank stalled" in text and "GLOO_SOCKET_IFNAME" in text
    silent = PeerInfo(silent=(("node 1", (2, 3)),), probed=True)
    text = str(collective_error(RuntimeError(TIMEOUT), collective="all_reduce", name="dad.dense.0", peer=silent,
                                timeout=timedelta(minutes=30)))
    assert "not answering from here: node 1 (ranks 2, 3)" in text and "node 1 cannot be reached" in text
    assert "process group timeout: 1800 s (30 min)" in text
    answered = PeerInfo(probed=True)
    text = str(collective_error(RuntimeError(TIMEOUT), collective="all_reduce", name="dad.dense.0", peer=answered))
    assert "every other node answered" in text and "a rank stalled" in text
    text = str(collective_error(RuntimeError(TIMEOUT), collective="all_reduce", name="dad.dense.0",
                                peer=PeerInfo(alone=True)))
    assert "every rank is on this node" in text and "a rank stalled" in text


def test_engine_type_kept_as_base():
    """``except DistBackendError`` (or Horovod's HorovodInternalError, for its elastic reset) still
    catches the translated error; a plain RuntimeError gives the plain class."""
    e = collective_error(dist.DistBackendError(TIMEOUT), collective="all_reduce", name="dad.dense.0")
    assert isinstance(e, CollectiveError) and isinstance(e, dist.DistBackendError)
    again = collective_error(dist.DistBackendError(TIMEOUT), collective="all_reduce", name="dad.dense.0")
    assert type(again) is type(e)  # one class per engine type
    assert type(collective_error(RuntimeError(TIMEOUT), collective="x", name="y")) is CollectiveError


def _entry(node: str, gloo: str) -> str:
    return json.dumps({"node": node, "gloo": gloo, "addrs": ["127.0.0.1", gloo]})


def test_directory_maps_address_to_ranks_and_node():
    """A 2 x 2 job's entries in a real store, read by rank 0 of node 0."""
    store = dist.HashStore()
    for rank, (node, addr) in enumerate([("node 0", "10.9.0.1"), ("node 0", "10.9.0.1"),
                                         ("node 1", "10.9.0.2"), ("node 1", "10.9.0.2")]):
        store.set(KEY.format(rank), _entry(node, addr))
    d = PeerDirectory(store, range(4), me=0)
    d.label = "node 0"
    d.prefetch()
    peer = d.lookup("10.9.0.2")
    assert (peer.ranks, peer.node) == ((2, 3), "node 1")
    assert d.lookup("127.0.0.1").ranks == (1,)  # loopback: this node's other ranks
    assert d.lookup("10.9.9.9") == PeerInfo()  # unknown address
    text = PeerInfo(ranks=(2,), node="node 1").describe(parse_engine_error(RESET))
    assert text == "rank 2 (node 1), at 10.201.20.2:17598"


def test_probe_counts_a_refusal_as_an_answer():
    """After a timeout the other nodes are probed: a node whose address refuses a connection (this
    host, port 9) answered; loopback entries are not probed. (A node that does not answer, behind
    a cut link, is tests/test_faults.py's: outside a namespace no address is sure to be silent.)"""
    store = dist.HashStore()
    store.set(KEY.format(0), _entry("node 0", "10.9.0.1"))
    store.set(KEY.format(1), _entry("node 1", "127.0.0.2"))  # loopback: skipped, not probed
    mine = [a for a in local_addresses()[1] if not a.startswith("127.")]
    if not mine:
        pytest.skip("this host has no address but loopback")
    store.set(KEY.format(2), _entry("node 2", mine[0]))  # this host: refuses port 9
    d = PeerDirectory(store, range(3), me=0)
    d.label = "node 0"
    peer = d.probe()
    assert peer.probed and peer.silent == (), peer
    assert "every other node answered" in peer.describe(parse_engine_error(TIMEOUT))


def test_aggregator_error_is_translated(group):
    """A collective that fails inside the engine (gloo's all_gather of mismatched sizes on a one-rank
    group raises at issue) reaches the caller as a CollectiveError with the engine's chained."""
    from dad_integrations import TorchDistributedAggregator
    agg = TorchDistributedAggregator(timeout=timedelta(seconds=5))
    out = agg.all_reduce(torch.ones(3), name="dad.dense.0").wait()  # a working collective is untouched
    assert out.tolist() == [1.0, 1.0, 1.0]

    class Broken(TorchDistributedAggregator):
        def _engine_all_reduce(self, tensor, async_op=False):
            return dist.all_reduce(tensor, group=self._group, op=dist.ReduceOp.BAND, async_op=async_op)

    broken = Broken(timeout=timedelta(seconds=5))
    with pytest.raises(CollectiveError) as info:
        broken.all_reduce(torch.ones(3), name="dad.rank.fc.weight").wait()
    assert "all_reduce of rank-compressed factors (dad.rank.fc.weight)" in str(info.value)
    assert "process group timeout: 5 s" in str(info.value) and "on rank 0" in str(info.value)
    assert info.value.__cause__ is not None and not isinstance(info.value.__cause__, CollectiveError)
    with pytest.raises(ValueError):  # a usage error is not a collective's failure
        agg.all_gather(torch.ones(2, 3), name="dad.exact.w", first_dims=[5])


def test_every_collective_name_says_what_it_carries():
    """Each collective name the packages hand an aggregator (``name="dad...."``) has a `KINDS` entry:
    an error in it says what it carried, not only its name."""
    import pathlib
    import re

    from dad_integrations.comm.errors import KINDS, describe_collective

    root = pathlib.Path(__file__).resolve().parents[1]
    names = set()
    for pkg in ("dad_integrations", "deepspeed_dad", "horovod_dad"):
        for path in (root / pkg).rglob("*.py"):
            names.update(m.group(1).rstrip(".") for m in re.finditer(r'name=f?"(dad\.[a-z_.]+)', path.read_text()))
    assert len(names) > 20, names
    silent = sorted(n for n in names if " of " not in describe_collective("all_reduce", n))
    assert not silent, f"collective names without a KINDS entry: {silent} (known: {sorted(KINDS)})"
