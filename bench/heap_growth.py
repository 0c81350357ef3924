"""Resident memory and malloc's heap over a plain ZeRO-3 run on bench/zero_step.py's ~100M GPT
(CPU, Gloo, one thread per rank): whether a run's memory stays level, and if it grows, whether
malloc's in-use bytes grow (a leak) or only its free bytes (fragmentation). Rank 0 prints every
10th step:

    python3 -m zeroshard.launcher.runner --num_gpus 1 bench/heap_growth.py [--steps 60]
    TORCH_FR_BUFFER_SIZE=2000 python3 -m zeroshard.launcher.runner --num_gpus 1 bench/heap_growth.py

(the second with torch's own flight recorder on, which zeroshard turns off on Gloo). Timings
printed are one process's; compare them across processes with care."""
import argparse
import ctypes
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (glibc >= 2.33)
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def _heap():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return m.uordblks, m.fordblks


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    import zeroshard
    from gpt import GPT, ByteWindows, stdlib_text_bytes
    from zero_step import _rss_now_bytes  # this directory: the script's, on sys.path
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 100000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3}}
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=128, d_model=768, n_layers=14, n_heads=12)
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank, world = engine.global_rank, engine.world_size
    data = ByteWindows(stdlib_text_bytes(), 128)
    ms = []
    if rank == 0:
        print(f"torch's flight recorder: TORCH_FR_BUFFER_SIZE={os.environ.get('TORCH_FR_BUFFER_SIZE')}")
        print("| step | resident MB | malloc in use MB | malloc free MB | median ms/step (last 10) |")
        print("|---|---|---|---|---|")
    for step in range(1, a.steps + 1):
        t = time.perf_counter()
        loss = engine(torch.stack([data[(step * world + rank) % len(data)]]))
        engine.backward(loss)
        engine.step()
        ms.append((time.perf_counter() - t) * 1e3)
        if step % 10 == 0 and rank == 0:
            used, free = _heap()
            print(f"| {step} | {_rss_now_bytes() / 1e6:.0f} | {used / 1e6:.0f} | {free / 1e6:.0f} "
                  f"| {statistics.median(ms[-10:]):.0f} |", flush=True)


if __name__ == "__main__":
    main()
