"""One line on rank 0 when dAD attaches, shown at default log levels through `logs.say` (the
``dad_integrations.banner`` channel, ``docs/guarantees.md``), as DeepSpeed and Accelerate announce
themselves: Hugging Face's scripts and the ``Trainer`` drop INFO records.

    dAD attached to DeepSpeed ZeRO-0: mode auto, rank 4, objective time, 12 weights by factors, 4 parameters dense, world size 2

Once per attach. Only the objects that do the work announce (`DADSynchronizer`, FSDP2's and
ZeRO's synchronisers), each once, when its attach is complete. The integrations around them
(DDP's hook, Horovod, DeepSpeed, Accelerate, the Trainer) name themselves with `engine`, and the
outermost name wins: a ``Trainer`` whose attach goes through DDP's hook into `DADSynchronizer`
announces ``Transformers Trainer``, once.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

from dad_integrations import elastic
from dad_integrations.logs import SAY_LOGGER, say
from dad_integrations.routing.memory import describe, engine_kind, rank_memory

if TYPE_CHECKING:
    from torch import nn

    from dad_integrations.capture.units import FactorUnit
    from dad_integrations.config import DADConfig

LOGGER_NAME = SAY_LOGGER  # a public name (users silence it), not the module path

_engine: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("dad_banner_engine", default=None)


@contextlib.contextmanager
def engine(name: str) -> Iterator[None]:
    """Name the engine that the attach run inside the block serves (an outer name wins)."""
    token = _engine.set(name) if _engine.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _engine.reset(token)


def dense_count(model: "nn.Module", units: Sequence["FactorUnit"]) -> int:
    """Trainable parameters of ``model`` that no factor unit carries (its weight or its biases)."""
    carried = {id(p) for u in units for p in u.params}
    return sum(1 for p in model.parameters() if p.requires_grad and id(p) not in carried)


def memory_line(default_engine: str, config: "DADConfig", model: "nn.Module", units: Sequence["FactorUnit"],
                world_size: int) -> str:
    """The attach line of what a rank holds (`routing.memory`) under an unsharded engine (named as
    `announce` names it): the engine's state, whole residuals and warm starts of the weights the
    rank routes may take, captured rows."""
    trained = [p for p in model.parameters() if p.requires_grad]
    ranked = [u.shape for u in units if not u.dense_only]
    item = trained[0].element_size() if trained else 4
    mem = rank_memory(engine_kind(_engine.get() or default_engine), params=sum(p.numel() for p in trained),
                      world_size=world_size, routed=ranked, captured=[u.shape for u in units if u.has_factors],
                      rank=None if config.mode == "exact" else config.rank, error_feedback=config.error_feedback,
                      error_feedback_rank=config.error_feedback_rank, residual_budget=None, param_itemsize=item,
                      residual_itemsize=max(item, 4), warm_start=config.warm_start)
    return describe(mem)


def announce(default_engine: str, config: "DADConfig", *, process_rank: int, world_size: int,
             factor_weights: int, dense_params: int, hops: Optional[str] = None,
             memory: Optional[str] = None) -> Optional[str]:
    """Show the attach line on rank 0 (``process_rank``: this process's rank in dAD's group);
    returns the line (None elsewhere). ``default_engine`` names the engine when no `engine` block
    encloses the call. ``hops`` (`exchange.levels.describe_hops`: the nodes, each hop's link, flat
    or two levels) is said on the next line, then ``memory`` (`memory_line`, or a sharded engine's
    `routing.memory.describe`)."""
    if process_rank != 0:
        return None
    name = _engine.get() or default_engine
    rank_text = f"rank {config.rank}" if config.rank is not None else "no rank routes"
    line = (f"dAD attached to {name}: mode {config.mode}, {rank_text}, objective {config.objective}, "
            f"{factor_weights} weights by factors, {dense_params} parameters dense, world size {world_size}")
    said = say(line, rank=process_rank)
    if hops is not None:
        say(hops, rank=process_rank)
    if memory is not None:
        say(memory, rank=process_rank)
    elastic.warn_if_unprefixed()  # a torchelastic restart on torch's unprefixed store, said once
    return said
