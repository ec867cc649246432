"""Real text with no downloads: the Python standard library's own source code.

Examples and tests need a language-modelling corpus that is the same on every machine without
network access. The ``.py`` files of the interpreter's standard library are such a corpus; the
tokens are bytes (vocabulary 256), so no tokenizer is needed either.
"""
from __future__ import annotations

import os
import random
import sysconfig
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch

VOCAB_SIZE = 256
EVAL_FRACTION = 0.05

# Directory names never read: installed third-party packages (they differ between machines)
# and the standard library's own test suites (huge, and full of generated data).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
_SPLITS = {"train": 0, "eval": 1}


def _stdlib_py_files() -> List[str]:
    """Sorted paths of the standard library's ``.py`` files, without skipped directories."""
    root = sysconfig.get_paths()["stdlib"]
    files: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(files)


def stdlib_source_bytes(max_bytes: int = 4_000_000, seed: int = 0) -> bytes:
    """Concatenated source of the standard library's ``.py`` files, at most ``max_bytes`` long.

    The files are listed in sorted order and then shuffled with ``random.Random(seed)``, so a
    prefix of the corpus mixes many modules instead of only those whose names start with "a";
    the result depends only on ``seed``, ``max_bytes`` and the Python version.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    files = _stdlib_py_files()
    random.Random(seed).shuffle(files)
    chunks: List[bytes] = []
    total = 0
    for path in files:
        with open(path, "rb") as fh:
            chunk = fh.read(max_bytes - total)
        chunks.append(chunk)
        total += len(chunk)
        if total >= max_bytes:
            break
    if total == 0:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']!r}")
    return b"".join(chunks)


def byte_lm_batches(
    data: bytes,
    batch_size: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    split: str = "train",
) -> Iterator[torch.Tensor]:
    """Endless batches of byte tokens for language modelling, sharded over ranks.

    Yields ``torch.long`` tensors of shape ``(batch_size, seq_len)`` with values in 0..255, to be
    used as both ``input_ids`` and ``labels``. The ``"train"`` split is the first 95% of ``data``,
    ``"eval"`` the last 5%.

    Each pass ("epoch") over the split cuts it into non-overlapping windows of ``seq_len`` bytes
    starting at a random offset, shuffles them with a permutation that every rank computes alike,
    and deals them round-robin: rank ``r`` takes windows ``r, r + world_size, ...``. Within an
    epoch the ranks' windows are therefore disjoint, and the same ``seed`` gives the same
    sequence of batches on every run.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")

    cut = int(len(data) * (1.0 - EVAL_FRACTION))
    part = data[:cut] if split == "train" else data[cut:]
    tokens = torch.frombuffer(bytearray(part), dtype=torch.uint8).long()
    # Leave room for the random offset so every epoch has the same number of windows.
    windows_per_epoch = (len(tokens) - seq_len + 1) // seq_len
    per_rank = windows_per_epoch // world_size  # equal share: no rank runs ahead of another
    if per_rank < 1:
        raise ValueError(
            f"{split} split has {len(tokens)} bytes: too few for one window of {seq_len} per rank "
            f"({world_size} ranks)")

    positions = torch.arange(seq_len)
    pending: List[int] = []  # this rank's window starts not yet yielded
    epoch = 0
    while True:
        while len(pending) < batch_size:
            # Seeded by (seed, split, epoch) only, so all ranks draw the same offset and order.
            rng = np.random.default_rng([seed, _SPLITS[split], epoch])
            offset = int(rng.integers(seq_len))
            order = rng.permutation(windows_per_epoch)[: per_rank * world_size]
            pending.extend((offset + order[rank::world_size] * seq_len).tolist())
            epoch += 1
        starts = torch.tensor(pending[:batch_size])
        del pending[:batch_size]
        yield tokens[starts[:, None] + positions]


def stdlib_package_snippets(
    packages: Sequence[str], seq_len: int, per_class: int, seed: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """A classification set with no downloads: byte windows of standard-library packages' source.

    Returns ``(tokens, labels)``: ``tokens`` is ``(len(packages) * per_class, seq_len)`` bytes as
    ``torch.long``, ``labels[i]`` the index in ``packages`` (e.g. ``("json", "email", "asyncio")``)
    of the package whose source window ``i`` was cut from. Rows are shuffled with ``seed``.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = _stdlib_py_files()
    rng = np.random.default_rng(seed)
    rows: List[torch.Tensor] = []
    labels: List[int] = []
    for label, package in enumerate(packages):
        prefix = os.path.join(root, package) + os.sep
        source = b"".join(_read(f) for f in files if f.startswith(prefix))
        if len(source) < 2 * seq_len:
            raise ValueError(f"standard-library package {package!r} has too little source for {seq_len}-byte windows")
        tokens = torch.frombuffer(bytearray(source), dtype=torch.uint8).long()
        starts = rng.integers(0, len(tokens) - seq_len, size=per_class)
        rows.append(tokens[torch.as_tensor(starts)[:, None] + torch.arange(seq_len)])
        labels += [label] * per_class
    order = torch.as_tensor(rng.permutation(len(labels)))
    return torch.cat(rows)[order], torch.tensor(labels)[order]


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()
