"""Small models and deterministic data shared by the distributed tests."""
import torch
import torch.nn as nn

from gpt import GPT

VOCAB, SEQ = 32, 8


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2)


class AwkwardMLP(nn.Module):
    """Frozen layer, a parameter that gets no gradient, a layer used twice, odd sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(7, 13)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(13, 13)
        self.unused = nn.Linear(5, 5)
        self.out = nn.Linear(13, 3)

    def forward(self, batch):
        x, y = batch[:, :7], batch[:, 7:10]
        h = torch.tanh(self.frozen(x))
        h = torch.tanh(self.hidden(torch.tanh(self.hidden(h))))
        return ((self.out(h) - y) ** 2).mean()


def wide_gpt():
    """tiny_gpt with d_model 64: its matrices' chunks span several 4 KiB pages at world 1 and 2, so
    chunks that go to NVMe really give their memory back (parameters on NVMe, test_nvme_*.py)."""
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=64, n_layers=2, n_heads=2)


MODELS = {"gpt": tiny_gpt, "gpt-wide": wide_gpt, "awkward": AwkwardMLP}


def global_batch(model_name, step, size):
    g = torch.Generator().manual_seed(1000 + step)
    if model_name.startswith("gpt"):
        return torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
    return torch.randn(size, 10, generator=g)
