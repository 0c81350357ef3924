"""The candidate setups of a plan (ZeRO stage x offload x pipeline stages), what each needs per GPU
and per node, whether it fits, its traffic per step, the order that picks the recommendation, and
the ds_config.json that runs it."""
import copy
import functools
import json
from dataclasses import dataclass, field

from zeroshard import _C
from zeroshard.pipe.schedule import build_schedule, pipeline_accepts
from zeroshard.planner.activations import decoder_activations
from zeroshard.planner.states import (DEFAULT_OPTIMIZER, DEVICE_CATEGORIES, DTYPE_BYTES, HOST_CATEGORIES,
                                      ZeroSettings, model_state_bytes)

# What a device or host keeps back from a plan: the CUDA context, the allocator's fragmentation and
# temporaries outside the categories (logits, attention workspace), and on the host the system and
# the data loaders; an NVMe drive keeps the same share back (the file system's own reserve and
# checkpoints beside the swap files). A setup fits when its total is within the rest.
RESERVE_FRACTION = 0.10

# Where offload_optimizer / offload_param can put their state, nearest the compute first.
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Setup:
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    pipeline_stages: int = 1

    @property
    def offload_rank(self) -> tuple:
        """The preference between offloads, fastest first: the furthest device anything is on
        (none, then CPU, then NVMe: ZeRO-Offload, then ZeRO-Infinity), then where the parameters
        are (they cross every micro-batch, the optimizer state once a step), then the optimizer."""
        opt, param = (OFFLOAD_DEVICES.index(d) for d in (self.offload_optimizer, self.offload_param))
        return max(opt, param), param, opt

    def name(self) -> str:
        parts = [f"zero{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt:{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param:{self.offload_param}")
        if self.pipeline_stages > 1:
            parts.append(f"pp{self.pipeline_stages}")
        return " ".join(parts)


@functools.lru_cache(maxsize=None)
def runtime_accepts(stage: int, offload_optimizer: str, offload_param: str) -> bool:
    """Whether the runtime builds this zero_optimization (zero/strategy.cpp's require_buildable,
    the one owner of which offload goes with which stage)."""
    z = {"stage": stage}
    for key, device in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if device != "none":
            z[key] = {"device": device, "nvme_path": "/plan"}
    try:
        _C.require_buildable(_C.parse_config(json.dumps({"zero_optimization": z}), "<plan>"))
    except _C.ConfigError:
        return False
    return True


def candidate_setups(pipeline_stages=(1,), nvme=True):
    """Every setup the runtime builds: each ZeRO stage with each (offload_optimizer,
    offload_param) pair runtime_accepts, and for pipelines the stages pipeline_accepts (pipe x
    data, optimizer offload included)."""
    out = []
    for pp in pipeline_stages:
        for stage in ZERO_STAGES:
            if pp > 1 and not pipeline_accepts(stage):
                continue
            setups = [Setup(stage, opt, param, pp) for opt in OFFLOAD_DEVICES for param in OFFLOAD_DEVICES
                      if (nvme or "nvme" not in (opt, param)) and runtime_accepts(stage, opt, param)]
            out += sorted(setups, key=lambda s: s.offload_rank)
    return out


@dataclass
class Hardware:
    gpus_per_node: int
    nodes: int
    device_bytes: int
    host_bytes: int
    nvme_bytes: int | None = None

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class StageNeeds:
    """One pipeline stage's bytes per GPU by category, its activations (None: not estimated), and
    what each of its GPUs moves per optimizer step."""
    bytes: dict
    activations: int | None          # no activation checkpointing
    activations_ckpt: int | None     # every layer checkpointed
    network_bytes: int = 0           # sent over the network
    offload_bytes: int = 0           # host<->device and disk

    def device_total(self, checkpointing: bool) -> int:
        act = self.activations_ckpt if checkpointing else self.activations
        return sum(self.bytes[c] for c in DEVICE_CATEGORIES) + (act or 0)


@dataclass
class Row:
    """One setup's needs. Bytes are per GPU (host and NVMe: this GPU's share); the table shows the
    heaviest pipeline stage, which without and with checkpointing can be different stages (under
    1F1B the first holds the most micro-batches in flight, the last the head)."""
    setup: Setup
    config: dict
    settings: ZeroSettings           # the config as the runtime parsed it
    stages: list                     # StageNeeds per pipeline stage
    micro_batches: int
    notes: list = field(default_factory=list)

    @property
    def network_bytes(self) -> int:
        """Sent per GPU per optimizer step, by the busiest stage."""
        return max(s.network_bytes for s in self.stages)

    @property
    def offload_bytes(self) -> int:
        """Host<->device and disk traffic per GPU per step, by the busiest stage."""
        return max(s.offload_bytes for s in self.stages)

    def heaviest(self, checkpointing: bool) -> StageNeeds:
        return max(self.stages, key=lambda s: s.device_total(checkpointing))

    @property
    def bytes(self) -> dict:
        return self.heaviest(False).bytes

    @property
    def activations(self) -> int | None:
        return self.heaviest(False).activations

    def device_total(self, checkpointing: bool) -> int:
        return self.heaviest(checkpointing).device_total(checkpointing)

    def host_total(self) -> int:
        return max(sum(s.bytes[c] for c in HOST_CATEGORIES) for s in self.stages)

    def nvme_total(self) -> int:
        return max(s.bytes["nvme"] for s in self.stages)

    def fits(self, hw: Hardware, checkpointing: bool) -> bool:
        usable = 1 - RESERVE_FRACTION
        if self.device_total(checkpointing) > hw.device_bytes * usable:
            return False
        if self.host_total() * hw.gpus_per_node > hw.host_bytes * usable:
            return False
        return not self.nvme_total() or (hw.nvme_bytes is not None and
                                         self.nvme_total() * hw.gpus_per_node <= hw.nvme_bytes * usable)

    def fit(self, hw: Hardware) -> str:
        """"yes", "ckpt" (only with activation checkpointing), "no", or "?" (the model states fit,
        the activations were not estimated: an nn.Module's)."""
        if self.activations is None:
            return "?" if self.fits(hw, False) else "no"
        return "yes" if self.fits(hw, False) else "ckpt" if self.fits(hw, True) else "no"

    def order_key(self, hw: Hardware):
        """The recommendation's order, fastest first: less offload (Setup.offload_rank); no
        activation checkpointing (it recomputes the forward); fewer pipeline stages (less bubble);
        the ZeRO stage that shards less (each sharding adds collectives: the optimizer state an
        all-gather per step, the gradients a reduction per micro-batch, the parameters gathers
        before every module); less network traffic per step."""
        return (self.setup.offload_rank, self.fit(hw) != "yes", self.setup.pipeline_stages,
                _sharding_rank(self.setup.stage), self.network_bytes)


def _sharding_rank(stage: int) -> int:
    """How many of the model states `stage` shards (stage_traits: optimizer state, gradients,
    parameters)."""
    t = _C.layout.stage_traits(stage)
    return t["shards_optimizer_state"] + (not t["keeps_full_grads"]) + t["partitions_params"]


def setup_config(setup: Setup, base: dict, micro_batch: int, micro_batches: int, precision: str | None,
                 optimizer: str | None, nvme_path: str, checkpointing: bool = False) -> dict:
    """The ds_config.json that runs `setup`: `base` (the user's config, or a minimal one) with the
    setup's zero_optimization, batch and pipeline keys set; `precision` (None: the config's)
    switches the bf16 / fp16 blocks on or off, keeping their other keys (loss scaling)."""
    cfg = copy.deepcopy(base)
    cfg.pop("train_batch_size", None)  # the world differs per setup; plan() notes it
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = micro_batches
    cfg.setdefault("optimizer", {"type": optimizer or DEFAULT_OPTIMIZER, "params": {"lr": 1e-4}})
    if precision is not None:
        for key in ("bf16", "fp16"):
            if key == precision or key in cfg:
                cfg[key] = dict(cfg.get(key, {}), enabled=key == precision)
    z = {k: v for k, v in cfg.get("zero_optimization", {}).items() if k not in ("offload_optimizer", "offload_param")}
    z["stage"] = setup.stage
    for key, device in (("offload_optimizer", setup.offload_optimizer), ("offload_param", setup.offload_param)):
        block = dict(base.get("zero_optimization", {}).get(key, {}))
        if device != "none":
            block["device"] = device
            block.setdefault("pin_memory", True)
            if device == "nvme":
                block.setdefault("nvme_path", nvme_path)
            z[key] = block
    cfg["zero_optimization"] = z
    if setup.pipeline_stages > 1:
        pipe = dict(cfg.get("pipeline", {}))
        pipe["stages"] = setup.pipeline_stages
        pipe["activation_checkpoint_interval"] = 1 if checkpointing else 0
        cfg["pipeline"] = pipe
    return cfg


def schedule_of(cfg: dict) -> tuple:
    """(pipeline.schedule, pipeline.virtual_stages) of `cfg` as the runtime resolves them, its
    defaults included."""
    pipe = {"pipeline": cfg.get("pipeline", {})}
    resolved = json.loads(_C.parse_config(json.dumps(pipe), "<plan>").resolved_json())["pipeline"]
    return resolved["schedule"], int(resolved["virtual_stages"])


@functools.lru_cache(maxsize=None)
def schedule_in_flight(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> tuple:
    """The most chunk-forwards (one micro-batch through one model chunk) each pipeline rank holds
    the activations of at once, from the schedule the runtime runs (_C.pipeline.build, as
    pipe/engine.py builds it): its report's peak_graphs, the forwards whose autograd graph is
    still alive (zero_bubble keeps it past the input-gradient pass until the weight pass; the
    other schedules free it with the activations). A ValueError, in config terms, for a shape
    the runtime refuses (interleaved_1f1b's micro-batches, virtual_stages of another schedule)."""
    _, report = build_schedule(schedule, pp, micro_batches, virtual_stages)
    return tuple(report["peak_graphs"])


def resolved_settings(cfg: dict) -> ZeroSettings:
    """The config as the runtime reads it (parsed by C++: a bad key fails here, with its name)."""
    return ZeroSettings.from_resolved(json.loads(_C.parse_config(json.dumps(cfg), "<plan>").resolved_json()))


def _stage_layers(spec, pp: int, virtual_stages: int = 1):
    """[(tensor indices, [layer range of each model chunk])] per pipeline rank: a PipelineModule's
    own partition (its model chunks s, s + pp, ... on rank s), else pp x virtual_stages chunks
    split by parameters as PipelineModule's default partition_method does. A tied tensor is on
    every stage that holds one of its layers."""
    if pp == 1:
        return [(list(range(len(spec.numels))), [(0, spec.num_layers)])]
    bounds = spec.pipeline_parts
    if bounds is None:
        from zeroshard.pipe.module import partition_layers
        counts = [0] * spec.num_layers
        for i, n in enumerate(spec.numels):
            for layer in spec.layers_of(i):
                counts[layer] += n
        bounds = partition_layers(range(spec.num_layers), pp * virtual_stages, "parameters", counts)
    stages = []
    for s in range(pp):
        ranges = [(bounds[g], bounds[g + 1]) for g in range(s, len(bounds) - 1, pp)]
        tensors = [i for i in range(len(spec.numels))
                   if any(lo <= layer < hi for layer in spec.layers_of(i) for lo, hi in ranges)]
        stages.append((tensors, ranges))
    return stages


def evaluate(setup: Setup, spec, world: int, cfg: dict, micro_batch: int, seq_len: int,
             micro_batches: int) -> Row:
    """One setup's Row: every pipeline stage's bytes and activations, the busiest one's traffic.
    A pipeline's schedule (the config's pipeline.schedule and virtual_stages) decides how many
    micro-batches each stage holds at once: a ValueError where the runtime refuses it."""
    z = resolved_settings(cfg)
    pp = setup.pipeline_stages
    schedule, virtual_stages = schedule_of(cfg) if pp > 1 else ("", 1)
    # Without a pipeline the engine runs each micro-batch's forward and backward before the next.
    in_flight = schedule_in_flight(schedule, pp, micro_batches, virtual_stages) if pp > 1 else (1,)
    dp = world // pp
    h = DTYPE_BYTES[z.precision]
    comm = DTYPE_BYTES.get(z.communication_data_type, h)
    dec = spec.decoder
    acts = decoder_activations(dec, micro_batch, seq_len, h) if dec else None
    stages = []
    layout = _stage_layers(spec, pp, virtual_stages)
    holders = [sum(i in tensors for tensors, _ in layout) for i in range(len(spec.numels))]
    for s, (tensors, ranges) in enumerate(layout):
        numels = [spec.numels[i] for i in tensors]
        b = model_state_bytes(numels, dp, z, spec.largest_module_numel(tensors))
        act = act_ckpt = None
        if acts is not None:
            act, act_ckpt = (_rank_activations(acts, spec, ranges, in_flight[s], ckpt) for ckpt in (False, True))
        net, off = traffic(z, numels, dp, micro_batches, h, comm)
        # A tied tensor's gradients are all-reduced once per step over the stages that hold it.
        net += sum(2 * (holders[i] - 1) / holders[i] * spec.numels[i] * comm for i in tensors if holders[i] > 1)
        if pp > 1 and dec:
            net += pipeline_send_bytes(s, pp, micro_batches, micro_batch * seq_len * dec.hidden * h,
                                       virtual_stages)
        stages.append(StageNeeds(b, act, act_ckpt, int(net), off))
    row = Row(setup, cfg, z, stages, micro_batches)
    if acts is None:
        row.notes.append("activations of an nn.Module are not estimated, so nothing is recommended (fits "
                         "? = the model states fit), nor is a pipeline's activation traffic in net/step: "
                         "give a Hugging Face-style config for a decoder")
    return row


def _rank_activations(acts, spec, ranges, held: int, checkpointing: bool) -> int:
    """A rank's activations: `held` chunk-forwards in flight (the schedule's), each at most the
    heaviest of the rank's model chunks `ranges` (exact with one chunk per rank). A chunk's
    decoder layers are its layers but the embedding (layer 0) and the head (the last), which it
    holds too where it has them."""
    decoder_layers = spec.decoder.layers
    return held * max(acts.peak(checkpointing, max(0, min(hi, decoder_layers + 1) - max(lo, 1)), lo == 0,
                                hi >= spec.num_layers) for lo, hi in ranges)


def pipeline_send_bytes(stage_index: int, pp: int, micro_batches: int, activation_bytes: int,
                        virtual_stages: int = 1) -> int:
    """What pipeline stage `stage_index` of `pp` sends point to point per step: each of its
    model chunks but the model's last its output forward, each but the model's first the
    gradient of its input back, once per micro-batch each (activation_bytes: one micro-batch's
    activation between chunks)."""
    forward = virtual_stages - (stage_index == pp - 1)
    backward = virtual_stages - (stage_index == 0)
    return (forward + backward) * micro_batches * activation_bytes


def traffic(z: ZeroSettings, numels, dp: int, micro_batches: int, h: int, comm: int):
    """(network bytes, offload bytes) one GPU moves per optimizer step, for ring collectives
    (each rank sends (dp - 1) / dp of the buffer per all-gather or reduce-scatter, twice that per
    all-reduce), by what the stage shards (_C.layout.stage_traits): whole gradients are
    all-reduced once per step, sharded ones every micro-batch (all-reduced into buckets, or
    reduce-scattered where the parameters are partitioned too); a sharded optimizer state
    all-gathers the updated parameters once per step; partitioned parameters are all-gathered
    for forward and again for backward every micro-batch, all but the persistent ones (whole on
    every rank), whose updated values are all-gathered once per step."""
    traits = _C.layout.stage_traits(z.stage)
    total, padded, _ = _C.layout.flat_layout(list(numels), dp)
    _, shard = _C.layout.chunk_layout(list(numels), dp)
    f = (dp - 1) / dp
    if traits["partitions_params"]:
        persistent = sum(n for n in numels if z.is_persistent(n))
        psi = shard * dp
        network = micro_batches * (f * psi * comm + 2 * f * (psi - persistent) * h) + f * persistent * h
        owned = shard
    else:
        # The gradients are reduced without the flat buffer's padding; the updated shards with it.
        reduces = 1 if traits["keeps_full_grads"] else micro_batches
        network = reduces * 2 * f * total * comm + (f * padded * h if traits["shards_optimizer_state"] else 0)
        owned = padded // dp if traits["shards_optimizer_state"] else padded
    offload = 0
    if z.offload_optimizer != "none":
        offload += h * owned * (1 if z.offload_param != "none" else 2)  # gradients down, parameters up
    if z.offload_optimizer == "nvme":
        slots = _C.layout.optimizer_state_slots(z.optimizer)
        offload += 2 * 4 * (1 + slots) * owned                          # master and state read, written
    if z.offload_param != "none":
        offload += micro_batches * 2 * h * shard                        # chunks up for both gathers
    return int(network), int(offload)
