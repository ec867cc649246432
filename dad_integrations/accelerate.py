"""Hugging Face Accelerate: switch a prepared model's gradient synchronisation to dAD
(``docs/guides/accelerate.md``).

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sync = enable_dad(accelerator, model, {"mode": "auto", "rank": 4})
    ...                                   # the training loop is unchanged
    sync.last_step_report().totals        # bytes sent, and what all-reduce would have sent

By Accelerate's distributed type (what each keeps working: ``docs/guides/accelerate.md``): under
DDP dAD becomes its communication hook (`register_dad_comm_hook`); under DeepSpeed the config's
``"dad"`` block switches it on (`deepspeed_dad`, found through `dad_integrations.engines`); under
FSDP2 it goes inside the reduce-scatter (`enable_dad_fsdp`; FSDP1 is refused, `engines.fsdp_detect`).
dAD's per-rank state follows ``save_state`` / ``load_state``. One process gets None; Megatron-LM
and XLA are refused.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import List, Mapping, Optional, Union

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dad_integrations.engines import banner
from dad_integrations.engines.checkpoint import keeps_state, load_rank_state, save_rank_state
from dad_integrations.config import DADConfig
from dad_integrations.ddp_hook import register_dad_comm_hook
from dad_integrations.engines.registry import get_engine
from dad_integrations.logs import OnceLogger
from dad_integrations.engines.fsdp_detect import FSDP1_MESSAGE, fsdp2_modules
from dad_integrations.synchronizer import DADSynchronizer

log = logging.getLogger(__name__)

_DDP_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
              "MULTI_HPU", "MULTI_NEURON")
_say_once = OnceLogger(log, level=logging.INFO, rank=0)  # one process: rank 0


@banner.engine("Accelerate")  # the attach below announces itself by this name
def enable_dad(accelerator, model: nn.Module,
               config: Union[DADConfig, Mapping, None] = None):
    """Synchronise ``model``'s gradients with dAD; call once, after ``accelerator.prepare(...)``
    (under FSDP2 also before the first forward).

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model (the DDP wrapper or the model it wraps; under FSDP2 the
            ``fully_shard``-ed model ``prepare`` returned).
        config: a `DADConfig` or a dict of its keys; None uses the defaults (``mode="auto"``).

    Returns:
        The synchroniser (for ``last_step_report()``): a `DADSynchronizer` (DDP, DeepSpeed), an
        `FSDPDADSynchronizer` (FSDP2), or None in a single process.
    """
    kind = getattr(accelerator.distributed_type, "value", str(accelerator.distributed_type))
    if kind == "NO" or accelerator.num_processes == 1:
        _refuse_launched_alone(kind, accelerator.num_processes)
        _say_once("dAD: a single process has nothing to synchronise; training runs unchanged")
        return None
    if kind == "DEEPSPEED":
        return _enable_on_deepspeed(accelerator, model, config)
    if kind == "FSDP":
        return _enable_on_fsdp(accelerator, model, config)
    if kind not in _DDP_TYPES:
        raise ValueError(f"dAD does not support Accelerate's distributed type {kind}: it replaces "
                         f"DDP's or DeepSpeed's gradient all-reduce or FSDP2's reduce-scatter")
    ddp = _find_ddp(accelerator, model)
    sync = register_dad_comm_hook(ddp, config, compiled=_compiles(accelerator, model))
    _checkpoint_with_accelerator(accelerator, ddp, sync)
    if accelerator.is_main_process:  # the same on every process
        log.info("dAD enabled on Accelerate (%s, %d processes) as DDP's communication hook",
                 kind, accelerator.num_processes)
    return sync


def _launched_world_size() -> int:
    """How many processes the launcher started, from the variables torchrun and MPI set (1: none)."""
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def _refuse_launched_alone(kind: str, num_processes: int) -> None:
    """Raise where the launcher started several processes but Accelerate runs this one alone: each
    would train its own model, silently (a plain ``Accelerator()`` on CPUs, ``docs/guides/accelerate.md``)."""
    launched = _launched_world_size()
    if launched <= 1 or kind != "NO":
        return
    raise ValueError(f"enable_dad: the launcher started {launched} processes, but Accelerate runs this one alone "
                     f"(distributed type {kind}, {num_processes} process): every process would train its own "
                     f"model and nothing would be synchronised. Without GPUs Accelerate distributes over the "
                     f"CPU only when told to: Accelerator(cpu=True), or ACCELERATE_USE_CPU=1 in the environment "
                     f"(accelerate launch with use_cpu: true in its config starts the processes but does not "
                     f"tell them)")


def _find_ddp(accelerator, model: nn.Module) -> DistributedDataParallel:
    """The DDP wrapper Accelerate made of ``model`` (passed wrapped or not)."""
    model = getattr(model, "_orig_mod", model)  # compiled by prepare (``dynamo_backend``)
    if isinstance(model, DistributedDataParallel):
        return model
    for candidate in getattr(accelerator, "_models", []):
        candidate = getattr(candidate, "_orig_mod", candidate)
        if isinstance(candidate, DistributedDataParallel) and candidate.module is model:
            return candidate
    raise ValueError("enable_dad() needs the model returned by accelerator.prepare(...) (wrapped in "
                     "DistributedDataParallel); call it after prepare()")


def _compiles(accelerator, model: nn.Module) -> Optional[bool]:
    """True where ``prepare`` compiled the model (Accelerate's ``dynamo_backend``: it compiles the
    DDP wrapper, after dAD cannot see it); None leaves it to the synchroniser to read."""
    plugin = getattr(getattr(accelerator, "state", None), "dynamo_plugin", None)
    backend = str(getattr(getattr(plugin, "backend", None), "value", getattr(plugin, "backend", "NO")) or "NO")
    return True if backend.upper() != "NO" or hasattr(model, "_orig_mod") else None


def _enable_on_fsdp(accelerator, model: nn.Module, config: Union[DADConfig, Mapping, None]):
    """FSDP2: dAD inside the prepared model's reduce-scatter; FSDP1: an error saying why not."""
    from dad_integrations.fsdp import enable_dad_fsdp  # imports FSDP2's internals: only when FSDP runs

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    version = getattr(plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(FSDP1_MESSAGE.format(where=f"enable_dad (Accelerate's FSDP plugin has fsdp_version "
                                                    f"{version})"))
    root = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if not fsdp2_modules(root):
        raise ValueError("enable_dad() needs the model returned by accelerator.prepare(model, optimizer) "
                         "under FSDP2 (fully_shard-ed); call it after prepare() and before the first forward")
    sync = enable_dad_fsdp(root, config)
    if keeps_state(sync):  # the rank routes' residuals and warm starts, one file per rank
        _checkpoint_with_accelerator(accelerator, root, sync)
    elif accelerator.is_main_process:  # the same on every process
        log.info("dAD under FSDP2 keeps no state between steps in mode %s: accelerator.save_state writes "
                 "no dAD file and load_state needs none", sync.config.mode)
    if accelerator.is_main_process:
        log.info("dAD enabled on Accelerate (FSDP2, %d processes) inside FSDP2's gradient reduce-scatter",
                 accelerator.num_processes)
    return sync


def _checkpoint_with_accelerator(accelerator, wrapper: nn.Module, sync) -> None:
    """Save and load ``sync``'s per-rank state with ``accelerator.save_state`` / ``load_state``, by
    pre-hooks run on every process (``docs/checkpoints.md``), holding the model (the DDP wrapper, or
    the FSDP2 model) and the synchroniser weakly, removed with the synchroniser."""
    sync_ref, ddp_ref = weakref.ref(sync), weakref.ref(wrapper)

    def index_in(models: List[nn.Module]) -> Optional[int]:
        s, d = sync_ref(), ddp_ref()
        if s is None or d is None:
            return None
        for i, m in enumerate(models):  # Accelerate lists the bare model, not the DDP wrapper
            if m is d or m is getattr(d, "module", None):
                return i
        return None  # freed (accelerator.free_memory): not part of this checkpoint

    def save_hook(models: List[nn.Module], weights: list, output_dir: str) -> None:
        index = index_in(models)
        if index is not None:
            save_rank_state(sync_ref(), output_dir, accelerator.process_index, accelerator.num_processes,
                            index=index)

    def load_hook(models: List[nn.Module], input_dir: str) -> None:
        # under FSDP (and DeepSpeed) load_state loads the models itself and hands the hooks an empty
        # list: the model's index is then its place in accelerator._models, as save_state's hooks see it
        index = index_in(models or list(getattr(accelerator, "_models", [])))
        if index is not None:
            load_rank_state(sync_ref(), input_dir, accelerator.process_index, accelerator.num_processes,
                            index=index)

    for handle in (accelerator.register_save_state_pre_hook(save_hook),
                   accelerator.register_load_state_pre_hook(load_hook)):
        weakref.finalize(sync, handle.remove)


def _enable_on_deepspeed(accelerator, model: nn.Module,
                         config: Union[DADConfig, Mapping, None]) -> Optional[DADSynchronizer]:
    adapter = get_engine("deepspeed")
    engine = model if adapter.is_engine(model) else next(
        (c for c in getattr(accelerator, "_models", []) if getattr(c, "module", None) is model), None)
    if engine is None:
        raise ValueError("enable_dad() needs the DeepSpeed engine returned by accelerator.prepare(...)")
    sync = adapter.find(engine)
    if sync is None:
        if config is None:
            raise ValueError("dAD is not enabled on this DeepSpeed engine: add a \"dad\" block to the "
                             "DeepSpeed config (docs/guides/deepspeed.md), or pass config= to enable_dad()")
        sync = adapter.attach(engine, config)
    return sync
