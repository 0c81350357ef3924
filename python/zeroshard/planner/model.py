"""What the planner knows of a model: its trainable tensors (elements, owning module, pipeline
layer) and, for a decoder given as a Hugging Face-style config, the shapes its activation estimate
needs. An nn.Module is read as it is; layer specs are built on the meta device (nothing allocated)."""
import json
import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decoder:
    """A GPT- or Llama-style decoder. arch "gpt": learned positions, LayerNorm, GELU MLP of 4x
    hidden, tied embedding (examples/gpt.py; gpt2 adds biases); "llama": rotary positions,
    RMSNorm, SwiGLU MLP of `intermediate`, grouped-query attention with `kv_heads`."""
    arch: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: int = 0              # 0: heads
    intermediate: int = 0          # 0: 4 * hidden (gpt) or Llama's rule
    tie_embeddings: bool = True
    qkv_bias: bool = False         # gpt2's biased qkv; examples/gpt.py has none

    def __post_init__(self):
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"decoder arch: got {self.arch!r}, expected one of 'gpt', 'llama'")
        for name in ("layers", "hidden", "heads", "vocab", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"decoder {name}: got {getattr(self, name)}, expected a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"decoder hidden {self.hidden} is not a multiple of heads {self.heads}")

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp(self) -> int:
        if self.intermediate:
            return self.intermediate
        if self.arch == "gpt":
            return 4 * self.hidden
        # Llama's default: 2/3 of 4 * hidden, rounded up to a multiple of 256.
        return (int(8 * self.hidden / 3) + 255) // 256 * 256


@dataclass
class ModelSpec:
    """Trainable tensors in parameter order (the order the engine flattens them in)."""
    name: str
    numels: list = field(default_factory=list)
    modules: list = field(default_factory=list)    # owning module path of each tensor
    layer_of: list | None = None                   # pipeline layer of each tensor (layer lists)
    num_layers: int = 0                            # pipeline layers (0: not a layer list)
    decoder: Decoder | None = None
    # A PipelineModule's own layout: its stage count and its partition's boundaries over its
    # num_stages x virtual_stages model chunks (PipelineModule.parts).
    pipeline_stages: int = 0
    pipeline_parts: list | None = None
    pipeline_virtual_stages: int = 1  # its model chunks per rank
    # Tensors a pipeline holds in more than one layer (a tied embedding, TiedLayerSpec): tensor
    # index -> the other layers; every stage holding one of them keeps its own copy.
    tied_layers: dict = field(default_factory=dict)

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    def layers_of(self, index: int) -> list:
        """The pipeline layers that hold tensor `index`."""
        return [self.layer_of[index], *self.tied_layers.get(index, ())]

    def largest_module_numel(self, tensors=None) -> int:
        """Most elements one module owns directly (what ZeRO-3 gathers at once at least), among
        the tensors at `tensors` (None: all)."""
        per = {}
        for i in range(len(self.numels)) if tensors is None else tensors:
            per[self.modules[i]] = per.get(self.modules[i], 0) + self.numels[i]
        return max(per.values(), default=0)


def _add(spec, name, *shape):
    n = 1
    for d in shape:
        n *= d
    spec.numels.append(n)
    spec.modules.append(name.rsplit(".", 1)[0] if "." in name else "")


def spec_from_decoder(dec: Decoder, name: str = "") -> ModelSpec:
    """The decoder's parameter shapes in module registration order: examples/gpt.py's GPT for
    "gpt", Hugging Face's LlamaForCausalLM for "llama"."""
    s = ModelSpec(name or f"{dec.arch} {dec.layers}x{dec.hidden}", decoder=dec)
    H, I, kv = dec.hidden, dec.mlp, dec.kv * (dec.hidden // dec.heads)
    s = _decoder_tensors(s, dec, H, I, kv)
    # As a pipeline's layer list: the embedding, each decoder layer, the final norm and head.
    s.num_layers = dec.layers + 2
    s.layer_of = [_decoder_layer(m, dec.layers) for m in s.modules]
    if dec.tie_embeddings:  # the head's stage holds the token embedding as well
        s.tied_layers = {0: [dec.layers + 1]}
    return s


def _decoder_layer(module: str, layers: int) -> int:
    """0 for the embedding, i + 1 for decoder layer i, layers + 1 for the final norm and head."""
    for prefix in ("blocks.", "model.layers."):
        if module.startswith(prefix):
            return int(module[len(prefix):].split(".")[0]) + 1
    return layers + 1 if module.startswith(("ln_f", "head", "model.norm", "lm_head")) else 0


def _decoder_tensors(s, dec, H, I, kv):
    if dec.arch == "gpt":
        _add(s, "tok.weight", dec.vocab, H)
        _add(s, "pos.weight", dec.seq_len, H)
        for i in range(dec.layers):
            b = f"blocks.{i}"
            _add(s, f"{b}.ln1.weight", H), _add(s, f"{b}.ln1.bias", H)
            _add(s, f"{b}.qkv.weight", 3 * H, H)
            if dec.qkv_bias:
                _add(s, f"{b}.qkv.bias", 3 * H)
            _add(s, f"{b}.proj.weight", H, H), _add(s, f"{b}.proj.bias", H)
            _add(s, f"{b}.ln2.weight", H), _add(s, f"{b}.ln2.bias", H)
            _add(s, f"{b}.fc.weight", I, H), _add(s, f"{b}.fc.bias", I)
            _add(s, f"{b}.out.weight", H, I), _add(s, f"{b}.out.bias", H)
        _add(s, "ln_f.weight", H), _add(s, "ln_f.bias", H)
        if not dec.tie_embeddings:
            _add(s, "head.weight", dec.vocab, H)
        return s
    _add(s, "model.embed_tokens.weight", dec.vocab, H)
    for i in range(dec.layers):
        b = f"model.layers.{i}"
        _add(s, f"{b}.self_attn.q_proj.weight", H, H)
        _add(s, f"{b}.self_attn.k_proj.weight", kv, H)
        _add(s, f"{b}.self_attn.v_proj.weight", kv, H)
        _add(s, f"{b}.self_attn.o_proj.weight", H, H)
        _add(s, f"{b}.mlp.gate_proj.weight", I, H)
        _add(s, f"{b}.mlp.up_proj.weight", I, H)
        _add(s, f"{b}.mlp.down_proj.weight", H, I)
        _add(s, f"{b}.input_layernorm.weight", H)
        _add(s, f"{b}.post_attention_layernorm.weight", H)
    _add(s, "model.norm.weight", H)
    if not dec.tie_embeddings:
        _add(s, "lm_head.weight", dec.vocab, H)
    return s


# Hugging Face config keys, first found wins.
_HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions", "n_ctx", "seq_len"),
}


# model_type -> Decoder arch: the families whose parameter shapes spec_from_decoder writes out
# (others, e.g. qwen2's biased qkv or a mixture of experts, would be counted wrong).
_HF_ARCH = {"gpt2": "gpt", "gpt": "gpt", "llama": "llama", "mistral": "llama"}


def decoder_from_hf(config) -> Decoder:
    """A Decoder from a Hugging Face config (a dict, a path to config.json, or a
    transformers PretrainedConfig). model_type "gpt2" reads as arch "gpt" with biases, "llama" and
    "mistral" as "llama"; any other is a ValueError (give "arch": "gpt" or "llama" to override)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    elif not isinstance(config, dict):
        config = config.to_dict()
    got = {}
    for field_name, keys in _HF_KEYS.items():
        for k in keys:
            if config.get(k) is not None:
                got[field_name] = int(config[k])
                break
        else:
            raise ValueError(f"model config: none of {', '.join(keys)} is set; they give the decoder's {field_name}")
    model_type = config.get("model_type", "")
    arch = config.get("arch") or _HF_ARCH.get(model_type)
    if arch is None:
        raise ValueError(f"model config: model_type: got {model_type!r}, expected one of "
                         f"{', '.join(sorted(_HF_ARCH))} (or an \"arch\" key: \"gpt\" or \"llama\")")
    return Decoder(arch=arch, kv_heads=int(config.get("num_key_value_heads") or 0),
                   intermediate=int(config.get("intermediate_size") or config.get("n_inner") or 0),
                   tie_embeddings=bool(config.get("tie_word_embeddings", arch == "gpt")),
                   qkv_bias=model_type == "gpt2", **got)


def _trainable(module):
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def spec_from_module(module, name: str = "") -> ModelSpec:
    """An nn.Module's trainable tensors as the engine sees them (shared ones once). Build it under
    `with torch.device("meta"):` so nothing is allocated; only shapes are read."""
    s = ModelSpec(name or type(module).__name__)
    for n, p in _trainable(module):
        _add(s, n, *p.shape)
    return s


def spec_from_layers(layers, name: str = "") -> ModelSpec:
    """A pipeline's layer list (modules, LayerSpecs, or a PipelineModule's specs), each layer's
    tensors tagged with its index. LayerSpecs are built on the meta device."""
    import torch
    from zeroshard.pipe.layers import LayerSpec
    from zeroshard.pipe.layers import TiedLayerSpec
    s = ModelSpec(name or "layers", layer_of=[])
    tied = {}  # TiedLayerSpec key -> the indices of the tensors its first layer added
    for i, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec) and layer.key in tied:
            for t in tied[layer.key]:  # the same module again: built once per rank
                s.tied_layers.setdefault(t, []).append(i)
            continue
        first = len(s.numels)
        if isinstance(layer, LayerSpec):
            with torch.device("meta"):
                layer = layer.build()
        if isinstance(layer, torch.nn.Module):
            for n, p in _trainable(layer):
                _add(s, f"{i}.{n}", *p.shape)
                s.layer_of.append(i)
        if isinstance(layers[i], TiedLayerSpec):
            tied[layers[i].key] = range(first, len(s.numels))
    s.num_layers = len(layers)
    return s


def model_spec(model, name: str = "") -> ModelSpec:
    """Whatever plan() was given as the model, as a ModelSpec."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Decoder):
        return spec_from_decoder(model, name)
    if isinstance(model, (dict, str, os.PathLike)):
        return spec_from_decoder(decoder_from_hf(model), name)
    import torch
    from zeroshard.pipe.module import PipelineModule
    if isinstance(model, PipelineModule):
        s = spec_from_layers(model.layer_specs, name or type(model).__name__)
        s.pipeline_stages, s.pipeline_parts = model.num_stages, list(model.parts)
        s.pipeline_virtual_stages = model.virtual_stages
        return s
    if isinstance(model, (list, tuple, torch.nn.Sequential)):
        return spec_from_layers(list(model), name)
    if isinstance(model, torch.nn.Module):
        return spec_from_module(model, name)
    if hasattr(model, "to_dict"):
        return spec_from_decoder(decoder_from_hf(model), name)
    raise TypeError(f"plan: model: got {type(model).__name__}, expected an nn.Module, a layer list, "
                    "a PipelineModule, a Hugging Face config (dict, path or PretrainedConfig) or a Decoder")
