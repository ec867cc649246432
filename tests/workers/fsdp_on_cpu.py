"""Let Accelerate run its FSDP path on CPU processes (the tests' name for it).

The shim itself is `dad_examples.fsdp_on_cpu` (the examples use it too, on CPUs only); its module
doc says what it adds to `AcceleratorState.__init__` and why. Workers import it from here.
"""
from __future__ import annotations

from dad_examples.fsdp_on_cpu import allow_fsdp_on_cpu

__all__ = ["allow_fsdp_on_cpu"]
