"""A bursty background CPU load that a benchmark starts and stops itself.

One separate process spins one core in busy bursts of random length (0.2-2 s by default) with idle
gaps of random length in between (0.2-2 s), from a seeded generator, as another job on a shared
machine does. It is bounded three ways, so that it never outlives the benchmark:

- ``max_s``: it stops by itself after that many seconds in all;
- the kernel kills it when the process that started it exits (``PR_SET_PDEATHSIG``, Linux), and it
  also stops when it sees that its parent changed;
- `bursty_load` terminates it (then kills it) when the block ends, on error too.

Started from inside a benchmark's network namespace (``unshare -rn``), it runs in that namespace
and under the same conditions as the ranks.

    with bursty_load(seed=0, max_s=900):
        ...  # spawn the ranks

    python -m benchmarks.cpu_load --seed 0 --max-s 10   # by hand: 10 s of bursts
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
BUSY_S = (0.2, 2.0)
IDLE_S = (0.2, 2.0)
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child process (before exec, or first thing): SIGKILL when its parent exits (Linux;
    elsewhere a no-op)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def hog(seed: int, max_s: float, busy: Tuple[float, float] = BUSY_S, idle: Tuple[float, float] = IDLE_S,
        stats_path: Optional[str] = None) -> dict:
    """Alternate busy bursts and idle gaps until ``max_s`` has passed, the parent is gone, or
    SIGTERM; returns (and writes to ``stats_path``) the bursts, busy and total seconds."""
    rng = random.Random(seed)
    parent = os.getppid()
    start = time.monotonic()
    end = start + max_s
    stats = {"seed": seed, "bursts": 0, "busy_s": 0.0, "total_s": 0.0}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))

    def alive() -> bool:
        return not stop and time.monotonic() < end and os.getppid() == parent

    while alive():
        t0 = time.monotonic()
        burst_end = min(end, t0 + rng.uniform(*busy))
        x = 0
        while alive() and time.monotonic() < burst_end:
            for i in range(20000):  # ~1 ms of pure Python between clock checks
                x += i * i
        stats["bursts"] += 1
        stats["busy_s"] += time.monotonic() - t0
        gap_end = min(end, time.monotonic() + rng.uniform(*idle))
        while alive() and time.monotonic() < gap_end:
            time.sleep(min(0.05, max(0.0, gap_end - time.monotonic())))
    stats["total_s"] = time.monotonic() - start
    if stats_path:
        with open(stats_path, "w") as fh:
            json.dump(stats, fh)
    return stats


@contextlib.contextmanager
def bursty_load(seed: int, max_s: float, *, enabled: bool = True,
                stats_path: Optional[str] = None) -> Iterator[Optional[subprocess.Popen]]:
    """Run `hog` in a separate process for the block (nothing where not ``enabled``)."""
    if not enabled:
        yield None
        return
    cmd = [sys.executable, "-m", "benchmarks.cpu_load", "--seed", str(seed), "--max-s", str(max_s)]
    if stats_path:
        cmd += ["--stats", stats_path]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, preexec_fn=die_with_parent)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def read_stats(path: Optional[str]) -> Optional[dict]:
    try:
        with open(path) as fh:  # type: ignore[arg-type]
            return json.load(fh)
    except (OSError, TypeError, ValueError):
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-s", type=float, default=60.0, help="stop after this many seconds in all")
    p.add_argument("--stats", help="write the bursts and busy seconds here as JSON at the end")
    args = p.parse_args(argv)
    hog(args.seed, args.max_s, stats_path=args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
