"""deepspeed.zero.Init: parameters are partitioned as their modules are constructed, so a model
larger than one process's memory can be built. Each module's own parameters are whole only until
its __init__ returns; then every rank keeps just its ZeRO-3 chunk (rank 0's values, broadcast).
Before initialize(), GatheredParameters gathers and re-partitions such parameters here; after it,
the engine's coordinator owns them."""
import itertools

import torch

from zeroshard import _C
from zeroshard.dtypes import PRECISIONS

_SHAPE = "_zeroshard_full_shape"
_COMM = "_zeroshard_init_comm"  # a _CommRef to the communicator the parameter was partitioned over
_ds_ids = itertools.count()     # DeepSpeed's ds_id: every rank builds in the same order
# Parameters gathered by GatheredParameters before initialize(): id -> [open blocks, own chunk].
_open = {}


def _nothing():
    return None


class _CommRef:
    """Holds the communicator on the parameter; a pickle or copy of it holds none (a
    communicator cannot travel, and Parameter.__deepcopy__ drops the attributes anyway)."""
    __slots__ = ("comm",)

    def __init__(self, comm):
        self.comm = comm

    def __reduce__(self):
        return _nothing, ()

    def __deepcopy__(self, memo):
        return None


def _keep_chunk(param, flat, comm):
    """param.data becomes this rank's chunk of `flat` (its whole values, flattened)."""
    chunk, held = _C.zero3_chunk(flat.numel(), comm.world_size, comm.rank)
    begin = comm.rank * chunk
    mine = flat.new_zeros(chunk)
    mine[:held] = flat[begin:begin + held]
    param.data = mine


def partition_parameter(param: torch.nn.Parameter, comm, what: str, src: int = 0):
    """Keeps this rank's chunk of `param` (runtime/shard's chunk: ceil(numel / world) elements,
    zero-padded). `comm`: a zeroshard communicator; `what` names the parameter in its errors."""
    if hasattr(param, _SHAPE):
        return
    shape = tuple(param.shape)
    with torch.no_grad():
        flat = param.data.reshape(-1)
        if comm.world_size > 1:
            comm.broadcast(flat, src, what)  # every rank partitions rank 0's values
        _keep_chunk(param, flat, comm)
    setattr(param, _SHAPE, shape)
    setattr(param, _COMM, _CommRef(comm))
    # DeepSpeed's names for the whole shape and size, which scripts (Hugging Face's loader, peft)
    # read while the parameter holds only a chunk; the engine renumbers ds_id at initialize().
    param.ds_shape, param.ds_numel, param.ds_id = torch.Size(shape), flat.numel(), next(_ds_ids)


def full_shape(param):
    return getattr(param, _SHAPE, None)


def partitioned_before_engine(param) -> bool:
    """Partitioned by zero.Init and not yet handed to an engine (whose coordinator owns it then)."""
    return hasattr(param, _SHAPE) and getattr(param, "_zeroshard_core", None) is None


def init_comm(param):
    """The communicator zero.Init partitioned `param` over; a copy or unpickled one has none."""
    ref = getattr(param, _COMM, None)
    if ref is None:
        raise ValueError(f"zero.Init: parameter ds_id {getattr(param, 'ds_id', '?')} holds only "
                         "its chunk and no communicator: a copy or unpickled parameter of a model "
                         "built under zero.Init cannot be gathered; copy the model after "
                         "initialize() with GatheredParameters, or build it again")
    return ref.comm


def gather_before_engine(params):
    """GatheredParameters before initialize(): each parameter takes its whole values (one
    all-gather, on the communicator that partitioned it), once however many blocks hold it."""
    with torch.no_grad():
        for p in params:
            if id(p) in _open:
                _open[id(p)][0] += 1
                continue
            comm, chunk = init_comm(p), p.data
            full = chunk.new_empty(chunk.numel() * comm.world_size)
            if comm.world_size > 1:
                comm.all_gather(full, chunk, f"GatheredParameters: ds_id {p.ds_id} {tuple(p.ds_shape)}")
            else:
                full.copy_(chunk)
            p.data = full[:p.ds_numel].view(p.ds_shape)
            _open[id(p)] = [1, chunk]


def repartition_before_engine(params, modifier_rank):
    """The end of such a block. With a modifier rank, its whole values are broadcast; the last
    block to close then keeps every rank's chunk of them. Without one, the last block restores
    the chunks, and edits are discarded (as in DeepSpeed)."""
    with torch.no_grad():
        for p in params:
            entry = _open[id(p)]
            entry[0] -= 1
            last = entry[0] == 0
            if last:
                del _open[id(p)]
            if modifier_rank is None:
                if last:
                    p.data = entry[1]
                continue
            if tuple(p.shape) != tuple(p.ds_shape):
                raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}): parameter "
                                 f"ds_id {p.ds_id} was given shape {tuple(p.shape)} inside the "
                                 f"block; expected its shape {tuple(p.ds_shape)}")
            comm = init_comm(p)
            flat = p.data.to(entry[1].dtype).reshape(-1).contiguous()
            if comm.world_size > 1:
                comm.broadcast(flat, modifier_rank,
                               f"GatheredParameters: ds_id {p.ds_id} from rank {modifier_rank}")
            if last:
                _keep_chunk(p, flat, comm)
            else:
                p.data = flat.view(p.ds_shape)


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


# DeepSpeed's zero.Init wraps torch's tensor constructors so that floating tensors come out in the
# model dtype; zeroshard's does not: parameters are made as the module makes them and cast when
# they are partitioned, so a model built under Init holds exactly the values of one built normally
# and cast. transformers still reads and swaps these two names around Init (to keep torch.arange's
# dtype, which zeroshard never changes), so they exist with DeepSpeed's meaning for callers.
_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device=None):
    """DeepSpeed's wrapper of a tensor constructor: made on `target_device` unless the call names a
    device, and a floating result in `target_fp_dtype`. zero.Init does not use it (see above)."""
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor
    return wrapped


def get_accelerator():
    """deepspeed.runtime.zero.partition_parameters.get_accelerator (transformers reads it here)."""
    from zeroshard.accelerator import get_accelerator as accelerator
    return accelerator()


# The blocks of a ds_config that zero.Init reads. The rest may still hold "auto" values that
# Hugging Face fills only when training starts (the scheduler's step counts), after the model
# is built under Init; DeepSpeed's Init does not read them either.
_INIT_BLOCKS = ("fp16", "bf16", "zero_optimization")


def _init_settings(config):
    """The engine settings of a ds_config's blocks that zero.Init reads (DeepSpeed's zero.Init
    takes the model dtype from there when no dtype is given); refuses what the engine would refuse
    (parameter offload below stage 3 ...) with the engine's check."""
    import json
    from zeroshard.config import config_text
    text, source = config_text(config=config)
    try:
        given = json.loads(text)
    except ValueError:
        given = None  # a file with comments: the C++ parser reads it whole (errors name the file)
    if given is None:
        parsed = _C.parse_config(text, source)
    else:
        blocks = {k: given[k] for k in _INIT_BLOCKS if k in given}
        parsed = _C.parse_config(json.dumps({"train_micro_batch_size_per_gpu": 1, **blocks}), source)
    _C.require_buildable(parsed)
    return _C.engine_settings(parsed)


class Init:
    """Context manager with DeepSpeed's signature; modules built inside are partitioned."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        # mem_efficient_linear needs nothing: a released parameter's memory is freed in place
        # and gathered again for backward, so linear's saved weight holds no copy between them.
        # pin_memory applies to host-resident partitions, which are host memory here anyway.
        if remote_device not in (None, "none", "cuda", "cpu", "nvme"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): expected None, 'cpu', "
                             "'nvme' or 'cuda'")
        if remote_device in ("cpu", "nvme") and torch.cuda.is_available():
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): zero.Init keeps each chunk "
                             "on the device it was built on, and initialize() moves the chunks to "
                             "host memory or NVMe when the config's zero_optimization.offload_param."
                             f"device is \"{remote_device}\"; expected None or 'cuda'")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero.Init: ZeRO++ quantized weights are not supported by zeroshard")
        for name, value in (("zero_param_parallel_group", zero_param_parallel_group),
                            ("sequence_data_parallel_group", sequence_data_parallel_group),
                            ("param_swapper", param_swapper)):
            if value is not None:
                raise ValueError(f"zero.Init({name}=...): not supported by zeroshard; expected None")
        if config is not None and config_dict_or_path is not None:
            raise ValueError("zero.Init: given both config_dict_or_path and config (its older "
                             "name); pass only one")
        config = config_dict_or_path if config_dict_or_path is not None else config
        settings = _init_settings(config) if config is not None and enabled else {}
        if dtype is None and settings:
            dtype = PRECISIONS[settings["precision"]]
        if remote_device == "nvme" and enabled and settings.get("offload_param") != "nvme":
            raise ValueError("zero.Init(remote_device='nvme'): the chunks go to NVMe only where the "
                             "config says where (zero_optimization.offload_param.device \"nvme\" "
                             "with its nvme_path); pass config_dict_or_path with that block")
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.enabled = enabled
        self.dtype = dtype
        self.group = data_parallel_group
        self._comm = None
        self._patched = []
        if module is not None and enabled:
            self._start()
            for m in module.modules():
                self._partition(m)
            self._stop()

    def _start(self):
        import torch.distributed as dist
        from zeroshard.comm import init_distributed, new_comm
        init_distributed()
        if self.group is not None and dist.get_rank(self.group) < 0:
            raise ValueError(f"zero.Init(data_parallel_group=...): rank {dist.get_rank()} is not "
                             "a member of that group; build the model under zero.Init on the "
                             "group's ranks only")
        # A communicator of our own, numbered and watched like the engine's: a rank that builds a
        # different model ends with an error naming the parameter instead of hanging.
        self._comm = new_comm(self.group)

    def _partition(self, module):
        for name, p in module.named_parameters(recurse=False):
            if self.dtype is not None and p.is_floating_point():
                p.data = p.data.to(self.dtype)
            partition_parameter(p, self._comm, f"zero.Init: {type(module).__name__}.{name}")

    def _wrap(self, cls):
        original = cls.__dict__.get("__init__")
        if original is None:
            return
        ctx = self

        def init(module, *args, **kwargs):
            original(module, *args, **kwargs)
            ctx._partition(module)
        init.__wrapped__ = original
        cls.__init__ = init
        self._patched.append((cls, original))

    def __enter__(self):
        if not self.enabled:
            return self
        self._start()
        for cls in set(_all_subclasses(torch.nn.Module)):
            self._wrap(cls)
        return self

    def __exit__(self, *exc):
        self._stop()
        return False

    def _stop(self):
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched.clear()
        self._comm = None

