"""dAD's per-rank state in checkpoints: one file per rank (``dad_state_rank{r}.pt``) next to the
engine's own files, as it differs across ranks (each engine's way: ``docs/checkpoints.md``). A plain
``torch.distributed`` loop calls `save_rank_state` / `load_rank_state` from the package's face; a job
of another number of processes loads the merge of every old rank's file (`engines.merge`).
"""
from __future__ import annotations

import glob
import itertools
import logging
import os
from typing import Any, Optional

import torch

# merging the states of another world size lives in `engines.merge`; its public names stay importable here
from dad_integrations.engines.merge import best_rank_q, merge_rank_states  # noqa: F401
from dad_integrations.logs import say

log = logging.getLogger(__name__)

FORMAT = 1


def state_file(directory: str, rank: int, index: int = 0) -> str:
    """The path of process ``rank``'s dAD state in ``directory`` (``index``: which synchroniser,
    when one checkpoint holds several models)."""
    return os.path.join(directory, f"{_prefix(index)}{rank}.pt")


def _prefix(index: int) -> str:
    return "dad_state_rank" if index == 0 else f"dad_state_{index}_rank"


def save_rank_state(sync: Any, directory: str, rank: int, world_size: int, index: int = 0,
                    **extra: Any) -> str:
    """Write ``sync.state_dict()`` to this rank's file in ``directory``; returns the path.

    Every rank calls it with its own process rank (``rank``). ``extra`` (plain values, e.g.
    ``global_step``) is stored alongside and returned by `load_rank_state`.
    """
    os.makedirs(directory, exist_ok=True)
    path = state_file(directory, rank, index)
    payload = {"format": FORMAT, "rank": rank, "world_size": world_size, "state": sync.state_dict(), **extra}
    tmp = f"{path}.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves no truncated state file behind
    return path


def load_rank_state(sync: Any, directory: str, rank: int, world_size: int, index: int = 0) -> Optional[dict]:
    """Load this rank's dAD state (``rank``: its process rank) from ``directory`` into ``sync``;
    returns the stored payload.

    Saved by a job of the same size, this rank's own file is loaded as written; by a job of another
    size S, the merge of all S files (`merge_rank_states`; rank 0 says what carried over), and the
    payload returned is old rank 0's with ``"resized_from": S``.

    A folder without any dAD state (a checkpoint saved without dAD) loads nothing, says so in the
    log and returns None: warm starts and error feedback then start afresh. Raises
    `FileNotFoundError`, naming it, when a file the checkpoint should hold is missing, and
    `ValueError` when a file holds another rank's state or its job size disagrees with the others'.
    """
    path = state_file(directory, rank, index)
    if os.path.isfile(path):
        payload = _read(path, rank, None, None)
    else:
        found = glob.glob(os.path.join(glob.escape(directory), f"{_prefix(index)}*.pt"))
        if not found:
            if rank == 0:  # every rank finds none alike
                log.info("dAD: %s holds no dAD state (saved without dAD); rank-dAD warm starts and error "
                         "feedback start afresh", directory)
            return None
        payload = _read(state_file(directory, 0, index), 0, None, len(found))
    saved_world = payload.get("world_size")
    if saved_world != world_size:
        return _load_resized(sync, directory, rank, world_size, index, int(saved_world))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dAD state for rank {rank} is missing: {path} does not exist, though the "
                                f"checkpoint was saved by a job of {saved_world} processes, as this one")
    sync.load_state_dict(payload["state"])  # every tensor onto its parameter's device and dtype
    return payload


def _read(path: str, process_rank: int, world_size: Optional[int], found: Optional[int]) -> dict:
    """One rank's file, checked to hold that rank's state (and, given, of a job of ``world_size``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dAD state for rank {process_rank} is missing: {path} does not exist"
                                + (f", though the checkpoint holds {found} dAD state file(s)" if found else ""))
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("rank") != process_rank:
        raise ValueError(f"{path} holds the dAD state of rank {payload.get('rank')}, not of rank {process_rank}")
    if world_size is not None and payload.get("world_size") != world_size:
        raise ValueError(f"{path} was saved by a job of {payload.get('world_size')} processes, but rank 0's "
                         f"file by one of {world_size}: the checkpoint mixes two jobs' dAD state")
    return payload


def _load_resized(sync: Any, directory: str, process_rank: int, world_size: int, index: int,
                  saved_world: int) -> dict:
    """Every old rank's file merged into this rank's state (`merge_rank_states`), loaded into ``sync``.

    Each new rank reads the S files itself, in rank order, so every rank forms the same merge bit
    for bit with no collective (the engines' load paths may run where none can be issued).
    """
    first = _read(state_file(directory, 0, index), 0, saved_world, None)
    meta = {k: v for k, v in first.items() if k != "state"}
    # old rank 0's state, then each other old rank's, read one at a time (one file in memory)
    merged, summary = merge_rank_states(itertools.chain([first.pop("state")], (
        _read(state_file(directory, r, index), r, saved_world, None)["state"] for r in range(1, saved_world))))
    sync.load_state_dict(merged)
    # shown at default levels: a job resumed at another size should see what its dAD state became
    say(f"dAD: resuming on {world_size} processes from dAD state saved by {saved_world} ({directory}): {summary}",
        rank=process_rank)
    return {**meta, "state": merged, "rank": process_rank, "world_size": world_size, "resized_from": saved_world}


def keeps_state(sync: Any) -> bool:
    """Does ``sync`` carry per-rank state between steps worth a checkpoint file? (FSDP2's
    synchroniser has ``state_dict`` but, in exact and lossless auto modes, nothing in it.)"""
    return callable(getattr(sync, "state_dict", None)) and bool(getattr(sync, "keeps_state", True))
