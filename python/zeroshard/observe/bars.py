"""Progress bars for long work, drawn by rank 0 with tqdm where the output is a terminal (tqdm's
disable=None: logs stay readable): checkpoint loading, consolidation, and what the C++ runtime
reports through its progress channel (the NVMe files written at start)."""
import os

from tqdm import tqdm

_OPEN = {}  # what -> the runtime's bar for it, until done


def _rank():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def bar(iterable=None, total=None, desc="", unit="it"):
    """`iterable` with a bar on rank 0; as it is elsewhere (also with no terminal)."""
    return tqdm(iterable, total=total, desc=f"[zeroshard] {desc}", unit=unit, leave=False,
                disable=None if _rank() == 0 else True)


def runtime_progress(what, done, total):
    """runtime/log.h's progress channel: `done` of `total` steps of `what`."""
    if _rank() != 0:
        return
    current = _OPEN.get(what)
    if current is None:
        current = _OPEN[what] = tqdm(total=total, desc=f"[zeroshard] {what}", leave=False, disable=None)
    current.update(done - current.n)
    if done >= total:
        current.close()
        del _OPEN[what]
