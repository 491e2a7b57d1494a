"""A logger that knows its rank.

With N processes, N copies of every message is noise, and one message with no rank is a mystery. So:

    logger = get_dist_logger()
    logger.info("epoch 1 done")                 # rank 0 only (pass ranks=[...] for others)
    logger.info("my shard", ranks=None)          # every rank
    logger.warning("loss is nan")                # every rank: problems are never hidden

and every line says who wrote it:

    2026-11-21 10:00:00 [rank 1] WARNING nanocolossal: loss is nan

The rank is read when the message is written, so a logger made before `launch` is fine.
"""
from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional

from .context import gpc, on_destroy

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is *now* (pytest and tqdm swap it)."""

    stream = property(lambda self: sys.stdout, lambda self, value: None)  # type: ignore


class DistributedLogger:
    def __init__(self, name: str) -> None:
        self._logger = logging.getLogger(name)
        self._logger.propagate = False
        self._logger.setLevel(logging.INFO)
        if not self._logger.handlers:
            handler = _StdoutHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, "%Y-%m-%d %H:%M:%S"))
            self._logger.addHandler(handler)

    def _log(self, level: int, msg: str, ranks: Optional[Iterable[int]]) -> None:
        if ranks is None or gpc.rank in ranks:
            self._logger.log(level, msg, extra={"rank": gpc.rank})

    def debug(self, msg: str, ranks: Optional[Iterable[int]] = (0,)) -> None:
        self._log(logging.DEBUG, msg, ranks)

    def info(self, msg: str, ranks: Optional[Iterable[int]] = (0,)) -> None:
        """Log on the given global ranks (default rank 0; None means every rank)."""
        self._log(logging.INFO, msg, ranks)

    def warning(self, msg: str, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.WARNING, msg, ranks)

    def error(self, msg: str, ranks: Optional[Iterable[int]] = None) -> None:
        self._log(logging.ERROR, msg, ranks)

    def set_level(self, level: int | str) -> None:
        self._logger.setLevel(level)

    def log_to_file(self, path: str) -> None:
        """Also append every message this rank logs to `path` (use a per-rank name)."""
        handler = logging.FileHandler(path)
        handler.setFormatter(logging.Formatter(_FORMAT, "%Y-%m-%d %H:%M:%S"))
        self._logger.addHandler(handler)


_loggers: dict[str, DistributedLogger] = {}


def get_dist_logger(name: str = "nanocolossal") -> DistributedLogger:
    """The process-wide logger called `name` (created on first use)."""
    if name not in _loggers:
        _loggers[name] = DistributedLogger(name)
    return _loggers[name]


def _reset_loggers() -> None:
    """A job's level (set_level) and files (log_to_file), forgotten by gpc.destroy()."""
    for name in _loggers:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        for handler in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(handler)
            handler.close()


on_destroy(_reset_loggers)


def disable_existing_loggers(include: Optional[Iterable[str]] = None,
                             exclude: Iterable[str] = ("nanocolossal",)) -> None:
    """Silence other libraries' loggers (those in `include`, default all but `exclude`): the
    tutorials call this first so that only the distributed logger's lines reach the console."""
    for name in list(logging.root.manager.loggerDict):
        chosen = (name in include if include is not None
                  else not any(name.startswith(e) for e in exclude))
        if chosen:
            logging.getLogger(name).disabled = True
