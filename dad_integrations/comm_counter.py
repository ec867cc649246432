"""The byte counter's old path (before issue 26): ``from dad_integrations import CollectiveCounter``
(it lives in `dad_integrations.comm.counter`). Each name here still works and warns once."""
from dad_integrations._moved import shim

_MOVES = {**dict.fromkeys(("CollectiveCounter", "Traffic"), "dad_integrations"),
          **dict.fromkeys(("ALL_GROUPS", "Collective", "NAMESPACES", "wire_bytes"), "dad_integrations.comm.counter")}
__all__, __getattr__, __dir__ = shim(__name__, _MOVES)
