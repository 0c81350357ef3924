# Which accelerator slots this machine has: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`, else none
# (then slots are plain CPU processes and the engine uses Gloo).
from __future__ import annotations

import os
import subprocess
from typing import Mapping


def local_gpu_ids(environ: Mapping[str, str] = os.environ) -> list[int] | None:
    """GPU ids usable here, or None when there are no GPUs."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if not ids or ids[0] == "-1":
            return None
        if all(v.isdigit() for v in ids):
            return [int(v) for v in ids]
        return list(range(len(ids)))  # UUIDs / MIG names: count them, keep the user's variable
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return list(range(count)) if out.returncode == 0 and count else None
