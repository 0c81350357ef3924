# A 2+-rank torch.distributed (gloo) training run for launcher tests: env:// init, an all_reduce,
# a few DDP steps, and a check that every rank ends with the same parameters.
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, required=True)
p.add_argument("--steps", type=int, default=5)
p.add_argument("--out_dir", default=None)
p.add_argument("--hang", action="store_true", help="after training, loop on barriers until killed")
args, extra = p.parse_known_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
assert rank == int(os.environ["CROSS_RANK"]) * int(os.environ["LOCAL_SIZE"]) + args.local_rank
dist.init_process_group("gloo", init_method="env://")
assert dist.get_rank() == rank and dist.get_world_size() == world

t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
for step in range(args.steps):
    x = torch.randn(16, 8, generator=gen)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
flat = torch.cat([q.detach().flatten() for q in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
assert all(torch.equal(g, flat) for g in gathered), "ranks diverged"
print(f"rank {rank}/{world} trained {args.steps} steps, loss {loss.item():.4f}, extra={extra}", flush=True)
if args.out_dir:
    # Written aside and renamed: the tests poll this directory and must never read half a record.
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "extra": extra, "cwd": os.getcwd(), "env": {
            k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_SIZE",
                                           "CROSS_RANK", "CROSS_SIZE", "GLOO_SOCKET_IFNAME",
                                           "ZS_FROM_ENV_FILE")}}, f)
    os.replace(path + ".tmp", path)
if args.hang:
    while True:
        dist.barrier()
        time.sleep(0.2)
dist.barrier()  # nobody tears down while a peer still talks to rank 0's store
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown: gloo threads racing static destructors can abort()
