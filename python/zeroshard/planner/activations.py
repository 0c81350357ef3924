"""Activation memory of a decoder: the bytes autograd keeps for backward, per micro-batch, with and
without activation checkpointing. Counted tensor by tensor for fused kernels (flash attention,
whose output is laid out for the projection; a norm keeps its input and per-token statistics),
and checked against torch's own saved tensors for examples/gpt.py
(tests/python/test_plan_activations.py)."""
from dataclasses import dataclass

from zeroshard.planner.model import Decoder

INDEX_BYTES = 8     # token ids and targets are int64
STAT_BYTES = 4      # norm statistics and attention's logsumexp are fp32 on GPUs


@dataclass(frozen=True)
class Activations:
    """Bytes kept for backward by one micro-batch on one rank."""
    per_layer: int      # one decoder layer, its input included
    layer_input: int    # one layer's input: what a checkpointed layer keeps
    embedding: int      # token and position ids
    head: int           # final norm, output projection input, fp32 log-softmax, targets
    layers: int

    def peak(self, checkpointing: bool, layers: int | None = None, with_embedding=True, with_head=True) -> int:
        """The most held at once over forward and backward, for `layers` of them (a pipeline
        stage's), with or without the embedding and the head (the first and last stages').
        Without checkpointing that is the end of forward. With every layer checkpointed it is
        the end of forward (layer inputs and the head) or the backward of the last layer (layer
        inputs, the head freed, one layer recomputed, its input shared with its checkpoint)."""
        n = self.layers if layers is None else layers
        base = self.embedding if with_embedding else 0
        head = self.head if with_head else 0
        if not checkpointing:
            return base + n * self.per_layer + head
        inputs = n * self.layer_input
        recompute = self.per_layer - self.layer_input if n else 0
        return base + inputs + max(head, recompute)


def decoder_activations(dec: Decoder, micro_batch: int, seq_len: int, dtype_bytes: int) -> Activations:
    """What dec keeps per micro-batch of `micro_batch` sequences of `seq_len` tokens."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"activations: micro_batch {micro_batch} and seq_len {seq_len} must be positive")
    tokens = micro_batch * seq_len
    H, I = dec.hidden, dec.mlp
    kv = dec.kv * (H // dec.heads)
    lse = STAT_BYTES * dec.heads * tokens  # flash attention's logsumexp, per head and token
    if dec.arch == "gpt":
        # x, ln1 out, q k v (one qkv output), attention out (the projection's input: the same
        # storage), x + attention, ln2 out, fc out, gelu out; LayerNorm keeps mean and rstd.
        elements = 8 * H + 2 * I
        stats = 2 * 2 * STAT_BYTES * tokens
        positions = INDEX_BYTES * seq_len
        final_stats = 2 * STAT_BYTES * tokens
    else:
        # x, norm out, rotated q and k, v, attention out, x + attention, norm out, gate, up,
        # silu(gate), silu * up; RMSNorm keeps rstd.
        elements = 6 * H + 2 * kv + 4 * I
        stats = 2 * STAT_BYTES * tokens
        positions = 0
        final_stats = STAT_BYTES * tokens
    per_layer = tokens * elements * dtype_bytes + stats + lse
    layer_input = tokens * H * dtype_bytes
    embedding = INDEX_BYTES * tokens + positions
    # Final norm's input and statistics, the output projection's input, the log-softmax kept in
    # fp32 by cross-entropy (the logits themselves are not kept), the targets.
    head = 2 * tokens * H * dtype_bytes + final_stats + 4 * tokens * dec.vocab + INDEX_BYTES * tokens
    return Activations(per_layer, layer_input, embedding, head, dec.layers)
