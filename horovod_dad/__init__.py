"""Horovod adapter for dAD: `DADOptimizer`, a drop-in for ``hvd.DistributedOptimizer``, and
`HorovodAggregator`, dAD's collectives over Horovod's.

Importing this package imports Horovod (built by ``scripts/build_horovod.sh``); the core package
``dad_integrations`` never does.
"""
from ._horovod import BUILD_HINT
from .aggregator import HorovodAggregator, node_process_sets
from .optimizer import DADOptimizer
from . import elastic as _elastic  # noqa: E402,F401  TorchState's handler for DADOptimizer (Horovod elastic)

__all__ = ["BUILD_HINT", "DADOptimizer", "HorovodAggregator", "node_process_sets"]
