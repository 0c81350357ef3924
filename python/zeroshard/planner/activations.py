"""Activation memory of a decoder: the bytes autograd keeps for backward, per micro-batch, with and
without activation checkpointing. Counted tensor by tensor as examples/gpt.py (GPT) and Hugging
Face's LlamaForCausalLM with SDPA attention (Llama) keep them, and checked against torch's own saved
tensors for both (tests/python/test_plan_activations.py)."""
from dataclasses import dataclass

from zeroshard.planner.model import Decoder

INDEX_BYTES = 8     # token ids and targets are int64
STAT_BYTES = 4      # norm statistics and attention's logsumexp are fp32 on GPUs


@dataclass(frozen=True)
class Activations:
    """Bytes kept for backward by one micro-batch on one rank."""
    per_layer: int          # one decoder layer, its input included where the layer keeps it
    layer_input: int        # one layer's input: what a checkpointed layer keeps
    input_in_layer: int     # the part of per_layer that is the input's own storage (shared with its checkpoint)
    embedding: int          # token ids, and GPT's position ids or Llama's RoPE tables
    head: int               # final norm, output projection input, fp32 log-softmax, targets
    layers: int

    def peak(self, checkpointing: bool, layers: int | None = None, with_embedding=True, with_head=True) -> int:
        """The most held at once over forward and backward, for `layers` of them (a pipeline
        stage's), with or without the embedding and the head (the first and last stages').
        Without checkpointing that is the end of forward. With every layer checkpointed it is
        the end of forward (layer inputs and the head) or the backward of the last layer (layer
        inputs, the head freed, one layer recomputed, any of it that is the input's own storage
        shared with its checkpoint)."""
        n = self.layers if layers is None else layers
        base = self.embedding if with_embedding else 0
        head = self.head if with_head else 0
        if not checkpointing:
            return base + n * self.per_layer + head
        inputs = n * self.layer_input
        recompute = self.per_layer - self.input_in_layer if n else 0
        return base + inputs + max(head, recompute)


def decoder_activations(dec: Decoder, micro_batch: int, seq_len: int, dtype_bytes: int) -> Activations:
    """What dec keeps per micro-batch of `micro_batch` sequences of `seq_len` tokens."""
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"activations: micro_batch {micro_batch} and seq_len {seq_len} must be positive")
    tokens = micro_batch * seq_len
    H, I = dec.hidden, dec.mlp
    head_dim = H // dec.heads
    kv = dec.kv * head_dim
    lse = STAT_BYTES * dec.heads * tokens  # flash attention's logsumexp, per head and token
    layer_input = tokens * H * dtype_bytes
    if dec.arch == "gpt":
        # x, ln1 out, q k v (one qkv output), attention out (the projection's input: the same
        # storage), x + attention, ln2 out, fc out, gelu out; LayerNorm keeps mean and rstd.
        per_layer = tokens * (8 * H + 2 * I) * dtype_bytes + 2 * 2 * STAT_BYTES * tokens + lse
        input_in_layer = layer_input  # ln1 keeps x itself
        embedding = INDEX_BYTES * tokens + INDEX_BYTES * seq_len  # token and position ids
        # Final LayerNorm's input, mean and rstd, and its output (the output projection's input).
        final_norm = tokens * (2 * H * dtype_bytes + 2 * STAT_BYTES)
    else:
        # Hugging Face's LlamaRMSNorm is unfused: it upcasts its input to fp32 and keeps that
        # (x.pow(2) and x * rstd need it), rstd (fp32), the normalized x cast back to the model
        # dtype (the weight's multiply needs it) and its output (the next projection's input).
        # In fp32 the upcast is a no-op, so the first norm's fp32 input is the layer input itself;
        # in 16-bit it is a copy and the 16-bit input is not kept at all.
        norm = 4 * H + STAT_BYTES + 2 * H * dtype_bytes
        # Attention keeps q and k after RoPE, v (SDPA's inputs; with no padding mask GQA stays at
        # kv_heads, no repeat_kv), its output (also o_proj's input) and logsumexp. q and k before
        # RoPE are not kept: cos and sin need no gradient, so q * cos keeps only cos.
        attention = (2 * H + 2 * kv) * dtype_bytes
        # SwiGLU: gate_proj's output (SiLU's input), SiLU's output and up_proj's output (the
        # product keeps both) and the product (down_proj's input).
        mlp = 4 * I * dtype_bytes
        per_layer = tokens * (2 * norm + attention + mlp) + lse
        input_in_layer = layer_input if dtype_bytes == 4 else 0
        # Token ids, and RoPE's cos and sin tables in the model dtype, one pair shared by every layer.
        embedding = INDEX_BYTES * tokens + 2 * seq_len * head_dim * dtype_bytes
        final_norm = tokens * norm
    # The final norm, the log-softmax kept in fp32 by cross-entropy (the logits themselves, and
    # their fp32 upcast, are not kept), the targets.
    head = final_norm + 4 * tokens * dec.vocab + INDEX_BYTES * tokens
    return Activations(per_layer, layer_input, input_in_layer, embedding, head, dec.layers)
