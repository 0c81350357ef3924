"""Whole-model weights from a ZeRO checkpoint, offline: DeepSpeed's deepspeed.utils.zero_to_fp32 API
and the `zeroshard-consolidate` command. The command streams one tensor at a time into safetensors
files, so its memory is the largest tensor plus a fixed amount, never the model; optimizer moments
are never read. Reads zeroshard checkpoints and DeepSpeed's (checkpoint/sources.py)."""
import argparse
import json
import math
import os
import re
import struct
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from zeroshard import _C
from zeroshard.checkpoint.layout import buffer_key, tensor_name
from zeroshard.checkpoint.sources import TORCH_DTYPES, is_checkpoint, open_source, tags_in
from zeroshard.checkpoint.sources import find_checkpoint as find_source
from zeroshard.checkpoint_import.deepspeed_pipe import is_deepspeed_pipeline_checkpoint
from zeroshard.dtypes import PRECISIONS

CK = _C.checkpoint

# torch dtype -> the safetensors header's name for it
_ST_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


# ----- finding the checkpoint ---------------------------------------------------------------------

def find_checkpoint(checkpoint_dir, tag=None):
    """The directory of checkpoint `tag` in save_dir `checkpoint_dir` (tag from its `latest` file when
    None). A tag directory itself is accepted too when no tag is given."""
    save_dir = os.fspath(checkpoint_dir)
    path, _ = find_source(save_dir, tag)
    if path is None:
        if is_checkpoint(save_dir):
            return save_dir
        raise FileNotFoundError(f"{save_dir}: no 'latest' file naming the checkpoint to consolidate; pass "
                                f"a tag (checkpoints there: {', '.join(tags_in(save_dir)) or 'none'})")
    if not is_checkpoint(path):
        listing = ", ".join(sorted(os.listdir(path))[:8]) or "nothing"
        raise FileNotFoundError(f"{path}: not a checkpoint: no {CK.MANIFEST} (zeroshard) and no "
                                f"*_model_states.pt (DeepSpeed); it holds {listing}")
    return path


# ----- what to write, and reading it --------------------------------------------------------------

@dataclass(frozen=True)
class Entry:
    """One output tensor: its name, the stored tensor it comes from, and its shape and dtypes."""
    name: str
    key: str
    shape: tuple
    stored_dtype: torch.dtype
    dtype: torch.dtype  # as written

    @property
    def numel(self):
        return math.prod(self.shape)

    @property
    def nbytes(self):
        return self.numel * self.dtype.itemsize


class Consolidated:
    """A checkpoint's model state as whole tensors of one floating dtype (integer and bool buffers
    keep theirs): `entries` lists them in the layout's order (parameters, buffers, tied aliases),
    without reading any data; read(entry) reads one."""

    def __init__(self, checkpoint_dir, tag=None, dtype="fp32", exclude_frozen_parameters=False):
        if dtype not in PRECISIONS:
            raise ValueError(f"dtype: got {dtype!r}, expected one of {', '.join(PRECISIONS)}")
        self.path = find_checkpoint(checkpoint_dir, tag)
        if is_deepspeed_pipeline_checkpoint(self.path):
            raise ValueError(f"{self.path}: a DeepSpeed pipeline checkpoint: its layer files do not say which "
                             "layers are tied or which parameters were frozen, so it is not consolidated; load "
                             "it into the model with load_checkpoint(..., load_optimizer_states=False), save, "
                             "and consolidate that checkpoint")
        self.source = open_source(self.path, verify_before_writing=False)  # scratch buffers
        layout = self.source.section("layout")
        if layout is None:
            raise ValueError(f"{self.path}: its manifest has no 'layout' section (written by a zeroshard older "
                             "than checkpoints, or not by zeroshard)")
        self.dtype = PRECISIONS[dtype]
        self._buffers = {}  # dtype -> flat tensor reused by read(reuse=True)
        self.entries = self._plan(layout, exclude_frozen_parameters)

    def _entry(self, name, key, shape, stored_dtype):
        out = self.dtype if stored_dtype.is_floating_point else stored_dtype
        return Entry(name, key, tuple(int(d) for d in shape), stored_dtype, out)

    def _plan(self, layout, exclude_frozen):
        model_dtype = PRECISIONS[layout["dtype"]]
        entries, by_name = [], {}
        for p in layout["params"]:
            name, trainable = p["name"], p["trainable"]
            if exclude_frozen and not trainable:
                continue
            master, param = tensor_name("master", name), tensor_name("param", name)
            if self.source.has(master):  # fp32 masters of a 16-bit run: the exact values
                entry = self._entry(name, master, p["shape"], torch.float32)
            elif self.source.has(param):
                entry = self._entry(name, param, p["shape"], model_dtype)
            elif not trainable and layout.get("frozen_excluded"):
                continue  # saved with exclude_frozen_parameters=True
            else:
                raise ValueError(f"{self.path}: parameter {name!r} is in the layout but neither {master!r} nor "
                                 f"{param!r} is stored; the checkpoint is incomplete")
            entries.append(entry)
            by_name[name] = entry
        for name in layout.get("buffers", []):
            key = buffer_key(name)
            if not self.source.has(key):
                raise ValueError(f"{self.path}: buffer {name!r} is in the layout but {key!r} is not stored")
            entries.append(self._entry(name, key, self.source.shape(key), self.source.dtype(key)))
            by_name[name] = entries[-1]
        for tied, name in layout.get("aliases", {}).items():
            if name in by_name:  # left out with it when it is frozen and excluded
                e = by_name[name]
                entries.append(Entry(tied, e.key, e.shape, e.stored_dtype, e.dtype))
        return entries

    @property
    def total_bytes(self):
        return sum(e.nbytes for e in self.entries)

    def read(self, entry, reuse=False):
        """The whole tensor, read straight into memory of its stored dtype, then cast if needed.
        reuse=True: a view into buffers kept for the next read (valid until then), so a stream of
        reads holds the largest tensor once per dtype and the allocator does not fragment."""
        stored = self._buffer(entry.stored_dtype, entry.numel, reuse).view(entry.shape)
        if entry.numel:
            self.source.read(entry.key, 0, stored.view(-1))
        if entry.dtype == entry.stored_dtype:
            return stored
        return self._buffer(entry.dtype, entry.numel, reuse).view(entry.shape).copy_(stored)

    def _buffer(self, dtype, numel, reuse):
        if not reuse:
            return torch.empty(numel, dtype=dtype)
        if dtype not in self._buffers:
            largest = max([e.numel for e in self.entries if dtype in (e.stored_dtype, e.dtype)] + [numel])
            self._buffers[dtype] = torch.empty(largest, dtype=dtype)
        return self._buffers[dtype][:numel]


# ----- DeepSpeed's API ----------------------------------------------------------------------------

def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """name -> fp32 CPU tensor for every parameter (from the fp32 masters where the run kept them),
    every buffer as saved (floating ones in fp32) and every tied name (the same tensor as the
    name it shares), in the checkpoint's layout order. checkpoint_dir is the save_dir; tag defaults
    to its `latest`. Holds the whole model: for a large one use convert_zero_checkpoint_to_fp32_state_dict."""
    c = Consolidated(checkpoint_dir, tag, "fp32", exclude_frozen_parameters)
    state_dict, read = OrderedDict(), {}
    for e in c.entries:
        if e.key not in read:
            read[e.key] = c.read(e)
        state_dict[e.name] = read[e.key]
    return state_dict


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Copies the checkpoint's fp32 weights into `model` moved to the CPU, one tensor at a time, and
    returns it (DeepSpeed loads with strict=False: names the model lacks are skipped, and both
    lists are reported). A shape that differs is a ValueError naming it."""
    model = model.cpu()
    targets = model.state_dict(keep_vars=True)
    c = Consolidated(checkpoint_dir, tag, "fp32")
    unexpected, loaded, filled = [], set(), set()
    with torch.no_grad():
        for e in c.entries:
            target = targets.get(e.name)
            if target is None:
                unexpected.append(e.name)
                continue
            if tuple(target.shape) != e.shape:
                raise ValueError(f"load_state_dict_from_zero_checkpoint: {e.name}: the checkpoint "
                                 f"({c.path}) has shape {list(e.shape)}, the model {list(target.shape)}")
            if id(target) not in filled:  # a tied weight is read once
                target.copy_(c.read(e, reuse=True))
                filled.add(id(target))
            loaded.add(e.name)
    missing = [n for n in targets if n not in loaded]
    if missing or unexpected:
        print(f"warning: load_state_dict_from_zero_checkpoint: {c.path}: not in the checkpoint: "
              f"{', '.join(missing[:8]) or 'none'}; not in the model (skipped): "
              f"{', '.join(unexpected[:8]) or 'none'}", file=sys.stderr)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=True, tag=None,
                                               exclude_frozen_parameters=False, dtype="fp32", progress=True):
    """Writes the consolidated weights into `output_dir` as safetensors: model.safetensors, or
    model-0000k-of-0000n.safetensors plus model.safetensors.index.json (Hugging Face's layout) when
    they exceed max_shard_size (bytes, or "5GB", "500MB", "2GiB"). Streams tensor by tensor.
    Returns the list of files written. DeepSpeed's argument order; safe_serialization must stay
    True, as zeroshard writes no pickles."""
    if not safe_serialization:
        raise ValueError("convert_zero_checkpoint_to_fp32_state_dict: safe_serialization=False asks for "
                         "pytorch_model.bin (a pickle); zeroshard writes safetensors only, which "
                         "torch, transformers and safetensors.torch.load_file read")
    shard_bytes = parse_size(max_shard_size)
    c = Consolidated(checkpoint_dir, tag, dtype, exclude_frozen_parameters)
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    shards = split_shards(c.entries, shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    bar = Progress(len(c.entries), c.total_bytes, enabled=progress)
    for name, entries in zip(names, shards):
        write_safetensors(os.path.join(output_dir, name), entries, lambda e: c.read(e, reuse=True), bar)
    bar.close()
    written = list(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": c.total_bytes},
                 "weight_map": {e.name: n for n, entries in zip(names, shards) for e in entries}}
        _write_atomically(os.path.join(output_dir, INDEX_FILE), json.dumps(index, indent=2).encode() + b"\n")
        written.append(INDEX_FILE)
    _remove_stale(output_dir, written)
    return [os.path.join(output_dir, n) for n in written]


# ----- safetensors output -------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size):
    """Bytes from an int or a string such as "5GB" (10**9) or "2GiB" (2**30), as Hugging Face reads them."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_RE.match(str(size))
        if not match:
            raise ValueError(f"max_shard_size: got {size!r}, expected bytes or a size such as 5GB, 500MB, 2GiB")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if value <= 0:
        raise ValueError(f"max_shard_size: got {size!r}, expected a positive size")
    return value


def split_shards(entries, max_shard_bytes):
    """Consecutive groups of at most max_shard_bytes each; a tensor larger than that gets a file of
    its own (as in Hugging Face's split_torch_state_dict_into_shards)."""
    shards, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def safetensors_header(entries):
    """The file's 8-byte length and JSON header (padded with spaces to 8 bytes, as safetensors does)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for e in entries:
        header[e.name] = {"dtype": _ST_NAMES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path, entries, read, progress):
    """Writes `entries` to `path` (via path.tmp, renamed when complete), reading one tensor at a time."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(safetensors_header(entries))
            for e in entries:
                t = read(e)
                if tuple(t.shape) != e.shape or t.dtype != e.dtype:
                    raise RuntimeError(f"{e.key}: read {tuple(t.shape)} {t.dtype}, expected {e.shape} {e.dtype}")
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
                progress.advance(e.nbytes)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_atomically(path, data):
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _remove_stale(output_dir, written):
    """Drops model files of an earlier run with another shard count, which loaders would mix in."""
    for name in os.listdir(output_dir):
        if name in written:
            continue
        if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE_RE.match(name):
            os.remove(os.path.join(output_dir, name))


def _human(num_bytes):
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{int(num_bytes)} B"


class Progress:
    """Tensors written and their bytes, as a tqdm bar on stderr (zeroshard/observe/bars.py: drawn
    where stderr is a terminal), closed with the time and rate."""

    def __init__(self, total_tensors, total_bytes, enabled=True):
        from zeroshard.observe.bars import bar
        self.total_tensors = total_tensors
        self.start = time.monotonic()
        self._bar = bar(total=total_bytes, desc=f"consolidating {total_tensors} tensors", unit="B") if enabled else None
        if self._bar is not None:
            self._bar.unit_scale = True

    def advance(self, nbytes):
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self):
        if self._bar is not None:
            self._bar.close()


# ----- the command --------------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser(
        prog="zeroshard-consolidate",
        description="Writes the whole model of a ZeRO checkpoint (zeroshard's or DeepSpeed's) as safetensors "
                    "files Hugging Face loaders read, one tensor at a time: memory stays at about the largest "
                    "tensor, and optimizer state is never read.")
    p.add_argument("checkpoint_dir", help="the save_dir passed to save_checkpoint (holds `latest` and the tags)")
    p.add_argument("output_dir", help="where model.safetensors (or its shards and index) go; created if needed")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one `latest` names)")
    p.add_argument("--dtype", choices=list(PRECISIONS), default="fp32",
                   help="floating-point dtype to write (default fp32; integer buffers keep theirs)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest file before the weights are split into shards (default 5GB; 2GiB, 500MB, bytes)")
    p.add_argument("--exclude-frozen-parameters", action="store_true",
                   help="leave out parameters with requires_grad=False")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        files = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters, dtype=args.dtype, progress=not args.quiet)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        print(f"zeroshard-consolidate: error: {e}", file=sys.stderr)
        return 1
    if not args.quiet:
        what = (os.path.basename(files[0]) if len(files) == 1
                else f"{len(files) - 1} shard files and {os.path.basename(files[-1])}")
        print(f"zeroshard-consolidate: wrote {what} to {args.output_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
