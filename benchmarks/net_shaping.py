"""Bandwidth-limited links on one machine: a private network namespace whose loopback is shaped.

``unshare -rn`` (a user + network namespace; no root needed where user namespaces are allowed)
gives the benchmark's ranks a loopback of their own, and ``tc qdisc add dev lo root tbf rate R``
limits it. Both directions of every connection cross the same ``lo`` queue, so a rate R here is
a *shared* R (both ranks' traffic together): stricter than a full-duplex NIC of rate R, for which
the symmetric traffic of 2-rank collectives would see twice the capacity. The MTU is set to 1500
(an Ethernet's), so that the token bucket can be small and shape every burst.
"""
from __future__ import annotations

import shutil
import subprocess
from typing import List, Optional, Tuple

RATES = {"10gbit": 1e10, "1gbit": 1e9, "100mbit": 1e8}
MTU = 1500


def tbf_args(rate: str) -> List[str]:
    bits = RATES[rate]
    # bucket: 1 ms of traffic at the rate, at least 10 MTU-sized packets (measured with one TCP
    # stream: 1gbit -> ~900 Mbit/s, 100mbit -> ~93 Mbit/s; ACKs share the queue)
    burst = max(int(bits / 8 * 0.001), 10 * MTU)
    return ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", str(burst),
            "latency", "200ms"]


def namespace_prefix() -> List[str]:
    return ["unshare", "-rn"]


def probe(rate: str = "1gbit") -> Tuple[bool, str]:
    """Can this machine make a namespace and shape its loopback? (ok, reason when not)."""
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool!r} is not installed"
    script = f"ip link set lo up && ip link set lo mtu {MTU} && {' '.join(tbf_args(rate))}"
    try:
        proc = subprocess.run(namespace_prefix() + ["sh", "-c", script], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"cannot run unshare: {e}"
    if proc.returncode != 0:
        return False, f"'unshare -rn' + tc failed: {(proc.stderr or proc.stdout).strip()[:300]}"
    return True, ""


def setup_inside(rate: Optional[str]) -> None:
    """Run inside the namespace: bring ``lo`` up and shape it (``rate`` None: unshaped)."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if rate is not None:
        subprocess.run(["ip", "link", "set", "lo", "mtu", str(MTU)], check=True)
        subprocess.run(tbf_args(rate), check=True)
