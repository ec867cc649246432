"""DeepSpeed adapter for dAD: switch it on with a ``"dad"`` block in the DeepSpeed JSON config.

With the package installed the block is enough: its import hook (`deepspeed_dad_hook`, run by
``deepspeed_dad_hook.pth``) wraps ``deepspeed.initialize`` when DeepSpeed is imported, so the
user's own call, Accelerate's and the Hugging Face ``Trainer``'s all attach dAD.

* `initialize`: ``deepspeed.initialize`` that reads the block and attaches dAD;
* `attach`: attach dAD to an engine built elsewhere;
* `patch_deepspeed_initialize` (or ``import deepspeed_dad.auto``): the hook's wrapper by hand, where
  the hook is not active, or despite ``DAD_DEEPSPEED_HOOK=0``;
* `DeepSpeedAggregator`: the `FactorAggregator` over ``deepspeed.comm``.

Importing it registers the adapter with the core (`dad_integrations.engines`); the core also finds
it through the ``dad_integrations.engines`` entry point without that import.
"""
from .aggregator import DeepSpeedAggregator
from .attachment import get_attachment
from .config import DADBlock, parse_block, split_config
from .engine import DeepSpeedDAD, attach, reduction_scales
from .glue import register as _register
from .initialize import initialize, patch_deepspeed_initialize, unpatch_deepspeed_initialize

_register()

__all__ = ["DADBlock", "DeepSpeedAggregator", "DeepSpeedDAD", "attach", "get_attachment", "initialize",
           "parse_block", "patch_deepspeed_initialize", "reduction_scales", "split_config",
           "unpatch_deepspeed_initialize"]
