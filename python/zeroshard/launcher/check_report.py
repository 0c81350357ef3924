# `zeroshard check`'s judgements and its table: pure functions from what each host reported (the
# agent's probe, ssh's stderr) to one cell per (host, check), each failure with its reason.
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

COLUMNS = ("ssh", "versions", "devices", "memory", "nvme", "port", "backend")
VERSION_KEYS = ("python", "torch", "cuda", "zeroshard")
GIB = float(1 << 30)


@dataclass
class Cell:
    ok: bool | None          # None: not applicable, or not run because an earlier check failed
    text: str                # what the table shows
    reason: str = ""         # printed under the table, as "<host>: <check>: <reason>"


def passed(text: str) -> Cell:
    return Cell(True, text)


def failed(text: str, reason: str) -> Cell:
    return Cell(False, f"FAIL {text}".strip(), reason)


def not_run(reason: str = "") -> Cell:
    return Cell(None, "-", reason)


# ssh's own messages (OpenSSH), in the order they are looked for: (pattern, cell text, explanation).
SSH_FAILURES = [
    (r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED", "host key",
     "host key verification failed: the host's key is not in known_hosts or has changed "
     "(ssh-keyscan it into ~/.ssh/known_hosts, or fix the stale entry)"),
    (r"Too many authentication failures", "auth",
     "too many authentication failures: ssh offered more keys than the host's MaxAuthTries allows "
     "before the right one (an ssh-agent holding many keys? pass --launcher_args "
     '"-o IdentitiesOnly=yes -i <key>")'),
    (r"Permission denied", "auth",
     "permission denied: the host refused every key offered (passwordless ssh is needed: "
     "add this user's public key to the host's authorized_keys)"),
    (r"Could not resolve hostname|Name or service not known|Temporary failure in name resolution",
     "DNS", "could not resolve the host name (DNS or /etc/hosts)"),
    (r"Connection refused", "refused", "connection refused: no sshd listens on that address and port"),
    (r"timed out", "timeout", "connection timed out (host down, wrong address, or a firewall)"),
    (r"No route to host|Network is unreachable", "no route", "no route to the host"),
    (r"Connection closed|Connection reset|kex_exchange_identification", "closed",
     "the host closed the connection during the handshake (sshd's MaxStartups, AllowUsers, or a "
     "TCP wrapper?)"),
]


def classify_ssh_failure(stderr: str) -> tuple[str, str, str]:
    """(short kind, explanation, the line that tells) from ssh's whole stderr: the telling line is
    often not the last. Nothing matched: ("error", the last line, the last line)."""
    lines = [s.strip() for s in stderr.splitlines() if s.strip()]
    for pattern, kind, why in SSH_FAILURES:
        for line in lines:
            if re.search(pattern, line):
                return kind, why, line
    last = lines[-1] if lines else "ssh exited 255 without a message"
    return "error", last, last


def version_of(probe: dict, key: str) -> str:
    if key == "zeroshard" and "zeroshard_error" in probe:
        return "missing"
    if key in ("torch", "cuda") and "torch_error" in probe:
        return "missing"
    return str(probe.get(key, "unknown"))


def version_cells(probes: dict[str, dict]) -> tuple[dict[str, Cell], str]:
    """Each probed host's versions cell, and a summary line. The most common value of each is the
    reference (the earlier host wins a tie: rank 0's host first); a host that differs is named."""
    cells, refs = {}, {}
    for key in VERSION_KEYS:
        seen = Counter(version_of(p, key) for p in probes.values())
        first = {v: i for i, v in reversed(list(enumerate(version_of(p, key) for p in probes.values())))}
        refs[key] = max(seen, key=lambda v: (seen[v], -first[v])) if seen else "unknown"
    for host, probe in probes.items():
        problems, kinds = [], []
        for key in VERSION_KEYS:
            value = version_of(probe, key)
            if value != refs[key] or value == "missing":
                others = [h for h, p in probes.items() if version_of(p, key) == refs[key] and h != host]
                where = f" from {probe['zeroshard_path']}" \
                    if key == "zeroshard" and "zeroshard_path" in probe else ""
                if value == "missing":
                    what = probe.get("zeroshard_error" if key == "zeroshard" else "torch_error", "")
                    problems.append(f"{key} cannot be imported ({what})")
                else:
                    problems.append(f"{key} {value}{where}, but {refs[key]} on {', '.join(others)}")
                kinds.append(key)
        cells[host] = failed(",".join(kinds), "; ".join(problems)) if problems else passed("ok")
    summary = ", ".join(f"{k} {refs[k]}" for k in VERSION_KEYS)
    return cells, summary


def backend_of(probe: dict) -> str:
    return "nccl" if probe.get("gpus", 0) > 0 else "gloo"


def device_cell(probe: dict, slots: list[int]) -> Cell:
    """The hostfile's slots on this host are GPU ids 0..max on a GPU host, or CPU processes. A host
    with a GPU device node whose torch sees no GPU is broken, not CPU-only, unless
    CUDA_VISIBLE_DEVICES is set empty there on purpose."""
    if "torch_error" in probe:
        return not_run("torch cannot be imported")
    gpus = probe.get("gpus", 0)
    node = probe.get("gpu_device_node")
    if gpus == 0 and node and probe.get("cuda_visible_devices") != "":
        visible = probe.get("cuda_visible_devices")
        why = probe.get("cuda_error") or "torch.cuda.device_count() is 0"
        return failed("no gpu", f"{node} exists but torch sees no GPU ({why}; CUDA_VISIBLE_DEVICES "
                      f"{'unset' if visible is None else repr(visible)}): a CPU-only torch build or a "
                      "driver that does not match it? To run this host on CPU on purpose, export "
                      "CUDA_VISIBLE_DEVICES= (empty)")
    if gpus == 0:
        return passed(f"cpu x{len(slots)}")
    needed = max(slots) + 1
    if gpus < needed:
        return failed(f"{gpus}/{needed} gpu", f"the hostfile's slots {','.join(map(str, slots))} need "
                      f"{needed} GPUs, torch sees {gpus} (CUDA_VISIBLE_DEVICES, driver?)")
    return passed(f"gpu {len(slots)}/{gpus}")


# Printed under the table: what a cell that is neither a pass nor a failure means.
LEGEND = ("cells: ok = passed; FAIL = failed (the reason is below); - = not run (not applicable, or a "
          "check it needs failed; a note says which); not planned = the memory check was skipped (a "
          "note says why: no --num_params, or no torch for the planner): it neither passes nor fails")


def memory_cell(probe: dict, ranks_on_host: int, need_bytes: int | None, planner_error: str = "") -> Cell:
    """need_bytes: the planner's host memory for this host's ranks; None when it was not planned
    (the output's notes say why): a skip, which neither passes nor fails. planner_error: the
    planner itself failed, which fails the check."""
    if planner_error:
        return failed("planner", planner_error)
    if need_bytes is None:
        return Cell(None, "not planned")
    have = probe.get("mem_available_bytes", 0)
    text = f"{need_bytes / GIB:.1f}/{have / GIB:.1f} GiB"
    if need_bytes > have:
        ranks = f"{ranks_on_host} rank{'s' if ranks_on_host != 1 else ''}"
        return failed(text, f"the planned setup needs {need_bytes / GIB:.1f} GiB of host memory for "
                            f"{ranks}, MemAvailable is {have / GIB:.1f} GiB")
    return passed(f"ok {text}")


def nvme_cell(probe: dict, paths: dict[str, str]) -> Cell:
    if not paths:
        return not_run()
    problems = [f'{key} "{paths[key]}" {why}' for key, why in probe.get("nvme", {}).items() if why]
    if problems:
        return failed("", "; ".join(problems))
    return passed("ok")


def render(hosts: list[str], cells: dict[str, dict[str, Cell]]) -> str:
    """One row per host, one column per check; then every failure's reason, naming host and check."""
    rows = [["host", *COLUMNS]] + [[h, *(cells[h][c].text for c in COLUMNS)] for h in hosts]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    reasons = [f"{h}: {c}: {cells[h][c].reason}" for h in hosts for c in COLUMNS
               if cells[h][c].ok is False and cells[h][c].reason]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def failures(hosts: list[str], cells: dict[str, dict[str, Cell]]) -> list[str]:
    """'host (check, check)' for every host with a failed check."""
    out = []
    for h in hosts:
        bad = [c for c in COLUMNS if cells[h][c].ok is False]
        if bad:
            out.append(f"{h} ({', '.join(bad)})")
    return out
