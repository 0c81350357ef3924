"""The training DataLoader initialize() builds from training_data: each data-parallel rank reads
its own part of every epoch at the micro-batch size."""
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def make_dataloader(dataset, micro_batch_size, dp_world_size, dp_rank, collate_fn, drop_last):
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn,
                          drop_last=drop_last)
    sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=True)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn, drop_last=drop_last)
