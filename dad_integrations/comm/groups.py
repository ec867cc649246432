"""Process groups for dAD that keep the user's timeout.

dAD's collectives run on a background thread, so they get a group of their own. ``new_group``
without ``timeout=`` gives it torch's default (30 min for gloo), not ``init_process_group``'s:
`new_group_like` creates it with the timeout of the group it stands in for.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional, Sequence

import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["new_group_like", "process_rank"]

# where no process group is up yet: the launchers' variables (torchrun, DeepSpeed's, Accelerate's,
# horovodrun, Open MPI)
RANK_VARIABLES = ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")


def process_rank() -> int:
    """This process's rank: in torch.distributed's default group where it is up, else the
    launcher's (`RANK_VARIABLES`), else 0 (one process). Lines every rank would say alike are said
    where it is 0 (`logs.OnceLogger`)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def new_group_like(ranks: Sequence[int], *, base: Optional[dist.ProcessGroup] = None,
                   timeout: Optional[timedelta] = None, backend: Optional[str] = None) -> dist.ProcessGroup:
    """A new process group over the global ``ranks``, standing in for ``base`` (None: the default
    group): ``timeout`` and ``backend`` default to ``base``'s (where its timeout cannot be read,
    torch's default). As ``dist.new_group``, every rank of the default group calls it, in order."""
    default = dist.distributed_c10d._get_default_group()
    if base is None or base == dist.GroupMember.WORLD:
        base = default
    if timeout is None:
        timeout = _group_timeout(base)
        if timeout is None and dist.get_rank() == 0:  # the same group on every rank
            log.warning("could not read the timeout of process group %s; dAD's group gets torch's default", base)
    if backend is None and base is not default:
        backend = dist.get_backend(base)
    return dist.new_group(ranks=[int(r) for r in ranks], timeout=timeout, backend=backend)


def _group_timeout(group: dist.ProcessGroup) -> Optional[timedelta]:
    """The timeout of ``group``'s collectives, or None where torch does not let it be read.

    torch keeps no public getter: the timeout lives in each device backend's options (gloo's,
    NCCL's), set from ``init_process_group(timeout=...)`` / ``new_group(timeout=...)``.
    """
    devices = list(getattr(group, "_device_types", ()))
    devices.sort(key=lambda d: d.type != "cpu")  # any would do (one timeout for all); cpu is in every job
    for device in devices:
        try:
            found = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(found, timedelta):
            return found
    # fallback for the default group: init_process_group gives its rendezvous store the same timeout
    if group == dist.distributed_c10d._get_default_group():
        try:
            found = dist.distributed_c10d._get_default_store().timeout
        except (AttributeError, RuntimeError, ValueError):
            return None
        return found if isinstance(found, timedelta) else None
    return None

