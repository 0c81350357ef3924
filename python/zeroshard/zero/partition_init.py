"""deepspeed.zero.Init: parameters are partitioned as their modules are constructed, so a model
larger than one process's memory can be built. Each module's own parameters are whole only until
its __init__ returns; then every rank keeps just its ZeRO-3 chunk (rank 0's values, broadcast)."""
import torch

_SHAPE = "_zeroshard_full_shape"


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def partition_parameter(param: torch.nn.Parameter, comm, what: str, src: int = 0):
    """Keeps this rank's chunk of `param` (ceil(numel / world) elements, zero-padded). `comm`: a
    zeroshard communicator; `what` names the parameter in its errors."""
    if hasattr(param, _SHAPE):
        return
    shape = tuple(param.shape)
    rank, world = comm.rank, comm.world_size
    with torch.no_grad():
        flat = param.data.reshape(-1)
        if world > 1:
            comm.broadcast(flat, src, what)  # every rank partitions rank 0's values
        chunk = (flat.numel() + world - 1) // world
        mine = flat.new_zeros(chunk)
        held = max(0, min(chunk, flat.numel() - rank * chunk))
        mine[:held] = flat[rank * chunk:rank * chunk + held]
        param.data = mine
    setattr(param, _SHAPE, shape)


def full_shape(param):
    return getattr(param, _SHAPE, None)


class Init:
    """Context manager with DeepSpeed's signature; modules built inside are partitioned."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True,
                 remote_device=None, pin_memory=False, config_dict_or_path=None, config=None,
                 enabled=True, dtype=None, mpu=None, zero_param_parallel_group=None,
                 zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        if remote_device not in (None, "none", "cuda", "cpu"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): only None, 'cpu' or "
                             "'cuda' is supported (NVMe offload is not implemented yet)")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero.Init: ZeRO++ quantized weights are not supported by zeroshard")
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
        from zeroshard.comm import init_distributed, new_comm
        init_distributed()
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
