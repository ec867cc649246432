"""Messages said once: a fallback that applies at every step is worth one line, at the first."""
from __future__ import annotations

import logging
from typing import Optional, Set


class OnceLogger:
    """Logs each message (or each ``key``) once, with ``prefix`` in front: ``"dAD/FSDP2: ..."``."""

    def __init__(self, logger: logging.Logger, prefix: str = "", level: int = logging.WARNING):
        self.logger, self.prefix, self.level = logger, prefix, level
        self._said: Set[str] = set()

    def __call__(self, message: str, *args: object, key: Optional[str] = None) -> None:
        key = message if key is None else key
        if key not in self._said:
            self._said.add(key)
            self.logger.log(self.level, self.prefix + message, *args)
