"""A small GPT (pre-norm decoder, tied input/output embedding) for the demo and the tests, and the
text it trains on: the Python standard library's own source, which every Python install ships."""
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        # No bias: the key bias gets no gradient (softmax is shift-invariant), only rounding noise.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab_size=256, seq_len=128, d_model=128, n_layers=4, n_heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embedding
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, batch):
        """batch: (B, T+1) token ids; returns the mean next-token cross-entropy."""
        x, y = batch[:, :-1], batch[:, 1:]
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(pos)
        for blk in self.blocks:
            h = blk(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def stdlib_text_bytes(max_bytes=8_000_000) -> bytes:
    """The standard library's .py sources, concatenated in a fixed order (same on every rank)."""
    root = os.path.dirname(os.__file__)
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                out.append(data)
                total += len(data)
                if total >= max_bytes:
                    return b"".join(out)
    return b"".join(out)


class ByteWindows(torch.utils.data.Dataset):
    """Fixed windows of seq_len+1 bytes over the text (byte-level tokens, vocabulary 256)."""

    def __init__(self, data: bytes, seq_len: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        return self.data[s:s + self.seq_len + 1]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))
