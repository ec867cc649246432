"""dAD's random numbers are its own: nothing dAD does moves the caller's random generators.

A user compares a run with dAD against the same run without it: one number drawn from torch's
global generator at attach would change every later dropout mask and shuffle, and dAD would look
lossy where it is exact. `private_generator` is a generator of dAD's own, seeded from a number
every rank knows (pass it as ``generator=``); `isolated` undoes the draws of code that takes no
``generator=`` (a layer's own initialisation). dAD never touches NumPy's or Python's ``random``.
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
