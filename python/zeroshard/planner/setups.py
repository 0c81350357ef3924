"""The candidate setups of a plan (ZeRO stage x offload x pipeline stages), what each needs per GPU
and per node, whether it fits, its traffic per step, the order that picks the recommendation, and
the ds_config.json that runs it."""
import copy
import json
from dataclasses import dataclass, field

from zeroshard import _C
from zeroshard.planner.activations import decoder_activations
from zeroshard.planner.states import (DEVICE_CATEGORIES, DTYPE_BYTES, HOST_CATEGORIES, ZeroSettings,
                                      model_state_bytes)

# What a device or host keeps back from a plan: the CUDA context, the allocator's fragmentation and
# temporaries outside the categories (logits, attention workspace), and on the host the system and
# the data loaders. A setup fits when its total is within the rest.
RESERVE_FRACTION = 0.10

# (offload_optimizer, offload_param) in the order of preference: each step moves more state further
# from the compute and costs more time per step (ZeRO-Offload, then ZeRO-Infinity).
OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme"))


@dataclass(frozen=True)
class Setup:
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    pipeline_stages: int = 1

    @property
    def offload_rank(self) -> int:
        return OFFLOADS.index((self.offload_optimizer, self.offload_param))

    def name(self) -> str:
        parts = [f"zero{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt:{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param:{self.offload_param}")
        if self.pipeline_stages > 1:
            parts.append(f"pp{self.pipeline_stages}")
        return " ".join(parts)


def candidate_setups(pipeline_stages=(1,), nvme=True):
    """Every setup zeroshard runs: offload_optimizer at stages 1-3, offload_param at stage 3 (with
    optimizer offload), pipelines with ZeRO 0 or 1 and no offload (pipe x data)."""
    out = []
    for pp in pipeline_stages:
        for stage in range(4):
            if pp > 1 and stage > 1:
                continue
            for opt, param in OFFLOADS:
                if (opt != "none" and (stage == 0 or pp > 1)) or (param != "none" and stage != 3):
                    continue
                if "nvme" in (opt, param) and not nvme:
                    continue
                out.append(Setup(stage, opt, param, pp))
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
class Row:
    """One setup's needs. Bytes are per GPU (host and NVMe: this GPU's share); *_node are per node."""
    setup: Setup
    config: dict
    bytes: dict                      # category -> bytes per GPU (the heaviest pipeline stage)
    activations: int | None          # per GPU, no activation checkpointing (None: not estimated)
    activations_ckpt: int | None     # per GPU, every layer checkpointed
    network_bytes: int               # sent per GPU per optimizer step
    offload_bytes: int               # host<->device and disk traffic per GPU per step
    micro_batches: int
    # GPU total of the heaviest stage without and with checkpointing: with a pipeline the two
    # can be different stages (the first holds the most micro-batches, the last the head).
    device_peaks: tuple = (0, 0)
    notes: list = field(default_factory=list)

    def device_total(self, checkpointing: bool) -> int:
        return self.device_peaks[1 if checkpointing else 0]

    def host_total(self) -> int:
        return sum(self.bytes[c] for c in HOST_CATEGORIES)

    def fits(self, hw: Hardware, checkpointing: bool) -> bool:
        usable = 1 - RESERVE_FRACTION
        if self.device_total(checkpointing) > hw.device_bytes * usable:
            return False
        if self.host_total() * hw.gpus_per_node > hw.host_bytes * usable:
            return False
        return not self.bytes["nvme"] or (hw.nvme_bytes is not None and
                                          self.bytes["nvme"] * hw.gpus_per_node <= hw.nvme_bytes)

    def fit(self, hw: Hardware) -> str:
        """"yes", "ckpt" (only with activation checkpointing), "no", or "?" (the model states fit,
        the activations were not estimated: an nn.Module's)."""
        if self.activations is None:
            return "?" if self.fits(hw, False) else "no"
        return "yes" if self.fits(hw, False) else "ckpt" if self.fits(hw, True) else "no"

    def order_key(self, hw: Hardware):
        """The recommendation's order, fastest first: less offload; no activation checkpointing
        (it recomputes the forward); fewer pipeline stages (less bubble); the lower ZeRO stage
        (each stage adds collectives: stage 1 an all-gather per step, stage 2 a reduction per
        micro-batch, stage 3 gathers before every module); less network traffic per step."""
        return (self.setup.offload_rank, self.fit(hw) != "yes", self.setup.pipeline_stages,
                self.setup.stage, self.network_bytes)


def setup_config(setup: Setup, base: dict, micro_batch: int, micro_batches: int, precision: str | None,
                 optimizer: str | None, nvme_path: str, checkpointing: bool = False) -> dict:
    """The ds_config.json that runs `setup`: `base` (the user's config, or a minimal one) with the
    setup's zero_optimization, batch and pipeline keys set; `precision` (None: the config's)
    switches the bf16 / fp16 blocks on or off, keeping their other keys (loss scaling)."""
    cfg = copy.deepcopy(base)
    cfg.pop("train_batch_size", None)  # the world differs per setup; plan() notes it
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = micro_batches
    cfg.setdefault("optimizer", {"type": optimizer or "AdamW", "params": {"lr": 1e-4}})
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


def resolved_settings(cfg: dict) -> ZeroSettings:
    """The config as the runtime reads it (parsed by C++: a bad key fails here, with its name)."""
    return ZeroSettings.from_resolved(json.loads(_C.parse_config(json.dumps(cfg), "<plan>").resolved_json()))


def _stage_layers(spec, pp: int):
    """[(tensor indices, layer range)] per pipeline rank: a PipelineModule's own partition (its
    model chunks s, s + pp, ... on rank s), else split by parameters as PipelineModule's default
    partition_method does."""
    if pp == 1:
        return [(list(range(len(spec.numels))), (0, spec.num_layers))]
    bounds = spec.pipeline_parts
    if bounds is None:
        from zeroshard.pipe.module import partition_layers
        counts = [0] * spec.num_layers
        for n, layer in zip(spec.numels, spec.layer_of):
            counts[layer] += n
        bounds = partition_layers(range(spec.num_layers), pp, "parameters", counts)
    stages = []
    for s in range(pp):
        ranges = [(bounds[g], bounds[g + 1]) for g in range(s, len(bounds) - 1, pp)]
        tensors = [i for i, layer in enumerate(spec.layer_of) if any(lo <= layer < hi for lo, hi in ranges)]
        stages.append((tensors, (ranges[0][0], ranges[-1][1])))
    return stages


def evaluate(setup: Setup, spec, world: int, cfg: dict, micro_batch: int, seq_len: int,
             micro_batches: int) -> Row:
    """One setup's Row: the heaviest pipeline stage's bytes, activations and traffic."""
    z = resolved_settings(cfg)
    pp = setup.pipeline_stages
    dp = world // pp
    h = DTYPE_BYTES[z.precision]
    comm = DTYPE_BYTES.get(z.communication_data_type, h)
    dec = spec.decoder
    acts = decoder_activations(dec, micro_batch, seq_len, h) if dec else None
    best, peak_ckpt = None, 0
    for s, (tensors, (lo, hi)) in enumerate(_stage_layers(spec, pp)):
        numels = [spec.numels[i] for i in tensors]
        largest = _largest_module(spec, tensors)
        b = model_state_bytes(numels, dp, z, largest)
        act = act_ckpt = None
        if acts is not None:
            # Decoder layers of this stage (layer 0 is the embedding, the last the head), and the
            # micro-batches a 1F1B stage holds at once: pp - s, at most all of them.
            inflight = min(pp - s, micro_batches)
            n = max(0, min(hi, dec.layers + 1) - max(lo, 1)) if pp > 1 else dec.layers
            first, last = lo == 0, hi >= spec.num_layers or pp == 1
            act = inflight * acts.peak(False, n, first, last)
            act_ckpt = inflight * acts.peak(True, n, first, last)
        states = sum(b[c] for c in DEVICE_CATEGORIES)
        peak_ckpt = max(peak_ckpt, states + (act_ckpt or 0))
        if best is None or states + (act or 0) > best[0]:
            best = (states + (act or 0), b, act, act_ckpt, numels)
    peak, b, act, act_ckpt, numels = best
    network, offload = traffic(setup, z, numels, dp, micro_batches, h, comm)
    if pp > 1 and dec:
        network += 2 * micro_batches * micro_batch * seq_len * dec.hidden * h  # activations and their gradients
    row = Row(setup, cfg, b, act, act_ckpt, network, offload, micro_batches, (peak, peak_ckpt))
    if acts is None:
        row.notes.append("activations of an nn.Module are not estimated, so nothing is recommended (fits "
                         "? = the model states fit): give a Hugging Face-style config for a decoder")
    return row


def _largest_module(spec, tensors) -> int:
    per = {}
    for i in tensors:
        per[spec.modules[i]] = per.get(spec.modules[i], 0) + spec.numels[i]
    return max(per.values(), default=0)


def traffic(setup: Setup, z: ZeroSettings, numels, dp: int, micro_batches: int, h: int, comm: int):
    """(network bytes, offload bytes) one GPU moves per optimizer step, for ring collectives
    (each rank sends (dp - 1) / dp of the buffer per all-gather or reduce-scatter, twice that per
    all-reduce). Stages 0-1 all-reduce the gradients once per step and stage 1 all-gathers the
    updated parameters; stage 2 all-reduces its buckets every micro-batch; stage 3 reduce-scatters
    every micro-batch and all-gathers the non-persistent parameters for forward and for backward."""
    total, padded, _ = _C.layout.flat_layout(list(numels), dp)
    chunks, shard = _C.layout.chunk_layout(list(numels), dp)
    f = (dp - 1) / dp
    if setup.stage == 3:
        persistent = sum(n for n in numels if n < z.stage3_param_persistence_threshold)
        psi = shard * dp
        network = micro_batches * (f * psi * comm + 2 * f * (psi - persistent) * h) + f * persistent * h
        owned = shard
    else:
        psi = padded
        reduces = micro_batches if setup.stage == 2 else 1
        network = reduces * 2 * f * psi * comm + (f * psi * h if setup.stage >= 1 else 0)
        owned = padded // dp if setup.stage >= 1 else padded
    offload = 0
    if z.offload_optimizer != "none":
        offload += h * owned * (1 if z.offload_param != "none" else 2)  # gradients down, parameters up
    if z.offload_optimizer == "nvme":
        slots = _C.layout.optimizer_state_slots(z.optimizer)
        offload += 2 * 4 * (1 + slots) * owned                          # master and state read, written
    if z.offload_param != "none":
        offload += micro_batches * 2 * h * shard                        # chunks up for both gathers
    return int(network), int(offload)
