"""ZeRO-3 with a frozen base (LoRA-style fine-tuning): the example GPT with every weight frozen
but the biases and the first LayerNorm, at world 2 on CPU/Gloo. Reports the median step time and
the most parameter elements gathered at once during backward, for

  release  frozen weights released once the autograd nodes that read them have run (the runtime)
  hold     every module gathered for backward held until backward ends (the rule before it; the
           script switches the node walk off, so no forward is tracked)

    python3 bench/zero3_frozen.py                      # d_model 256, 8 layers, 22 steps, twice
    python3 bench/zero3_frozen.py --prefetch 1000000000 --reuse 1000000000   # DeepSpeed defaults

This is an A/B of the runtime against its own earlier rule: no torch peer partitions a frozen
base the same way in one call (FSDP2's fully_shard does, but it was not run here).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

from zero3_single import _free_port  # noqa: E402


def worker(rank, a, mode, port, results):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import zeroshard
    import zeroshard.zero.hooks as hooks
    from gpt import GPT
    if mode == "hold":
        hooks._lowest_nodes_created = lambda tensors, start, end: None
    torch.manual_seed(0)
    model = GPT(d_model=a.d_model, n_layers=a.n_layers, seq_len=a.seq_len)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("blocks.0.ln1") or name.endswith(".bias"))
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": a.prefetch,
                                 "stage3_max_reuse_distance": a.reuse,
                                 "stage3_param_persistence_threshold": 1000}}
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg)
    times, peaks = [], []
    for step in range(a.steps):
        batch = torch.randint(0, 256, (a.micro, a.seq_len + 1),
                              generator=torch.Generator().manual_seed(2 * step + rank))
        t0 = time.perf_counter()
        loss = engine(batch)
        engine._core.gatherer.reset_gathered_peak()
        engine.backward(loss)
        peaks.append(engine._core.gatherer.peak_gathered_numel)
        engine.step()
        times.append(time.perf_counter() - t0)
    frozen = sum(p.numel() for p in GPT(d_model=a.d_model, n_layers=a.n_layers,
                                          seq_len=a.seq_len).parameters()) - sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    if rank == 0:
        times = sorted(times[2:])
        results.put((mode, times[len(times) // 2], max(peaks), frozen))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--prefetch", type=int, default=500000)
    ap.add_argument("--reuse", type=int, default=500000)
    ap.add_argument("--rounds", type=int, default=2, help="release/hold pairs, alternated")
    a = ap.parse_args()
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    print("mode     step_s  backward_peak_gathered  frozen_elements", flush=True)
    for _ in range(a.rounds):
        for mode in ("release", "hold"):
            results = ctx.Queue()
            port = _free_port()
            procs = [ctx.Process(target=worker, args=(r, a, mode, port, results)) for r in range(2)]
            for p in procs:
                p.start()
            got = results.get(timeout=900)
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    sys.exit(f"a rank of the {mode} run exited with {p.exitcode}")
            print(f"{got[0]:8s} {got[1]:.4f}  {got[2]:22d}  {got[3]:15d}", flush=True)


if __name__ == "__main__":
    main()
