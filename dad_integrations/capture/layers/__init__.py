"""Layer kinds: one module per kind (``linear``, ``hf_conv1d``, ``embedding``, ``conv``, ``mha``,
``rnn``), registered with `registry.register_kind`; ``docs/concepts/layer-kinds.md`` tables them.

A built-in kind is a new module here, imported below, plus its name in `config.LAYER_KINDS`; a
user's kind is a `LayerKind` subclass registered with `register_kind` anywhere. Row layouts and the
rebuild are in `capture.rows`.
"""
from dad_integrations.capture.layers.registry import (Claim, LayerKind, get_kind, kind_of, layer_kind, register_kind,
                                                      registered_kinds)
# registers the built-in kinds, in this order
from dad_integrations.capture.layers import linear, hf_conv1d, embedding, conv, mha, rnn  # noqa: F401

__all__ = ["Claim", "LayerKind", "get_kind", "kind_of", "layer_kind", "register_kind", "registered_kinds"]
