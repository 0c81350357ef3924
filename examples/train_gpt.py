"""Trains the small GPT on the standard library's source with the DeepSpeed-style loop:
    zeroshard --num_gpus 2 examples/train_gpt.py --deepspeed_config configs/demo_zero.json
Each rank prints its throughput and model-state memory at the end."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zeroshard  # noqa: E402  (DeepSpeed scripts: `import zeroshard as deepspeed`)
from gpt import GPT, ByteWindows, num_params, stdlib_text_bytes  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=0)
    zeroshard.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(1234)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    model = GPT(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers)
    n_params = num_params(model)  # counted now: ZeRO-3 leaves each rank only its chunks
    data = ByteWindows(stdlib_text_bytes(), args.seq_len)
    engine, _, loader, _ = zeroshard.initialize(args=args, model=model,
                                                model_parameters=model.parameters(),
                                                training_data=data)
    rank = engine.global_rank
    if rank == 0:
        print(f"GPT with {n_params / 1e6:.2f}M parameters, {len(data)} windows of "
              f"{args.seq_len + 1} bytes of standard-library source", flush=True)

    first_loss = last_loss = None
    t0 = time.perf_counter()
    micro_steps = 0
    step_target = args.steps * engine.gradient_accumulation_steps()
    while micro_steps < step_target:
        for batch in loader:
            loss = engine(batch.to(engine.device))
            engine.backward(loss)
            engine.step()
            micro_steps += 1
            value = float(loss.detach())
            first_loss = value if first_loss is None else first_loss
            last_loss = value
            if micro_steps >= step_target:
                break
    elapsed = time.perf_counter() - t0
    samples = engine.global_steps * engine.train_batch_size()
    mem = engine.memory_bytes()
    # The launcher prefixes every line with its rank.
    print(f"done: {engine.global_steps} steps, loss {first_loss:.3f} -> "
          f"{last_loss:.3f}, {samples / elapsed:.1f} samples/s ({elapsed:.1f} s), model state: "
          + " ".join(f"{k}={v / 1e6:.2f}MB" for k, v in mem.items() if v or k != "gathered_parameters"),
          flush=True)


if __name__ == "__main__":
    main()
