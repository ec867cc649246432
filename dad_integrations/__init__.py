"""dad-integrations: distributed auto-differentiation (dAD, rank-dAD) for PyTorch training engines.

Send each layer's gradient factors instead of its gradient, and rebuild the exact average on every
rank (Baker et al., arXiv 2102.09631). See `DADSynchronizer` for the training-loop API.
"""
from .aggregator import CommHandle, EqualSizeAggregator, FactorAggregator, Traffic
from .config import DADConfig
from .ddp_hook import register_dad_comm_hook
from .report import ParamReport, StepReport
from .synchronizer import DADSynchronizer
from .torch_distributed import TorchDistributedAggregator

__all__ = ["CommHandle", "DADConfig", "DADSynchronizer", "EqualSizeAggregator", "FactorAggregator", "ParamReport",
           "StepReport", "TorchDistributedAggregator", "Traffic", "register_dad_comm_hook"]
__version__ = "0.1.0"
