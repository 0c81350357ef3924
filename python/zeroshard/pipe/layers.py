"""DeepSpeed's deferred layers (deepspeed.pipe.LayerSpec, TiedLayerSpec): a class and its
arguments, built only on the stage that owns the layer, so no rank ever holds the whole model."""
import torch


class LayerSpec:
    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, torch.nn.Module)):
            raise RuntimeError(f"LayerSpec: got typename {typename!r}, expected a subclass of "
                               "torch.nn.Module (pass a plain function to PipelineModule's layers "
                               "directly)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log=False):
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self):
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (tied_weight_attr) are shared with every other TiedLayerSpec of the
    same key, on whichever stages they land: built once per rank, set from the first owning stage
    at start, and its gradients summed over the owning stages every step. forward_fn(module, x)
    replaces module(x) where given (an unembedding that reuses the embedding's weight)."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",),
                 **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        if isinstance(tied_weight_attr, str):
            tied_weight_attr = [tied_weight_attr]
        self.tied_weight_attr = list(tied_weight_attr)

    def __repr__(self):
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"
