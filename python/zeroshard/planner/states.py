"""Bytes per rank by the runtime's own memory categories (runtime/memory.h) for one setup: the
model states counted exactly as the runtime lays them out (padding and chunking through the
runtime's own layout functions, zeroshard._C.layout), and the transient buffers as documented
upper bounds. tests/python/test_plan.py checks both against engine memory accounting."""
from dataclasses import dataclass

from zeroshard import _C

# The optimizer planned, and written into a setup's config, when neither the config nor the caller
# names one.
DEFAULT_OPTIMIZER = "AdamW"
# Bytes per element of the model dtype and of communication_data_type.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DEVICE_CATEGORIES = ("parameters", "gradients", "master_weights", "optimizer_state",
                     "gathered_parameters", "comm_buffers")
HOST_CATEGORIES = ("host_parameters", "host_master_weights", "host_optimizer_state", "host_buffers")
# The model states: exact. The rest (gathered_parameters, comm_buffers, host_buffers, NVMe-resident
# parameter chunks) depend on the order work arrives in: upper bounds.
MODEL_STATES = ("parameters", "gradients", "master_weights", "optimizer_state",
                "host_parameters", "host_master_weights", "host_optimizer_state")


@dataclass(frozen=True)
class ZeroSettings:
    """The zero_optimization values that change memory, as the config parser resolved them (the
    defaults are the C++ parser's; build it with from_resolved)."""
    stage: int
    offload_optimizer: str
    offload_param: str
    precision: str
    optimizer: str
    reduce_bucket_size: int
    overlap_comm: bool
    stage3_max_live_parameters: int
    stage3_param_persistence_threshold: int
    sub_group_size: int
    communication_data_type: str
    stage3_prefetch_bucket_size: int
    max_in_cpu: int                # offload_param.max_in_cpu
    optimizer_buffer_count: int    # offload_optimizer.buffer_count
    param_buffer_count: int        # offload_param.buffer_count
    offload_ratio: float           # offload_optimizer.ratio

    @classmethod
    def from_resolved(cls, resolved: dict):
        """From zeroshard._C.parse_config(...).resolved_json() loaded as a dict."""
        z = resolved["zero_optimization"]
        precision = ("bf16" if resolved.get("bf16", {}).get("enabled") else
                     "fp16" if resolved.get("fp16", {}).get("enabled") else "fp32")
        opt = resolved.get("optimizer") or {}
        return cls(stage=z["stage"], offload_optimizer=z["offload_optimizer"]["device"],
                   offload_param=z["offload_param"]["device"], precision=precision,
                   optimizer=opt.get("type", DEFAULT_OPTIMIZER),
                   reduce_bucket_size=int(z["reduce_bucket_size"]), overlap_comm=bool(z["overlap_comm"]),
                   stage3_max_live_parameters=int(z["stage3_max_live_parameters"]),
                   stage3_param_persistence_threshold=int(z["stage3_param_persistence_threshold"]),
                   sub_group_size=int(z["sub_group_size"]),
                   stage3_prefetch_bucket_size=int(z["stage3_prefetch_bucket_size"]),
                   communication_data_type=resolved.get("communication_data_type") or "",
                   max_in_cpu=int(z["offload_param"]["max_in_cpu"]),
                   optimizer_buffer_count=int(z["offload_optimizer"]["buffer_count"]),
                   param_buffer_count=int(z["offload_param"]["buffer_count"]),
                   offload_ratio=float(z["offload_optimizer"].get("ratio", 1.0)))

    def is_persistent(self, numel: int) -> bool:
        """Whether ZeRO-3 keeps a tensor of `numel` elements whole on every rank (the rule of
        zero/param_gatherer.cpp, which the planner's bytes and traffic both follow)."""
        return numel < self.stage3_param_persistence_threshold


def model_state_bytes(numels, world_size: int, z: ZeroSettings, largest_module_numel: int = 0) -> dict:
    """One rank's bytes by category at the peak of a training step (stage 3's gradient shard is
    full after backward and freed by the step). `numels`: the trainable tensors, in parameter
    order, of one parameter group (the engine makes one flat group per optimizer param group:
    plan a model with several groups group by group). Model states are exact; padding is the
    runtime's: stages 0-2 round the flat buffer up to a multiple of world_size * 16 elements
    (_C.layout.alignment_numel), stage 3 rounds every tensor up to a multiple of world_size."""
    h = DTYPE_BYTES[z.precision]
    slots = _C.layout.optimizer_state_slots(z.optimizer)
    comm = DTYPE_BYTES.get(z.communication_data_type, h) if world_size > 1 else h
    total, padded, _ = _C.layout.flat_layout(list(numels), world_size)
    chunks, chunk_shard = _C.layout.chunk_layout(list(numels), world_size)
    b = dict.fromkeys(DEVICE_CATEGORIES + HOST_CATEGORIES, 0)
    b["nvme"] = 0
    traits = _C.layout.stage_traits(z.stage)
    stage3 = traits["partitions_params"]
    owned = chunk_shard if stage3 else padded // world_size if traits["shards_optimizer_state"] else padded
    persistent = sum(n for n in numels if z.is_persistent(n)) if stage3 else 0
    params_on_host = z.offload_param != "none"
    # The 16-bit (or fp32) model copy: whole at stages 0-2; this rank's chunks at stage 3, plus
    # the persistent parameters whole on every rank (on the device, whatever offload_param says).
    if not stage3:
        b["parameters"] = h * padded
    elif z.offload_param == "none":
        b["parameters"] = h * (chunk_shard + persistent)
    else:
        b["parameters"] = h * persistent
        if z.offload_param == "cpu":
            b["host_parameters"] = h * chunk_shard
        else:
            # Chunks on NVMe: those of persistent parameters stay in host memory; the others come in
            # for the gathers and the reads ahead of them (at most the live cap and a prefetch
            # bucket) and stay while they fit offload_param.max_in_cpu. An upper bound.
            persistent_chunks = sum(c for c, n in zip(chunks, numels) if z.is_persistent(n))
            ahead = live_bound(z, largest_module_numel) + z.stage3_prefetch_bucket_size
            held = z.max_in_cpu + _chunk_of(ahead, world_size)
            b["host_parameters"] = h * min(chunk_shard, persistent_chunks + held)
            # One swap-file region per non-persistent chunk (zero/param_swap.cpp): exact.
            b["nvme"] += sum(_C.layout.swap_region_bytes(h * c, 0) for c, n in zip(chunks, numels)
                             if c and not z.is_persistent(n))
    b["gradients"] = h * (padded if traits["keeps_full_grads"] else owned)
    # fp32 master: the fp32 model copy itself where both live on the device.
    master = 0 if z.precision == "fp32" and z.offload_optimizer == "none" and not params_on_host else 4 * owned
    state = 4 * slots * owned
    if z.offload_optimizer == "none":
        b["master_weights"], b["optimizer_state"] = master, state
    elif z.offload_optimizer == "cpu":
        b["host_master_weights"], b["host_optimizer_state"] = 4 * owned, state
    else:
        b["nvme"] += _optimizer_swap_bytes(numels, owned, slots, z, chunks if stage3 else None)
    b["comm_buffers"] = _comm_buffer_bytes(numels, world_size, z, comm, chunks, total, traits)
    if stage3:
        live = live_bound(z, largest_module_numel)
        b["gathered_parameters"] = h * min(sum(numels) - persistent, live)
        if params_on_host:  # chunks copied up for the gathers in flight
            b["comm_buffers"] += h * _chunk_of(min(sum(numels), live), world_size)
    largest_piece = max(chunks) if stage3 else max(numels, default=0)
    b["host_buffers"] = _host_buffer_bytes(owned, z, h, slots, largest_piece, max(chunks, default=0))
    return b


def live_bound(z: ZeroSettings, largest_module_numel: int) -> int:
    """Most elements ZeRO-3 holds gathered at once: make_room (zero/param_gatherer.cpp) drops only
    unreferenced parameters, so up to the live cap can still be referenced when a module gathers."""
    return z.stage3_max_live_parameters + largest_module_numel


def _chunk_of(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def _optimizer_swap_bytes(numels, owned, slots, z, chunks) -> int:
    """The optimizer's swap file (zero/swap_space.cpp), an upper bound: one region per sub-group,
    each padded; sub-groups close at tensor pieces (zero/sub_groups.cpp), and two consecutive ones
    hold more than sub_group_size, so there are at most 2 * ceil(owned / sub_group_size) of them,
    and at most one per piece."""
    if owned == 0:
        return 0
    pieces = sum(1 for c in chunks if c) if chunks is not None else len(numels)
    regions = min(pieces, 2 * _chunk_of(owned, max(z.sub_group_size, 1)))
    padding = _C.layout.swap_region_bytes(1, slots) - (1 + slots)  # a region's most header and padding
    return 4 * (1 + slots) * owned + regions * padding


def _comm_buffer_bytes(numels, world_size, z, comm, chunks, total, traits) -> int:
    """Gradient-reduction staging: stages 0-1 reduce in place (a copy only in another
    communication_data_type); stages 2-3 stage buckets in a pool of one buffer (two with
    overlap_comm) of the largest bucket (zero/staged_reducer.cpp), an upper bound."""
    full_grads = traits["keeps_full_grads"]
    overlap = z.overlap_comm or full_grads
    bucket = _C.layout.effective_bucket_numel(z.reduce_bucket_size, full_grads, overlap)
    if full_grads:
        return comm * total if comm != DTYPE_BYTES[z.precision] else 0
    largest = 0
    for first, end, _, numel in _C.layout.plan_buckets(list(numels), world_size, bucket):
        if not traits["partitions_params"]:
            staged = min(numel, bucket)
        else:  # stage 3: every rank's chunks of the bucket's tensors (zero/scatter_grad_reducer.cpp)
            local = sum(chunks[first:end])
            staged = world_size * (min(max(1, bucket // world_size), local) if numel > bucket else local)
        largest = max(largest, staged)
    return (2 if overlap else 1) * largest * comm


def _host_buffer_bytes(owned, z, h, slots, largest_piece, largest_chunk) -> int:
    """The staging pool of offload (runtime/host_pool.h, pinned on GPUs), an upper bound: every
    offloaded gradient staged down in the model dtype; the updated 16-bit parameters staged up
    (or to NVMe); NVMe's staging buffers, offload_optimizer.buffer_count of the largest sub-group's
    master and state, offload_param.buffer_count of the largest parameter chunk."""
    out = 0
    if z.offload_optimizer != "none":
        out += h * owned
        if h != 4 and z.offload_param != "cpu":
            out += h * owned
    if z.offload_optimizer == "nvme":
        sub_group = min(owned, max(z.sub_group_size, largest_piece, 1))
        out += z.optimizer_buffer_count * _C.layout.swap_staging_bytes(4 * sub_group, slots)
        if h == 4:
            out += 4 * owned  # an fp32 model's new values leave the staging buffer through the pool
    if z.offload_param == "nvme":
        out += z.param_buffer_count * _C.layout.swap_staging_bytes(h * largest_chunk, 0)
    return out
