"""Where dAD's attachment lives on a DeepSpeed engine, and how to find it again.

Its own module so that both attachments (`deepspeed_dad.engine` for ZeRO 0/1,
`deepspeed_dad.zero` for ZeRO 2/3) reach the slot without importing each other.
"""
from __future__ import annotations

from typing import Any, Optional

ATTR = "_dad_attachment"  # where the attachment lives on the engine


def get_attachment(engine: Any) -> Optional[Any]:
    """The dAD attachment of an engine (made by `attach`, `initialize` or the patched
    ``deepspeed.initialize``): a `DeepSpeedDAD` or a `ZeroDAD`, or None. Accepts Accelerate's
    wrapped model too."""
    engine = getattr(engine, "engine", engine)  # accelerate's DeepSpeedEngineWrapper
    return getattr(engine, ATTR, None)
