"""mpitrain's log records: the rank in every line, quiet on ranks other than 0.

init() calls configure() once the rank is known. By default rank 0 shows
warnings and the other ranks only errors, so a job of N ranks does not print
every warning N times; MPITRAIN_LOG_LEVEL sets one level for every rank.
Every record of the "mpitrain" logger carries a ``rank`` attribute, so a
handler of your own can print it too (``%(rank)d``).
"""

import logging
import sys

LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
          "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}

FORMAT = "%(asctime)s mpitrain[rank %(rank)d] %(levelname)s: %(message)s"

logger = logging.getLogger("mpitrain")
stall_logger = logging.getLogger("mpitrain.stall")
_installed = []     # the handler configure() added last time


def level_name(text):
    """MPITRAIN_LOG_LEVEL's value, lower-cased; a ValueError if it is none of LEVELS."""
    name = text.strip().lower()
    if name not in LEVELS:
        raise ValueError(text)
    return name


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.rank = rank

    def filter(self, record):
        record.rank = self.rank
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (pytest and notebooks swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def configure(rank, level=""):
    """Show mpitrain's records on stderr with the rank; level: a LEVELS name or ""."""
    for installed in _installed:
        logger.removeHandler(installed)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    rank_filter = _RankFilter(rank)
    handler.addFilter(rank_filter)       # records of child loggers reach it too
    logger.addHandler(handler)
    _installed[:] = [handler]
    # Our handler prints the records; passing them on to the root logger too
    # would print each one twice where the application configured logging.
    logger.propagate = False
    if level:
        logger.setLevel(LEVELS[level])
        stall_logger.setLevel(logging.NOTSET)
    else:
        logger.setLevel(logging.WARNING if rank == 0 else logging.ERROR)
        # A process set's stall warning is logged only by that set's coordinator,
        # which need not be rank 0: let it through on every rank.
        stall_logger.setLevel(logging.WARNING)
