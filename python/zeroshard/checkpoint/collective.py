"""The few agreements a save or load needs across ranks, on the engine's communicator (so a dead
rank is reported by name, as for every other collective): which ranks failed a phase, and rank 0's
text (the temporary directory's name)."""
import zlib

import torch

_TEXT_LEN = 256


def failed_ranks(run, ok: bool, what: str):
    """Every rank says whether its part of `what` succeeded; returns the ranks that failed."""
    if run.world == 1:
        return [] if ok else [0]
    flags = [0.0] * run.world
    flags[run.rank] = 0.0 if ok else 1.0
    summed = run.comm.all_reduce_values(flags, str(run.device), what)
    return [r for r, v in enumerate(summed) if v != 0.0]


def broadcast_text(run, text: str, what: str) -> str:
    """Rank 0's `text` (at most 256 bytes of UTF-8) on every rank."""
    if run.world == 1:
        return text
    data = text.encode() if run.rank == 0 else b""
    if len(data) > _TEXT_LEN:
        raise ValueError(f"{what}: {text!r} is longer than {_TEXT_LEN} bytes")
    values = [float(b) for b in data] + [0.0] * (_TEXT_LEN - len(data))
    summed = run.comm.all_reduce_values(values, str(run.device), what)
    return bytes(int(v) for v in summed).rstrip(b"\0").decode()


def same_on_every_rank(run, text: str, what: str) -> bool:
    """Whether every rank passed the same `text` (compared by CRC32)."""
    if run.world == 1:
        return True
    h = float(zlib.crc32(text.encode()))
    both = torch.tensor([h, -h], dtype=torch.float64, device=run.device)
    run.comm.all_reduce_max(both, what)  # max == min on every rank exactly when all are equal
    return float(both[0]) == -float(both[1])
