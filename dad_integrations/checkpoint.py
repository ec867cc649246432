"""The checkpoint helpers' old path (before issue 26): they live in `dad_integrations.engines.checkpoint`,
and the ones a training loop calls are on the package's face (``from dad_integrations import
save_rank_state``). Each name here still works and warns once."""
from dad_integrations._moved import shim

_MOVES = {**dict.fromkeys(("save_rank_state", "load_rank_state", "merge_rank_states", "state_file"),
                          "dad_integrations"),
          **dict.fromkeys(("keeps_state", "best_rank_q", "FORMAT"), "dad_integrations.engines.checkpoint")}
__all__, __getattr__, __dir__ = shim(__name__, _MOVES)
