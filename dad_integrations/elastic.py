"""Elastic restarts under torchrun: a default group whose store keys cannot meet a dead attempt's
(why: ``docs/checkpoints.md``, "Elastic restarts across nodes"; pytorch/pytorch#135712).
`init_process_group` puts the group's keys under a prefix of their own per restart attempt;
`warn_if_unprefixed` says so at attach when a restarted job did not use it.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

CALL = "dad_integrations.init_process_group"  # what the warning tells users to call
_group: Optional[Any] = None  # the default group our call made (held: its id cannot be reused)
_warned = False


def restart_attempt() -> Optional[int]:
    """This process's torchelastic restart count, or None outside torchelastic."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def shared_store() -> bool:
    """Whether the ranks use the agent's store, which outlives attempts (torchrun's default; with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` each attempt's rank 0 hosts a fresh one instead)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       timeout: Optional[timedelta] = None, world_size: int = -1, rank: int = -1,
                       store: Optional[dist.Store] = None, **kwargs: Any) -> None:
    """A drop-in for `torch.distributed.init_process_group` that survives torchelastic restarts.

    Under torchelastic on the agent's shared store with the ``env://`` rendezvous, the store is
    built as torch builds it, with ``timeout`` (torch's default for ``backend`` when None) on the
    store too, inside a ``PrefixStore`` of the restart attempt (and world size). Anywhere else, or
    given a ``store`` or another ``init_method``, it is torch's call unchanged. Other keyword
    arguments (``device_id``, ``pg_options``, ...) pass through. Jobs whose nodes join later:
    ``docs/checkpoints.md``, "Elastic restarts across nodes".
    """
    global _group
    attempt = restart_attempt()
    if attempt is None or not shared_store() or store is not None or init_method not in (None, "env://"):
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, world_size=world_size,
                                rank=rank, store=store, **kwargs)
        return
    if timeout is None:
        # torch's own choice when none is given (30 min for gloo, 10 for nccl)
        from torch.distributed.distributed_c10d import Backend, _get_default_timeout
        timeout = _get_default_timeout(Backend(backend or "undefined"))
    # torch's env:// handler: RANK/WORLD_SIZE unless given, a client of the agent's store
    from torch.distributed.rendezvous import rendezvous
    base, rank, world_size = next(rendezvous("env://", rank, world_size, timeout=timeout))
    base.set_timeout(timeout)
    # one prefix per attempt, and per world size: an agent restarts its workers without counting a
    # restart when nodes join, and the world then grows
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    prefixed = dist.PrefixStore(f"dad_elastic/{run}/attempt_{attempt}/world_{world_size}/default_pg", base)
    dist.init_process_group(backend, timeout=timeout, world_size=world_size, rank=rank, store=prefixed, **kwargs)
    _group = dist.group.WORLD


def prefixed_by_attempt() -> bool:
    """Whether the current default group was made by `init_process_group` under torchelastic."""
    return _group is not None and dist.is_initialized() and dist.group.WORLD is _group


def warn_if_unprefixed() -> Optional[str]:
    """Once per process, a WARNING when a restarted torchelastic job (restart count > 0, the
    agent's shared store) runs on a default group made without `init_process_group`; returns the
    message, or None when there is nothing to say. Call it on rank 0 only."""
    global _warned
    attempt = restart_attempt()
    if _warned or not attempt or not shared_store() or not dist.is_initialized() or prefixed_by_attempt():
        return None
    _warned = True
    message = (f"dAD: this is torchelastic restart {attempt}, and the default process group was made "
               f"without {CALL}: torch keys it in the agent's store under the same names every attempt, "
               f"so a restarted rank can read a dead attempt's addresses (a refused connection or a hang "
               f"at init). Call {CALL}(backend=...) instead of torch.distributed.init_process_group "
               f"(docs/checkpoints.md, 'Elastic restarts across nodes').")
    log.warning(message)
    return message
