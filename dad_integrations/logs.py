"""dAD's messages: said once (`OnceLogger`), by one rank (`process_rank`), and said where users look (`say`).

What every rank would say alike is said by rank 0 only; a line that differs by rank is said where
it happens. `say` is for what a user should see at default log levels (the attach line, nodes and
links, route decisions): Hugging Face's scripts drop INFO records, so these lines go to their own
logger, ``dad_integrations.banner`` (a public name: users silence it by setting its level), with its
own stderr handler, shown at INFO unless the user set a level, not propagating (no double lines).
"""
from __future__ import annotations

import logging
import sys
from typing import Optional, Set

SAY_LOGGER = "dad_integrations.banner"  # a public name (users silence it), not a module path


def process_rank() -> int:
    """This process's rank (`comm.groups.process_rank`: the default group's, else the launcher's)."""
    from dad_integrations.comm.groups import process_rank as rank  # torch.distributed lives in comm
    return rank()


class OnceLogger:
    """Logs each message (or each ``key``) once, with ``prefix`` in front: ``"dAD/FSDP2: ..."``;
    on rank 0 only (``rank``: this process's rank in the caller's group; None reads
    `process_rank` at each message), since what it says is the same on every rank: a message that
    differs by rank goes to the logger itself."""

    def __init__(self, logger: logging.Logger, prefix: str = "", level: int = logging.WARNING,
                 rank: Optional[int] = None):
        self.logger, self.prefix, self.level, self.rank = logger, prefix, level, rank
        self._said: Set[str] = set()

    def __call__(self, message: str, *args: object, key: Optional[str] = None) -> None:
        key = message if key is None else key
        if key not in self._said:
            self._said.add(key)
            if (process_rank() if self.rank is None else self.rank) == 0:
                self.logger.log(self.level, self.prefix + message, *args)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's or a launcher's redirection)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def say_logger() -> logging.Logger:
    """The ``dad_integrations.banner`` logger, with its stderr handler added on first use."""
    logger = logging.getLogger(SAY_LOGGER)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # its own handler shows it; the root's would repeat it
        if logger.level == logging.NOTSET:  # shown at default levels, unless the user set one
            logger.setLevel(logging.INFO)
    return logger


def say(message: str, *, rank: Optional[int] = 0, level: int = logging.INFO) -> Optional[str]:
    """Show ``message`` at default log levels; returns it where it was said (None elsewhere).

    ``rank``: this process's rank in the caller's group; the line is said on rank 0 only (what
    every rank would say alike). None says it on every rank: only for what differs by rank."""
    if rank is not None and rank != 0:
        return None
    logger = say_logger()
    logger.log(level, message)
    for handler in logger.handlers:
        handler.flush()
    return message
