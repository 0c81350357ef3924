"""A small GPT-like layer list for pipeline tests, written the way DeepSpeed pipeline scripts
write theirs (LayerSpec per block, the embedding tied to the unembedding with TiedLayerSpec), and
the same layers built whole in one process as the reference."""
import torch
import torch.nn.functional as F

VOCAB, D_MODEL, SEQ = 48, 16, 8


class Embed(torch.nn.Embedding):
    pass


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class FinalNorm(torch.nn.LayerNorm):
    pass


def unembed(embedding, x):
    return x @ embedding.weight.t()


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def layer_specs(num_blocks, tied=True):
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    layers = [TiedLayerSpec("embed", Embed, VOCAB, D_MODEL) if tied else LayerSpec(Embed, VOCAB, D_MODEL)]
    layers += [LayerSpec(Block, D_MODEL) for _ in range(num_blocks)]
    layers.append(LayerSpec(FinalNorm, D_MODEL))
    if tied:
        layers.append(TiedLayerSpec("embed", Embed, VOCAB, D_MODEL, forward_fn=unembed))
    else:
        layers.append(LayerSpec(torch.nn.Linear, D_MODEL, VOCAB, bias=False))
    return layers


class IndexedLayers(torch.nn.Module):
    """LayerSpecs built in one container whose children are named by layer index, as
    checkpoint/pipeline.py lays out a pipeline's layers without one: a tied layer's later uses are
    its first module again (through forward_fn where it has one)."""

    def __init__(self, specs):
        super().__init__()
        from zeroshard.pipe import TiedLayerSpec
        self.funcs, tied = [], {}
        for i, spec in enumerate(specs):
            is_tied = isinstance(spec, TiedLayerSpec)
            module = tied[spec.key] if is_tied and spec.key in tied else spec.build()
            if is_tied:
                tied.setdefault(spec.key, module)
            self.add_module(str(i), module)
            fn = spec.forward_fn if is_tied else None
            self.funcs.append(module if fn is None else (lambda x, f=fn, m=module: f(m, x)))

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


class Reference(torch.nn.Module):
    """The same layers in one process, built with PipelineModule's seed_layers seeds (layer i
    after torch.manual_seed(base_seed + i)); a tied layer is the first one's module again.
    named(pipeline_name) maps a PipelineModule parameter name to this model's tensor."""

    def __init__(self, specs, base_seed=1234):
        super().__init__()
        from zeroshard.pipe import TiedLayerSpec
        self.layers = torch.nn.ModuleList()
        self.tied = {}
        self.funcs = []
        for i, spec in enumerate(specs):
            torch.manual_seed(base_seed + i)
            if isinstance(spec, TiedLayerSpec) and spec.key in self.tied:
                module = self.tied[spec.key]
            else:
                module = spec.build()
                if isinstance(spec, TiedLayerSpec):
                    self.tied[spec.key] = module
            self.layers.append(module)
            if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
                self.funcs.append(lambda x, f=spec.forward_fn, m=module: f(m, x))
            else:
                self.funcs.append(module)

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x

    def named(self, name):
        head, rest = name.split(".", 1)
        if head == "tied_modules":
            key, attr = rest.split(".", 1)
            return self.tied[key].get_parameter(attr)
        return self.layers[int(head)].get_parameter(rest)


def batches(steps, micro, gas, dp, seed=0):
    """steps global batches of micro * gas * dp sequences: (tokens, next tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (micro * gas * dp, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def rank_micro_batches(global_batches, micro, gas, data_index):
    """Data index d's micro-batches in order: micro-batch j of each step holds sequences
    [(d * gas + j) * micro, + micro) of the global batch."""
    for x, y in global_batches:
        for j in range(gas):
            lo = (data_index * gas + j) * micro
            yield x[lo:lo + micro], y[lo:lo + micro]


class BiasedEmbed(torch.nn.Module):
    """An embedding with a bias of its own beside the tied weight: both uses read the bias, so it
    must stay one tensor across stages, as it is in one process."""

    def __init__(self, vocab, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, d) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(d) * 0.1)

    def forward(self, tokens):
        return F.embedding(tokens, self.weight) + self.bias


def biased_unembed(embedding, x):
    return (x + embedding.bias) @ embedding.weight.t()


class WeightedLoss(torch.nn.Module):
    """A loss module with a buffer (class weights), as DeepSpeed scripts pass
    CrossEntropyLoss(weight=...)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, logits, labels):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), weight=self.class_weight)


def biased_specs(num_blocks):
    from zeroshard.pipe import LayerSpec, TiedLayerSpec
    return ([TiedLayerSpec("embed", BiasedEmbed, VOCAB, D_MODEL)] +
            [LayerSpec(Block, D_MODEL) for _ in range(num_blocks)] + [LayerSpec(FinalNorm, D_MODEL),
             TiedLayerSpec("embed", BiasedEmbed, VOCAB, D_MODEL, forward_fn=biased_unembed)])


# A model whose stage boundaries carry a tuple (hidden, bool padding mask), as Megatron-DeepSpeed's
# GPTModelPipe passes its attention mask.
MASKED_VOCAB = 32


class MaskedEmbed(torch.nn.Module):
    """tokens -> (hidden, padding mask): the mask crosses every stage boundary beside the hidden."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(MASKED_VOCAB, D_MODEL)

    def forward(self, tokens):
        return self.emb(tokens), tokens != 0


class MaskedBlock(torch.nn.Module):
    forwards = 0  # calls, to see checkpointing recompute

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(D_MODEL, D_MODEL)

    def forward(self, inputs):
        MaskedBlock.forwards += 1
        h, mask = inputs
        return h + torch.tanh(self.fc(h)) * mask.unsqueeze(-1), mask


class MaskedLMHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(D_MODEL, MASKED_VOCAB)

    def forward(self, inputs):
        h, _ = inputs
        return self.out(h)


def masked_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, MASKED_VOCAB), labels.reshape(-1))
