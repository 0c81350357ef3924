"""DeepSpeed's activation checkpointing API (deepspeed.checkpointing): checkpoint(function, *args)
keeps only a segment's inputs and runs it again in backward (torch.utils.checkpoint's
non-reentrant form underneath); with cpu_checkpointing the kept inputs wait in host memory.
configure() reads the config's activation_checkpointing block or its keyword overrides. The RNG
tracker (get_cuda_rng_tracker, model_parallel_cuda_manual_seed) keeps named random streams beside
the default one, as Megatron-style dropout uses them; a recomputation sees them as the forward did."""
import contextlib
import copy
import json
import os

import torch
import torch.utils.checkpoint

from zeroshard import _C
from zeroshard.graph import note_recomputed_segment

from zeroshard.log import log_rank0

_settings = {"cpu_checkpointing": False, "configured": False, "mpu": None}

# The tracker's stream that model_parallel_cuda_manual_seed seeds (DeepSpeed's and Megatron's name).
_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# Offset of that stream's seed from the default stream's (DeepSpeed's and Megatron's constant).
_MODEL_PARALLEL_SEED_OFFSET = 2718


# ----- the generator the tracker forks: the engine's device's -----

def _on_cuda():
    from zeroshard.accelerator import get_accelerator
    return get_accelerator().device_name() == "cuda"


def _get_rng_state():
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def _set_cuda_rng_state(new_state, device=-1):
    """DeepSpeed's name: sets the default generator of the current CUDA device (or `device`), or
    the CPU's where the engine computes on the CPU."""
    if _on_cuda():
        torch.cuda.set_rng_state(new_state, "cuda" if device == -1 else device)
    else:
        torch.set_rng_state(new_state)


def _seeded_state(seed):
    """The state the default generator would have after manual_seed(seed), leaving it alone."""
    return torch.Generator(device="cuda" if _on_cuda() else "cpu").manual_seed(seed).get_state()


class CudaRNGStatesTracker:
    """Named RNG states beside the default generator's (DeepSpeed's CudaRNGStatesTracker, which
    is Megatron's): add(name, seed) starts a stream, fork(name) runs a block on it and then puts
    the default state back, so the block's draws neither consume nor depend on the default stream.
    Each name and each seed is used once. On a CPU-only run the streams are the CPU generator's."""

    def __init__(self):
        self.states_ = {}  # name -> generator state (a byte tensor)
        self.seeds_ = set()  # kept only to refuse a seed given twice

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A copy of the name -> state map (the states themselves are never changed in place)."""
        return copy.copy(self.states_)

    def set_states(self, states):
        self.states_ = states

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by a tracked "
                             "state; each state needs its own seed")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: RNG state {name!r} already exists; tracked "
                             f"states are {sorted(self.states_)}")
        self.seeds_.add(seed)
        self.states_[name] = _seeded_state(seed)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Runs the block on stream `name`; the stream continues where the block left it."""
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.fork: RNG state {name!r} is not added; tracked "
                             f"states are {sorted(self.states_)} (add(name, seed) first)")
        default_state = _get_rng_state()
        _set_cuda_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng_state()
            _set_cuda_rng_state(default_state)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker():
    return _CUDA_RNG_STATE_TRACKER


# configure()'s mpu names its tensor slice in one of three generations (Megatron-LM's current,
# DeepSpeed's grid, Megatron's older): (rank method, size method), tried in this order. A
# pipeline grid's get_model_parallel_* count its stages too, so the slice names come first.
_TENSOR_PARALLEL_NAMES = (("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
                          ("get_slice_parallel_rank", "get_slice_parallel_world_size"),
                          ("get_model_parallel_rank", "get_model_parallel_world_size"))


def _tensor_parallel(mpu, which):
    """configure()'s mpu's tensor slice: this rank's (which=0) or the number of slices (which=1);
    0 and 1 without an mpu. The generation is the one whose rank method the mpu has."""
    if mpu is None:
        return (0, 1)[which]
    for names in _TENSOR_PARALLEL_NAMES:
        if hasattr(mpu, names[0]):
            return getattr(mpu, names[which])()
    raise ValueError("checkpointing: configure()'s mpu has none of "
                     + ", ".join(rank for rank, _ in _TENSOR_PARALLEL_NAMES))


def model_parallel_cuda_manual_seed(seed):
    """Seeds the default generator with `seed` (the same on every tensor slice: dropout outside
    tensor-parallel regions) and starts the tracker's model-parallel stream at seed + 2718 + the
    tensor-slice rank (different per slice). Clears the tracker first, as DeepSpeed does."""
    tp_rank = _tensor_parallel(_settings["mpu"], 0)
    model_parallel_seed = seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank
    log_rank0(f"checkpointing: model parallel seed {model_parallel_seed} (tensor-slice rank {tp_rank}), "
              f"data parallel seed {seed}", int(os.environ.get("RANK", "0")))
    _CUDA_RNG_STATE_TRACKER.reset()
    if _on_cuda():
        torch.cuda.manual_seed(seed)  # the current device's generator, as the tracker forks it
    else:
        torch.default_generator.manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed):
    """Re-seeds the model-parallel stream (seed + 2718 + tensor-slice rank) without touching the default."""
    tp_rank = _tensor_parallel(_settings["mpu"], 0)
    with _CUDA_RNG_STATE_TRACKER.fork():
        _set_cuda_rng_state(_seeded_state(seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank))


class _TrackerStatesAs:
    """Inside it the tracker holds `states` (a copy each time), after it its own again. Enterable
    any number of times: a segment is recomputed once per backward pass that reaches it (zero
    bubble's input- and weight-gradient passes are two)."""

    def __init__(self, states):
        self._states = states
        self._own = []

    def __enter__(self):
        self._own.append(_CUDA_RNG_STATE_TRACKER.get_states())
        _CUDA_RNG_STATE_TRACKER.set_states(copy.copy(self._states))

    def __exit__(self, *exc):
        _CUDA_RNG_STATE_TRACKER.set_states(self._own.pop())


def _forward_and_recompute_contexts():
    # torch restores the default generators for a recomputation; the tracker's streams have
    # moved on since the forward, so the recomputation gets them as the forward saw them (else
    # a dropout inside fork() would draw a different mask in backward).
    return contextlib.nullcontext(), _TrackerStatesAs(_CUDA_RNG_STATE_TRACKER.get_states())


def checkpoint(function, *args):
    """function(*args), its activations recomputed in backward instead of kept."""
    keep = contextlib.nullcontext()
    if _settings["cpu_checkpointing"]:
        keep = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    first = _C.autograd_sequence_number()
    with keep:
        out = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                context_fn=_forward_and_recompute_contexts)
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        # Zero bubble's weight pass must not replay nodes of this segment (each replay would
        # recompute it): pipe/weight_pass.py asks zeroshard.graph where the segments are.
        note_recomputed_segment(first, _C.autograd_sequence_number())
    return out


# DeepSpeed's non-reentrant variant of checkpoint; zeroshard's checkpoint is non-reentrant already.
non_reentrant_checkpoint = checkpoint


def _block_from(deepspeed_config):
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, dict):
        config = deepspeed_config
    else:
        from zeroshard import _C
        with open(deepspeed_config) as f:
            text = f.read()
        config = json.loads(_C.parse_config(text, str(deepspeed_config)).resolved_json())
    return config.get("activation_checkpointing", {}) or {}


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """DeepSpeed's configure: the config's block, then the keyword arguments over it. Options
    that would change where activations live in ways zeroshard does not implement are errors.
    mpu_ (kept from an earlier call when None, as in DeepSpeed) gives model_parallel_cuda_manual_seed
    its tensor-slice rank."""
    block = _block_from(deepspeed_config)
    partition = block.get("partition_activations", False) if partition_activations is None else partition_activations
    contiguous = (block.get("contiguous_memory_optimization", False) if contiguous_checkpointing is None
                  else contiguous_checkpointing)
    mpu = mpu_ if mpu_ is not None else _settings["mpu"]
    slices = _tensor_parallel(mpu, 1) if partition else 1
    if slices > 1:
        raise ValueError(f"checkpointing.configure: partition_activations splits activations over the "
                         f"{slices} tensor-parallel ranks of the mpu, which zeroshard does not implement")
    if contiguous and not partition:
        raise ValueError("checkpointing.configure: contiguous_memory_optimization (contiguous_checkpointing) "
                         "needs partition_activations, as in DeepSpeed")
    cpu = block.get("cpu_checkpointing", False) if checkpoint_in_cpu is None else checkpoint_in_cpu
    # Options that change nothing here, said, not dropped silently: timing and buffer counts, and
    # a partition over one tensor-parallel rank (each activation stays whole, as it would in
    # DeepSpeed) into contiguous buffers zeroshard does not preallocate.
    for key, value in (("synchronize_checkpoint_boundary", synchronize), ("profile", profile),
                       ("number_checkpoints", num_checkpoints), ("partition_activations", partition),
                       ("contiguous_memory_optimization", contiguous)):
        value = block.get(key) if value is None else value
        if value not in (None, False):
            log_rank0(f"warning: checkpointing.configure: {key}={value!r} has no effect in zeroshard "
                      "(no device synchronization, profiling, preallocated checkpoint buffers, or "
                      "tensor-parallel ranks to split activations over)",
                      int(os.environ.get("RANK", "0")))
    _settings.update(cpu_checkpointing=bool(cpu), configured=True)
    if mpu_ is not None:
        _settings["mpu"] = mpu_


def is_configured():
    return _settings["configured"]


def reset():
    """DeepSpeed resets its buffers between iterations; zeroshard keeps none."""
