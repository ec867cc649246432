"""dAD's random numbers are its own: nothing dAD does moves the caller's random generators.

Why it matters. The first thing a user does is compare a run with dAD against the same run
without it. If dAD drew one number from torch's global generator at attach (the compute model's
test matrices, a probe layer's initialisation), every later dropout mask, data shuffle and
``torch.randn`` of the training loop would differ, and dAD would look lossy where it is exact.

Two tools, by what the draw is for:

- `private_generator`: a ``torch.Generator`` of dAD's own, seeded from a number every rank
  knows. Pass it as ``generator=`` where dAD draws itself: the draws are reproducible, and where
  ranks must agree (a shared warm-start ``Q``), every rank draws the same numbers.
- `isolated`: for code that draws from the global generators and takes no ``generator=`` (a
  layer's own initialisation in its constructor): the CPU generator and the device's are saved on
  entry and put back on exit (``torch.random.fork_rng``), so whatever ran inside drew from a copy.

dAD draws nothing from NumPy's or Python's ``random``; it never touches them.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch


def private_generator(device: torch.device, seed: int = 0) -> torch.Generator:
    """A generator on ``device`` of dAD's own, seeded with ``seed`` (the same seed gives the same
    draws on every rank); the global generators are neither read nor moved."""
    return torch.Generator(device=device).manual_seed(seed)


def isolated(device: torch.device) -> ContextManager[None]:
    """A context whose draws from the global generators are undone at exit: the CPU generator's
    state, and ``device``'s where it is an accelerator, are restored (``torch.random.fork_rng``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    if device.type == "meta":
        return contextlib.nullcontext()
    index = device.index
    if index is None:  # "cuda" alone means the current device, which is the one kernels draw on
        index = torch.get_device_module(device.type).current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)
