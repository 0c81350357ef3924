# Process plumbing shared by the runner and the per-node spawner: ending whole process trees,
# describing exit statuses, and copying child output line by line with a prefix.
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import BinaryIO, Callable, Iterable

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of our children are re-parented to us instead of init, so we can end them.
    Linux only; returns False where unavailable (process groups still cover the usual case)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _ppid_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: parse after its last ')'.
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def descendants(pids: Iterable[int]) -> list[int]:
    """Every live descendant of `pids` (not including them), found through /proc."""
    tree = _ppid_map()
    out, todo = [], list(pids)
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_tree(pid: int, sig: int) -> None:
    """Signal `pid`'s process group (it leads one: started with start_new_session) and every
    descendant that left it."""
    targets = descendants([pid])
    for send, target in [(os.killpg, pid)] + [(os.kill, p) for p in targets]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def exit_status(returncode: int) -> int:
    """A shell-style exit status: a child killed by signal N counts as 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"exit code {128 - returncode} (killed by {name})"
    return f"exit code {returncode}"


_locks: dict[int, threading.Lock] = {}  # one per destination stream: lines never interleave


def write_line(dst: BinaryIO, text: str) -> None:
    try:
        with _locks.setdefault(id(dst), threading.Lock()):
            dst.write(text.encode(errors="replace") + b"\n")
            dst.flush()
    except (BrokenPipeError, OSError):
        pass


def relay_lines(src: BinaryIO, dst: BinaryIO, prefix: bytes,
                on_line: Callable[[bytes], None] | None = None,
                on_broken: Callable[[], None] | None = None) -> threading.Thread:
    """Copy `src` to `dst` line by line, each line prefixed; runs in a daemon thread until EOF."""
    lock = _locks.setdefault(id(dst), threading.Lock())

    def pump() -> None:
        broken = False
        for line in iter(src.readline, b""):
            if on_line is not None:
                on_line(line)
            if broken:
                continue  # keep draining so the child never blocks on a full pipe
            if not line.endswith(b"\n"):
                line += b"\n"
            try:
                with lock:
                    dst.write(prefix + line)
                    dst.flush()
            except (BrokenPipeError, OSError):
                broken = True
                if on_broken is not None:
                    on_broken()
        src.close()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


