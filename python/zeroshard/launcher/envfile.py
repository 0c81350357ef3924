# What environment reaches every node: prefixed variables of the launcher's own environment plus the
# KEY=VAL lines of .zeroshard_env / .deepspeed_env in the home and working directories.
from __future__ import annotations

import os
import re

EXPORT_PREFIXES = ("NCCL", "PYTHON", "UCX", "GLOO", "OMP")
ENV_FILE_NAMES = (".deepspeed_env", ".zeroshard_env")  # later files override earlier ones
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """A malformed env-file line; the message names the file, the line and its text."""


def parse_env_text(text: str, path: str) -> dict[str, str]:
    """KEY=VAL per line; `#` comment lines, blank lines and a leading `export ` are allowed.
    The value is everything after the first `=` (no inline comments: values may hold `#`)."""
    out: dict[str, str] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        body = line[len("export "):].lstrip() if line.startswith("export ") else line
        key, sep, value = body.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            raise EnvFileError(f'{path} line {line_no}: "{line}": expected KEY=VALUE')
        out[key] = value
    return out


def env_file_paths(home: str, cwd: str) -> list[str]:
    paths = []
    for folder in dict.fromkeys([os.path.abspath(home), os.path.abspath(cwd)]):
        for name in ENV_FILE_NAMES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                paths.append(path)
    return paths


def collect_exports(environ: dict[str, str], cwd: str, home: str | None = None) -> dict[str, str]:
    """The variables set on every rank of every node, in a stable order."""
    exports = {k: v for k, v in environ.items() if k.startswith(EXPORT_PREFIXES)}
    home = home if home is not None else os.path.expanduser("~")
    for path in env_file_paths(home, cwd):
        with open(path, encoding="utf-8") as f:
            exports.update(parse_env_text(f.read(), path))
    # As DeepSpeed: the launch directory goes first on every node's import path.
    old = exports.get("PYTHONPATH", "")
    exports["PYTHONPATH"] = cwd + (os.pathsep + old if old else "")
    return exports
