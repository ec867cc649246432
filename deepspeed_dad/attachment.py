"""What both attachments share (`engine.DeepSpeedDAD` for ZeRO 0/1, `zero.ZeroDAD` for ZeRO-2/3):
taking the engine, where the attachment lives on it, the methods it shadows, and dAD's per-rank
state inside DeepSpeed checkpoints: the wrapped ``save_checkpoint`` / ``load_checkpoint`` write and
read each rank's ``dad_state_rank{r}.pt`` in the tag folder (``docs/checkpoints.md``, "DeepSpeed").
"""
from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from dad_integrations import DADConfig
from dad_integrations.engines.checkpoint import load_rank_state, save_rank_state

from .aggregator import DeepSpeedAggregator
from .checks import check_engine

ATTR = "_dad_attachment"  # where the attachment lives on the engine


def get_attachment(engine: Any) -> Optional[Any]:
    """The dAD attachment of an engine (made by `attach`, `initialize` or the patched
    ``deepspeed.initialize``): a `DeepSpeedDAD` or a `ZeroDAD`, or None. Accepts Accelerate's
    wrapped model too."""
    engine = getattr(engine, "engine", engine)  # accelerate's DeepSpeedEngineWrapper
    return getattr(engine, ATTR, None)


def shadow(obj: Any, methods: Mapping[str, Callable], originals: Dict[str, Callable]) -> None:
    """Shadow ``obj``'s methods by instance attributes (this object only), noting each original."""
    for name, replacement in methods.items():
        originals[name] = getattr(obj, name)
        setattr(obj, name, replacement)


def unshadow(obj: Any, originals: Dict[str, Callable]) -> None:
    """Give ``obj`` back the methods `shadow` shadowed."""
    for name in originals:
        obj.__dict__.pop(name, None)
    originals.clear()


class RankStateCheckpoints:
    """Base of both attachments: takes the engine (`_take`), shadows its methods, and carries
    ``synchronizer``'s ``state_dict`` in its checkpoints."""

    engine: Any
    aggregator: Any
    synchronizer: Any
    _originals: Dict[str, Callable]

    def _take(self, engine: Any, config: DADConfig, sharded: bool = False) -> Tuple[int, DADConfig]:
        """Check ``engine`` (`checks.check_engine`; ``sharded``: ZeRO-2/3's own checks), then hold it,
        its stage and dAD's aggregator (a new group); returns the world size and the config."""
        world, config = check_engine(engine, config, sharded)
        self.engine, self.zero_stage = engine, int(engine.zero_optimization_stage())
        self.aggregator = DeepSpeedAggregator()
        self._originals = {}
        return world, config

    def _restore_engine(self) -> None:
        """Give the engine its own methods back and forget this attachment."""
        unshadow(self.engine, self._originals)
        if getattr(self.engine, ATTR, None) is self:
            delattr(self.engine, ATTR)

    def save_state(self, directory: str) -> str:
        """Write this rank's dAD state into ``directory`` (every rank calls it); returns the file."""
        return save_rank_state(self.synchronizer, directory, self.aggregator.rank, self.aggregator.world_size)

    def load_state(self, directory: str) -> bool:
        """Load this rank's dAD state from ``directory``; False when it holds none (saved without
        dAD). Saved by another number of processes, every rank loads the old ranks' merged state
        (`dad_integrations.engines.checkpoint.load_rank_state`)."""
        return load_rank_state(self.synchronizer, directory, self.aggregator.rank,
                               self.aggregator.world_size) is not None

    def checkpoint_tag_dir(self, load_dir: str, tag: Optional[str] = None) -> Optional[str]:
        """The folder of checkpoint ``tag`` in ``load_dir``, as ``load_checkpoint`` resolves it (no
        tag: the one named by the ``latest`` file); None when there is no such file."""
        if tag is None:
            name = "latest_universal" if self.engine.load_universal_checkpoint() else "latest"
            latest = os.path.join(load_dir, name)
            if not os.path.isfile(latest):
                return None
            with open(latest) as f:
                tag = f.read().strip()
        return os.path.join(load_dir, str(tag))

    def _patch_checkpoints(self) -> None:
        """Wrap the engine's ``save_checkpoint`` and ``load_checkpoint`` (module doc)."""
        save, load = self.engine.save_checkpoint, self.engine.load_checkpoint
        signature = inspect.signature(load)

        def save_checkpoint(save_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            if save_dir:  # DeepSpeed rejects an empty save_dir itself
                # DeepSpeed's own default tag; written first, so that 'latest' names a whole checkpoint
                name = f"global_step{self.engine.global_steps}" if tag is None else str(tag)
                self.save_state(os.path.join(save_dir, name))
            return save(save_dir, tag, *args, **kwargs)

        def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            tag_dir = self.checkpoint_tag_dir(load_dir, tag)
            result = load(load_dir, tag, *args, **kwargs)
            module_only = signature.bind(load_dir, tag, *args, **kwargs).arguments.get("load_module_only", False)
            if result[0] is not None and tag_dir is not None and not module_only:
                self.load_state(tag_dir)
            return result

        save_checkpoint.__doc__, load_checkpoint.__doc__ = save.__doc__, load.__doc__
        shadow(self.engine, {"save_checkpoint": save_checkpoint, "load_checkpoint": load_checkpoint}, self._originals)
