"""dad-integrations: distributed auto-differentiation (dAD, rank-dAD) for PyTorch training engines.

Send each layer's gradient factors instead of its gradient, and rebuild the exact average on every
rank (Baker et al., arXiv 2102.09631). See `DADSynchronizer` for the training-loop API,
`register_kind` to teach capture a layer kind of your own, and `save_rank_state` /
`load_rank_state` for dAD's per-rank state in a checkpoint of your own loop, `init_process_group`
for elastic restarts across nodes, and `CollectiveError` for a collective that failed. Routes, and
how to add one: `dad_integrations.routes`.
"""
from dad_integrations.capture.layers import Claim, LayerKind, register_kind
from dad_integrations.comm.aggregator import CommHandle, EqualSizeAggregator, FactorAggregator, Traffic
from dad_integrations.comm.counter import CollectiveCounter
from dad_integrations.comm.errors import CollectiveError
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.config import DADConfig
from dad_integrations.ddp_hook import register_dad_comm_hook
from dad_integrations.elastic import init_process_group
from dad_integrations.engines.checkpoint import load_rank_state, merge_rank_states, save_rank_state, state_file
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.synchronizer import DADSynchronizer

__all__ = ["Claim", "CollectiveCounter", "CollectiveError", "CommHandle", "DADConfig", "DADSynchronizer",
           "EqualSizeAggregator", "FactorAggregator", "LayerKind", "ParamReport", "StepReport",
           "TorchDistributedAggregator", "Traffic",
           "init_process_group", "load_rank_state", "merge_rank_states", "register_dad_comm_hook", "register_kind",
           "save_rank_state", "state_file"]
__version__ = "0.1.0"
