"""The zeroshard logger: rank 0 prints by default; ZEROSHARD_LOG_ALL_RANKS=1 lets every rank speak."""
import atexit
import logging
import os
import sys

logger = logging.getLogger("zeroshard")
# An application that configured the "zeroshard" logger before zeroshard was imported keeps its
# handlers and level; otherwise zeroshard's own handler, at INFO (the progress lines' level).
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
    logger.addHandler(_handler)
    logger.propagate = False
if logger.level == logging.NOTSET:
    logger.setLevel(os.environ.get("ZEROSHARD_LOG_LEVEL", "INFO").upper())


def all_ranks_log() -> bool:
    return os.environ.get("ZEROSHARD_LOG_ALL_RANKS", "0") not in ("", "0", "false", "False")


def runtime_warning(message: str) -> None:
    """The C++ runtime's warnings (runtime/log.h), which name their rank themselves."""
    logger.warning(f"warning: {message}")


def runtime_info(message: str) -> None:
    """What the C++ runtime prints on purpose (the comms logger's verbose lines)."""
    logger.info(message)


def runtime_progress(what: str, done: int, total: int) -> None:
    """The C++ runtime's progress on long work: a bar on rank 0 (zeroshard/observe/bars.py)."""
    from zeroshard.observe.bars import runtime_progress as draw
    draw(what, done, total)


def _stop_runtime_warnings():
    # At exit, before finalization: later C++ warnings go to stderr, never into a dying interpreter.
    module = sys.modules.get("zeroshard._C")
    if module is not None:
        module.clear_warning_sink()


atexit.register(_stop_runtime_warnings)


def log_rank0(msg: str, rank: int) -> None:
    if rank == 0 or all_ranks_log():
        logger.info(msg if rank == 0 and not all_ranks_log() else f"[rank {rank}] {msg}")


def note_rank0(note: str, rank: int) -> None:
    """A config note (runtime/config's notes): those that start "warning: " at WARNING, like the
    runtime's own warnings, the rest ("auto" resolutions) at INFO."""
    if not note.startswith("warning: "):
        log_rank0(note, rank)
    elif rank == 0 or all_ranks_log():
        logger.warning(note if rank == 0 and not all_ranks_log() else f"[rank {rank}] {note}")
