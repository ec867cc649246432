"""dAD's per-rank state in checkpoints: one file per rank, next to the engine's own files.

dAD's state (rank-dAD warm-start factors, error-feedback residuals, weights sent dense for good)
differs across ranks, so every rank writes its own ``dad_state_rank{r}.pt`` into the checkpoint
folder and reads its own back. The engines' glue calls these from their checkpoint paths
(Accelerate's ``save_state`` hooks, DeepSpeed's ``save_checkpoint``, the Trainer's ``on_save``);
a plain ``torch.distributed`` loop may call them directly.
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

FORMAT = 1


def state_file(directory: str, rank: int, index: int = 0) -> str:
    """The path of rank ``rank``'s dAD state in ``directory`` (``index``: which synchroniser,
    when one checkpoint holds several models)."""
    return os.path.join(directory, f"{_prefix(index)}{rank}.pt")


def _prefix(index: int) -> str:
    return "dad_state_rank" if index == 0 else f"dad_state_{index}_rank"


def save_rank_state(sync: Any, directory: str, rank: int, world_size: int, index: int = 0,
                    **extra: Any) -> str:
    """Write ``sync.state_dict()`` to this rank's file in ``directory``; returns the path.

    Every rank calls it with its own rank. ``extra`` (plain values, e.g. ``global_step``) is stored
    alongside and returned by `load_rank_state`.
    """
    os.makedirs(directory, exist_ok=True)
    path = state_file(directory, rank, index)
    payload = {"format": FORMAT, "rank": rank, "world_size": world_size, "state": sync.state_dict(), **extra}
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves no truncated state file behind
    return path


def load_rank_state(sync: Any, directory: str, rank: int, world_size: int, index: int = 0) -> Optional[dict]:
    """Load this rank's file from ``directory`` into ``sync``; returns the stored payload.


    A folder without any dAD state (a checkpoint saved without dAD) loads nothing, says so in the
    log and returns None: warm starts and error feedback then start afresh. Raises
    `FileNotFoundError` when other ranks' files are there but not this rank's, and `ValueError`
    when the file was saved by a job with another number of processes (per-rank state cannot be
    redistributed), each naming the file.
    """
    path = state_file(directory, rank, index)
    if not os.path.isfile(path):
        found = glob.glob(os.path.join(glob.escape(directory), f"{_prefix(index)}*.pt"))
        if not found:
            log.info("dAD: %s holds no dAD state (saved without dAD); rank-dAD warm starts and error "
                     "feedback start afresh", directory)
            return None
        raise FileNotFoundError(
            f"dAD state for rank {rank} is missing: {path} does not exist, though the checkpoint holds "
            f"{len(found)} dAD state file(s); it was saved by a job with a different number of processes "
            f"(this one has {world_size}), and dAD's per-rank state cannot be redistributed")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    saved_world = payload.get("world_size")
    if saved_world != world_size:
        raise ValueError(f"{path} was saved by a job of {saved_world} processes, this one has {world_size}: "
                         f"dAD's per-rank state (error-feedback residuals, warm starts) cannot be "
                         f"redistributed; resume with {saved_world} processes")
    if payload.get("rank") != rank:
        raise ValueError(f"{path} holds the dAD state of rank {payload.get('rank')}, not of rank {rank}")
    # load_state_dict puts every tensor on its parameter's device and dtype
    sync.load_state_dict(payload["state"])
    return payload


def keeps_state(sync: Any) -> bool:
    """Does ``sync`` carry per-rank state between steps worth a checkpoint file? (FSDP2's
    synchroniser has ``state_dict`` but, in exact and lossless auto modes, nothing in it.)"""
    return callable(getattr(sync, "state_dict", None)) and bool(getattr(sync, "keeps_state", True))
