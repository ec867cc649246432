"""Attaching a `DADSynchronizer` to a DDP model for its communication hook: over a new group of
DDP's ranks, closing the hook of a previous DDP around the same module (`DRIVERS`)."""
from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn

from dad_integrations.capture.compiled import is_compiled
from dad_integrations.capture.hooks import remove_detached_captures
from dad_integrations.comm.aggregator import FactorAggregator
from dad_integrations.comm.groups import new_group_like
from dad_integrations.config import DADConfig
from dad_integrations.engines import banner
from dad_integrations.logs import process_rank
from dad_integrations.synchronizer import DADSynchronizer

log = logging.getLogger("dad_integrations.ddp_hook")  # the hook's logger, as before the split

# per module, the hook of the last DDP around it (weak: a dropped model takes its entry along)
DRIVERS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # of `ddp_hook.DDPDriver`


def wrapper_compiled(ddp: nn.parallel.DistributedDataParallel, compiled: Optional[bool]) -> bool:
    """Whether ``ddp`` itself runs under ``torch.compile`` (said by ``compiled=True``, with no compiled
    module inside it): then it gets no forward pre-hook, which would only be traced, doing nothing
    (`DDPDriver.before_forward`), and cost a graph break (dynamo traces a hooked built-in module's
    ``forward`` as a frame of its own, and meets DDP's own break again there)."""
    return bool(compiled) and not is_compiled(ddp.module)


def close_previous(module: nn.Module) -> None:
    """The module was wrapped in a DDP with the dAD hook before (PyTorch's tests wrap one model
    in a new DDP case after case): the new DDP takes over, as DDP's own reducer does; close the
    old hook's synchroniser, whose hooks on the module would go on capturing rows for nobody."""
    previous = DRIVERS.pop(module, None)
    if previous is not None and previous.sync is not None and not previous.sync._closed:
        if process_rank() == 0:  # the same on every rank
            log.info("dAD: the model was wrapped in a new DDP; the dAD hook of the previous one is closed")
        previous.sync.close()


def attach(ddp: nn.parallel.DistributedDataParallel, config: Union[DADConfig, Mapping, None],
           aggregator: Optional[FactorAggregator], timeout: Optional[timedelta],
           compiled: Optional[bool] = None, state: Optional[Mapping] = None) -> DADSynchronizer:
    """A synchroniser on ``ddp.module`` driven by DDP's hook (DDP broadcast the parameters), with
    ``state`` loaded (a pickled hook's); the captures a loaded module came with, and the hook of a
    previous DDP around it, are removed first."""
    remove_detached_captures(ddp.module)
    close_previous(ddp.module)
    if aggregator is None:
        from dad_integrations.comm.torch_distributed import TorchDistributedAggregator
        aggregator = TorchDistributedAggregator(ranks_group(ddp.process_group, timeout))
    # DDP broadcast rank 0's parameters and buffers when it wrapped the model
    with banner.engine("DDP (comm hook)"):
        sync = DADSynchronizer(ddp.module, aggregator, config, broadcast_parameters=False, compiled=compiled,
                               _driven_by_ddp=True)
    if state is not None:
        sync.load_state_dict(state)
    return sync


def ranks_group(process_group, timeout: Optional[timedelta] = None):
    """A new group over the ranks of DDP's group: dAD's collectives run on a background thread,
    and must not interleave with the user's (or DDP's) own on a shared group. It takes ``timeout``,
    else DDP's group's timeout, so that a stalled rank fails as soon as it would with DDP."""
    ranks = dist.get_process_group_ranks(process_group)
    if len(ranks) != dist.get_world_size():
        # dist.new_group must be called by every rank of the default group, which a DDP over a
        # subgroup cannot promise here
        raise ValueError("DDP runs on a subgroup: pass aggregator=TorchDistributedAggregator(group) with a "
                         "group made for dAD on every rank (dist.new_group(ranks))")
    return new_group_like(ranks, base=process_group, timeout=timeout)
