"""Layer kinds: one module per kind (``linear``, ``hf_conv1d``, ``embedding``, ``conv``, ``mha``,
``rnn``), registered with `registry.register_kind`; ``docs/concepts/layer-kinds.md`` tables them.

A built-in kind is a new module here, imported below, plus its name in `config.LAYER_KINDS`; a
user's kind is a `LayerKind` subclass registered with `register_kind` anywhere. Row layouts and the
rebuild are in `rows`; this package re-exports them for the codecs.
"""
from dad_integrations.capture.rows import (Block, Rows, add_bias_grad, add_rebuilt_grad, as_matrix, compute_dtype, concat_rows,
                    deterministic_index_add, matrix_shape, output_grad_rows, sorted_segment_add)
from dad_integrations.capture.layers.registry import Claim, LayerKind, get_kind, kind_of, layer_kind, register_kind, registered_kinds
from dad_integrations.capture.layers import linear, hf_conv1d, embedding, conv, mha, rnn  # noqa: E402,F401  (registration)

__all__ = ["Block", "Rows", "add_bias_grad", "add_rebuilt_grad", "as_matrix", "compute_dtype", "concat_rows",
           "deterministic_index_add", "matrix_shape", "output_grad_rows", "sorted_segment_add", "Claim",
           "LayerKind", "get_kind", "kind_of", "layer_kind", "register_kind", "registered_kinds"]
