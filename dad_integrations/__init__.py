"""dad-integrations: distributed auto-differentiation (dAD, rank-dAD) for PyTorch training engines.

Send each layer's gradient factors instead of its gradient, and rebuild the exact average on every
rank (Baker et al., arXiv 2102.09631). See `DADSynchronizer` for the training-loop API, and
`register_kind` to teach capture a layer kind of your own.
"""
from dad_integrations.capture.layers import Claim, LayerKind, register_kind
from dad_integrations.comm.aggregator import CommHandle, EqualSizeAggregator, FactorAggregator, Traffic
from dad_integrations.comm.counter import CollectiveCounter
from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
from dad_integrations.config import DADConfig
from dad_integrations.ddp_hook import register_dad_comm_hook
from dad_integrations.elastic import init_process_group
from dad_integrations.report import ParamReport, StepReport
from dad_integrations.synchronizer import DADSynchronizer

__all__ = ["Claim", "CollectiveCounter", "CommHandle", "DADConfig", "DADSynchronizer", "EqualSizeAggregator",
           "FactorAggregator", "LayerKind", "ParamReport", "StepReport", "TorchDistributedAggregator", "Traffic",
           "init_process_group", "register_dad_comm_hook", "register_kind"]
__version__ = "0.1.0"
