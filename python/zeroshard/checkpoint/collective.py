"""The few agreements a save or load needs across ranks, on the engine's communicator (so a dead
rank is reported by name, as for every other collective): which ranks failed a phase, and one
rank's text (the temporary directory's name, a failed rank's error)."""
import zlib

import torch

_TEXT_LEN = 1024


def raise_if_failed(run, error, what: str, staged=None, consequence=""):
    """Every rank says whether its part of `what` succeeded (error is None); if any failed, rank 0
    drops `staged` (the uncommitted directory) and every rank raises: the failed rank its own
    error, the others one that names that rank and repeats its message."""
    failed = failed_ranks(run, error is None, what)
    if not failed:
        return
    if staged is not None and run.rank == 0:
        staged.abort()  # now, not whenever the traceback lets the handle go
    message = broadcast_text(run, f"{type(error).__name__}: {error}" if error is not None else "",
                             what + ": the error", src=failed[0])
    if error is not None:
        if consequence:
            try:
                augmented = type(error)(f"{error}{consequence}")
            except Exception:  # noqa: BLE001 - a type that takes other arguments: as it was
                raise error
            raise augmented from error
        raise error
    raise RuntimeError(f"{what}: rank {failed[0]} failed: {message}{consequence}")


def failed_ranks(run, ok: bool, what: str):
    """Every rank says whether its part of `what` succeeded; returns the ranks that failed."""
    if run.world == 1:
        return [] if ok else [0]
    flags = [0.0] * run.world
    flags[run.rank] = 0.0 if ok else 1.0
    summed = run.comm.all_reduce_values(flags, str(run.device), what)
    return [r for r, v in enumerate(summed) if v != 0.0]


def broadcast_text(run, text: str, what: str, src: int = 0) -> str:
    """Rank `src`'s `text` on every rank (UTF-8, cut to 1024 bytes)."""
    if run.world == 1:
        return text
    data = text.encode()[:_TEXT_LEN] if run.rank == src else b""
    values = [float(b) for b in data] + [0.0] * (_TEXT_LEN - len(data))
    summed = run.comm.all_reduce_values(values, str(run.device), what)
    return bytes(int(v) for v in summed).rstrip(b"\0").decode(errors="replace")


def same_on_every_rank(run, text: str, what: str) -> bool:
    """Whether every rank passed the same `text` (compared by CRC32)."""
    if run.world == 1:
        return True
    h = float(zlib.crc32(text.encode()))
    both = torch.tensor([h, -h], dtype=torch.float64, device=run.device)
    run.comm.all_reduce_max(both, what)  # max == min on every rank exactly when all are equal
    return float(both[0]) == -float(both[1])


def held_anywhere(run, names, held_here) -> set:
    """Which of `names` (the same list on every rank) some rank holds: `held_here` itself when
    every rank holds the whole model, else summed over the ranks (a pipeline's stages)."""
    if not run.placement.names_split or run.world == 1:
        return {n for n in names if n in held_here}
    flags = [1.0 if n in held_here else 0.0 for n in names]
    summed = run.comm.all_reduce_values(flags, str(run.device), "load_checkpoint: the names some rank holds")
    return {n for n, v in zip(names, summed) if v}
