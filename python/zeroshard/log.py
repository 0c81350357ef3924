"""The zeroshard logger: rank 0 prints by default; ZEROSHARD_LOG_ALL_RANKS=1 lets every rank speak."""
import logging
import os
import sys

logger = logging.getLogger("zeroshard")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[zeroshard] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(os.environ.get("ZEROSHARD_LOG_LEVEL", "INFO").upper())
    logger.propagate = False


def all_ranks_log() -> bool:
    return os.environ.get("ZEROSHARD_LOG_ALL_RANKS", "0") not in ("", "0", "false", "False")


def runtime_warning(message: str) -> None:
    """The C++ runtime's warnings (runtime/log.h), which name their rank themselves."""
    logger.warning(f"warning: {message}")


def log_rank0(msg: str, rank: int) -> None:
    if rank == 0 or all_ranks_log():
        logger.info(msg if rank == 0 and not all_ranks_log() else f"[rank {rank}] {msg}")
