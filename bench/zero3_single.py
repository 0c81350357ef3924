"""ZeRO-3 in one process (issue 3's single-GPU run): the example GPT trained with bf16 at stage 3,
its model-state bytes predicted from the formula, as the runtime accounts them, and as the device
allocator measured them.

    python3 bench/zero3_single.py                                  # GPT of about 300M, 5 steps
    python3 bench/zero3_single.py --d-model 64 --n-layers 2 --steps 2   # the test's size

On a GPU the process is a world of one on NCCL and the measured column is torch.cuda's
allocator statistics (memory_allocated after the step, max_memory_allocated over the steps). On
CPU it is a world of one on Gloo and only the prediction and the runtime's accounting are shown
(the test suite runs it that way, so the script cannot rot while no GPU is lent).

Prediction, per rank, world N, P/N = this rank's chunk elements (ceil per tensor), persistent =
the whole tensors under stage3_param_persistence_threshold:
  at rest after a step   14 P/N bytes (bf16 parameter chunks 2, fp32 master 4, Adam moments 8)
                         + 2 x persistent (kept whole) + the gradient staging buffers
  peak of model state    the same + 2 P/N (the bf16 gradient shard, from backward to the step)
                         + 2 x the most parameter elements gathered at once
The staging bytes and the most elements gathered at once are read from the runtime (they depend
on the bucket plan and the fetch order); the formula predicts the rest. The measured peak also
holds activations and autograd's temporaries; the difference is shown.
"""
import argparse
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(a):
    import torch
    import zeroshard
    from gpt import GPT, ByteWindows, stdlib_text_bytes

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    zeroshard.init_distributed()
    torch.manual_seed(1234)
    model = GPT(vocab_size=256, seq_len=a.seq_len, d_model=a.d_model, n_layers=a.n_layers,
                n_heads=a.n_heads)
    numels = [p.numel() for p in model.parameters()]
    config = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1,
              "steps_per_print": 10 ** 9, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0,
                                    "stage3_prefetch_bucket_size": a.prefetch,
                                    "stage3_param_persistence_threshold": a.persistence}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    world = engine.world_size
    cuda = engine.device.type == "cuda"
    data = ByteWindows(stdlib_text_bytes(), a.seq_len)

    def batch(step):
        first = step * a.micro
        return torch.stack([data[(first + i) % len(data)] for i in range(a.micro)]).to(engine.device)

    def one_step(step):
        loss = engine(batch(step))
        engine.backward(loss)
        engine.step()
        return loss.item()

    losses = [one_step(0)]  # the first step creates the optimizer state and records the fetch order
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    engine._core.gatherer.reset_gathered_peak()
    engine._core.memory.reset_peaks()
    times = []
    for step in range(1, a.steps):
        t = time.perf_counter()
        losses.append(one_step(step))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)

    shard = sum((n + world - 1) // world for n in numels)
    persistent = sum(n for n in numels if n < a.persistence)
    accounted = engine.memory_bytes()
    staging = accounted["comm_buffers"]
    peaks = engine._core.memory.peak_bytes()
    gathered_peak = 2 * engine._core.gatherer.peak_gathered_numel
    predicted_rest = 14 * shard + 2 * persistent + staging
    predicted_peak = 16 * shard + 2 * persistent + staging + gathered_peak
    rows = [("at rest after a step", predicted_rest, sum(accounted.values()),
             torch.cuda.memory_allocated() if cuda else None),
            ("peak (accounting: the sum of each category's peak)", predicted_peak,
             sum(peaks.values()),
             torch.cuda.max_memory_allocated() if cuda else None)]
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": world,
              "param_elements": sum(numels),
              "shard_elements": shard, "persistent_elements": persistent,
              "gathered_peak_bytes": gathered_peak, "staging_bytes": staging,
              "accounted_bytes": accounted, "accounted_peak_bytes": peaks,
              "rows": [{"what": w, "predicted": p, "accounted": acc, "measured": m}
                       for w, p, acc, m in rows],
              "ms_per_step": [round(t * 1e3, 1) for t in times], "loss": losses}
    mb = lambda x: "n/a (CPU)" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    print(f"ZeRO-3, bf16, world {world} on {result['device']}: GPT {sum(numels) / 1e6:.1f}M "
          f"parameters (d_model {a.d_model}, {a.n_layers} layers), micro-batch {a.micro} x "
          f"{a.seq_len} tokens; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if times:
        print(f"ms/step over {len(times)} timed steps: median {sorted(times)[len(times) // 2] * 1e3:.1f}")
    print("| | predicted MiB | runtime accounting MiB | measured MiB | measured - predicted MiB |")
    print("|---|---|---|---|---|")
    for w, p, acc, m in rows:
        diff = "n/a" if m is None else f"{(m - p) / 2**20:.1f}"
        print(f"| {w} | {mb(p)} | {mb(acc)} | {mb(m)} | {diff} |")
    print("(the peak's difference is activations, autograd's gradients before they are handed "
          "over, and temporaries)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", dest="d_model", type=int, default=1024)
    p.add_argument("--n-layers", dest="n_layers", type=int, default=24)
    p.add_argument("--n-heads", dest="n_heads", type=int, default=16)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=512)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="the first one untimed")
    p.add_argument("--prefetch", type=int, default=20_000_000,
                   help="stage3_prefetch_bucket_size (default: about 1.5 blocks of the default model)")
    p.add_argument("--persistence", type=int, default=100_000,
                   help="stage3_param_persistence_threshold (DeepSpeed's default 1e5)")
    p.add_argument("--json", help="also write the figures here")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
