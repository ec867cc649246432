"""The examples' text data's old path: it lives in `dad_examples.text_data` (the same distribution).
Each name here still works and warns once."""
from dad_integrations._moved import shim

_MOVES = dict.fromkeys(("VOCAB_SIZE", "EVAL_FRACTION", "stdlib_source_bytes", "byte_lm_batches",
                        "stdlib_package_snippets"), "dad_examples.text_data")
__all__, __getattr__, __dir__ = shim(__name__, _MOVES)
