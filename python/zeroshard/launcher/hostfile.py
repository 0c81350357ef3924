# Hostfiles (`<host> slots=<n>`) and the --include / --exclude / --num_nodes / --num_gpus selection.
# A resource map is a dict {host: [slot, ...]} whose insertion order is the rank order.
from __future__ import annotations

import re

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")
# Host names reach ssh's argv and pdsh's comma list: refuse anything that could read as an option
# or a separator there (quoting makes them harmless in a shell; this keeps them harmless everywhere).
_HOST = re.compile(r"^[A-Za-z0-9_.:%\[\]@][A-Za-z0-9_.:%\[\]@-]*$")
_HOST_CHARS = "letters, digits and . _ - : % @ [ ] (not starting with -)"


class HostfileError(ValueError):
    """A hostfile or a selection flag is malformed; the message names the file, line and text."""


def check_host_name(host: str, where: str) -> None:
    if not _HOST.match(host):
        raise HostfileError(f'{where}: host name "{host}" may hold only {_HOST_CHARS}')


def parse_hostfile_text(text: str, path: str = "hostfile") -> dict[str, int]:
    """Parse hostfile text into {host: slot_count}, keeping the file's order."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path} line {line_no}"
        m = _LINE.match(line.split("#", 1)[0].rstrip())
        if not m:
            raise HostfileError(f'{where}: "{line}": expected "<host> slots=<n>"')
        host, slots = m.group(1), int(m.group(2))
        check_host_name(host, where)
        if slots < 1:
            raise HostfileError(f'{where}: "{line}": slots must be at least 1')
        if host in hosts:
            raise HostfileError(
                f'{where}: "{line}": host "{host}" is already listed on line {first_line[host]}')
        hosts[host] = slots
        first_line[host] = line_no
    if not hosts:
        raise HostfileError(f"{path}: no hosts: expected lines of the form \"<host> slots=<n>\"")
    return hosts


def parse_hostfile(path: str) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        return parse_hostfile_text(f.read(), path)


def parse_node_specs(spec: str, flag: str) -> dict[str, list[int] | None]:
    """`worker-0@worker-1:0,2` -> {"worker-0": None, "worker-1": [0, 2]} (None: every slot)."""
    out: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        part = part.strip()
        host, sep, slot_text = part.partition(":")
        if not host or (sep and not slot_text):
            raise HostfileError(f'{flag} "{spec}": bad node spec "{part}": '
                                'expected NAME or NAME:SLOT[,SLOT...], joined by @')
        slots = None
        if sep:
            try:
                slots = [int(s) for s in slot_text.split(",")]
            except ValueError:
                raise HostfileError(f'{flag} "{spec}": bad slot list "{slot_text}" for host "{host}": '
                                    'expected integers joined by ,') from None
        if host in out and (out[host] is None or slots is None):
            out[host] = None
        elif host in out:
            out[host] = sorted(set(out[host]) | set(slots))
        else:
            out[host] = slots
    return out


def _check_known(pool: dict[str, list[int]], host: str, slots: list[int] | None, flag: str) -> None:
    if host not in pool:
        raise HostfileError(f'{flag}: host "{host}" is not in the hostfile (hosts: {", ".join(pool)})')
    for s in slots or []:
        if s not in pool[host]:
            raise HostfileError(f'{flag}: host "{host}" has no slot {s} '
                                f'(slots: {",".join(map(str, pool[host]))})')


def select_resources(pool: dict[str, int] | dict[str, list[int]], include: str = "",
                     exclude: str = "", num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """Apply DeepSpeed's selection flags to a hostfile pool; returns {host: [slots]} in rank order."""
    full = {h: (list(range(s)) if isinstance(s, int) else list(s)) for h, s in pool.items()}
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise HostfileError("--num_nodes/--num_gpus cannot be combined with --include/--exclude")
    if include:
        chosen = parse_node_specs(include, "--include")
        for host, slots in chosen.items():
            _check_known(full, host, slots, "--include")
        active = {h: (full[h] if chosen[h] is None else [s for s in full[h] if s in chosen[h]])
                  for h in full if h in chosen}
    elif exclude:
        dropped = parse_node_specs(exclude, "--exclude")
        for host, slots in dropped.items():
            _check_known(full, host, slots, "--exclude")
        active = {}
        for h, slots in full.items():
            if h in dropped:
                slots = [] if dropped[h] is None else [s for s in slots if s not in dropped[h]]
            if slots:
                active[h] = slots
    else:
        active = dict(full)
    if num_nodes > 0:
        if num_nodes > len(active):
            raise HostfileError(f"--num_nodes {num_nodes}: only {len(active)} hosts available "
                                f"({', '.join(active)})")
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        # As DeepSpeed: slots 0..N-1 on every host. On CPU hosts this is simply N processes per host.
        active = {h: list(range(num_gpus)) for h in active}
    if not active:
        raise HostfileError("no slots left after --include/--exclude")
    return active
