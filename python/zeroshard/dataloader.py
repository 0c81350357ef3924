"""The training DataLoader initialize() builds from training_data: each data-parallel rank reads
its own part of every epoch at the micro-batch size, shuffled as DeepSpeed's engine reads it, or
in order as its PipelineEngine does (shuffle=False)."""
import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def make_dataloader(dataset, micro_batch_size, dp_world_size, dp_rank, collate_fn, drop_last, shuffle=True):
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return DataLoader(dataset, batch_size=micro_batch_size, collate_fn=collate_fn,
                          drop_last=drop_last)
    sampler = DistributedSampler(dataset, num_replicas=dp_world_size, rank=dp_rank, shuffle=shuffle)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler,
                      collate_fn=collate_fn, drop_last=drop_last)


class RepeatingLoader:
    """DeepSpeed's RepeatingLoader: iterates `loader` over and over, starting it again when an
    epoch ends. A source whose epoch yields nothing is an error, not an endless loop."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)
        self._yielded = False  # in the epoch under way

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            started_again, self._yielded = self._yielded, False
            try:
                batch = next(self.data_iter)
            except StopIteration:
                if not started_again:
                    why = "yields no batch"
                elif iter(self.loader) is self.loader:
                    why = "cannot be started again (an iterator, not a loader): pass the DataLoader or list itself"
                else:
                    why = "yielded nothing when started again (a source that can be read once?)"
                raise ValueError(f"RepeatingLoader: the {type(self.loader).__name__} it repeats {why}") from None
        self._yielded = True
        return batch
