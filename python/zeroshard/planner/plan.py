"""zeroshard.plan(): every setup's memory per GPU and per node, whether it fits the hardware, its
traffic per step, and the fastest setup that fits, with the ds_config.json that runs it."""
import json
import os
import re
from dataclasses import dataclass

from zeroshard.planner.model import model_spec
from zeroshard.planner.setups import (RESERVE_FRACTION, Hardware, candidate_setups, evaluate,
                                      resolved_settings, schedule_in_flight, schedule_of, setup_config)
from zeroshard.planner.states import HOST_CATEGORIES, model_state_bytes

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, what: str) -> int:
    """80GB (10^9), 80GiB (2^30), 1TB, or a number of bytes."""
    if isinstance(value, (int, float)) and value >= 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}: got {value!r}, expected a size such as 80GB, 80GiB, 1TB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


@dataclass
class Plan:
    model: str
    total_params: int
    hardware: Hardware
    rows: list
    recommended: object        # the Row, or None when nothing fits
    checkpointing: bool        # whether the recommendation needs activation checkpointing
    micro_batch: int
    seq_len: int

    def config(self) -> dict:
        """The recommended setup's ds_config.json (a ValueError when nothing is recommended)."""
        if self.recommended is None:
            raise ValueError("plan: nothing is recommended (nothing fits, or the activations are not "
                             "estimated); see the table's fits column and notes")
        return self.recommended.config

    def write_config(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.config(), f, indent=2)
            f.write("\n")

    def table(self) -> str:
        hw = self.hardware
        lines = [f"zeroshard plan: {self.model}, {self.total_params / 1e9:,.2f}B parameters, micro-batch "
                 f"{self.micro_batch} x {self.seq_len} tokens",
                 f"hardware: {hw.nodes} node(s) x {hw.gpus_per_node} GPUs, {gib(hw.device_bytes)} GiB per GPU, "
                 f"{gib(hw.host_bytes)} GiB host per node" +
                 (f", {gib(hw.nvme_bytes)} GiB NVMe per node" if hw.nvme_bytes is not None else ", no NVMe"),
                 f"GiB per GPU (the heaviest pipeline stage); host and NVMe per node; fits within "
                 f"{100 - RESERVE_FRACTION * 100:.0f}% of each; traffic per GPU per optimizer step",
                 ""]
        head = ("setup", "params", "grads", "master", "optim", "gather", "buffers", "act", "act-ckpt",
                "GPU total", "host/node", "nvme/node", "net/step", "offload/step", "fits")
        body = []
        for r in self.rows:
            # The per-GPU columns are one stage's, the one whose GPU total is shown: with
            # checkpointing ("ckpt") the heaviest checkpointed stage, which can differ from the
            # heaviest without. host/node, nvme/node and the traffic: the most of any stage.
            shown = r.heaviest(r.fit(hw) == "ckpt")
            b, node = shown.bytes, hw.gpus_per_node
            body.append((r.setup.name(), gib(b["parameters"]), gib(b["gradients"]), gib(b["master_weights"]),
                         gib(b["optimizer_state"]), gib(b["gathered_parameters"]), gib(b["comm_buffers"]),
                         gib(shown.activations), gib(shown.activations_ckpt),
                         gib(shown.device_total(r.fit(hw) == "ckpt")), gib(r.host_total() * node),
                         gib(r.nvme_total() * node), gib(r.network_bytes), gib(r.offload_bytes), r.fit(hw)))
        widths = [max(len(str(x[i])) for x in [head] + body) for i in range(len(head))]
        fmt = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                                      for i, (c, w) in enumerate(zip(cells, widths)))
        lines += [fmt(head)] + [fmt(c) for c in body]
        lines.append("")
        lines.append("fits: yes; ckpt = only with activation checkpointing (every layer); no; ? = the model "
                     "states fit, activations unknown. host/node: master, optimizer state, parameter chunks "
                     "and pinned staging of the node's GPUs.")
        notes = sorted({n for r in self.rows for n in r.notes})
        lines += [f"note: {n}" for n in notes]
        if self.recommended is None and any(r.fit(hw) == "?" for r in self.rows):
            lines.append("recommended: nothing (the activations are not estimated)")
        elif self.recommended is None:
            lines.append("recommended: nothing fits; more GPUs, NVMe (--nvme), or a smaller micro-batch")
        else:
            r = self.recommended
            how = ", with activation checkpointing" if self.checkpointing else ""
            lines.append(f"recommended: {r.setup.name()}{how} (the fastest that fits: no offload before "
                         "CPU before NVMe, no checkpointing, fewer pipeline stages, lower ZeRO stage, less traffic)")
        return "\n".join(lines)

    def __str__(self):
        return self.table()


def plan(model, *, gpus_per_node: int, nodes: int = 1, device_memory, host_memory, nvme_space=None,
         micro_batch: int = 1, seq_len: int | None = None, gradient_accumulation_steps: int = 1,
         precision: str | None = None, optimizer: str | None = None, config=None, pipeline_stages=None,
         nvme_path: str = "/local_nvme", name: str = "") -> Plan:
    """Plans `model` on `nodes` x `gpus_per_node` GPUs.

    model: an nn.Module (build it under `with torch.device("meta"):` so nothing is allocated), a
      layer list / nn.Sequential (pipelines are planned for it), a zeroshard.pipe.PipelineModule
      (planned with its own num_stages and partition), a Hugging Face-style config (dict, path to
      config.json, PretrainedConfig) or a Decoder (then activations are estimated too; without
      them nothing is recommended).
    device_memory, host_memory (per node), nvme_space (per node; None: no NVMe setups): bytes or
      "80GB" / "80GiB". config: a ds_config (dict or path) whose other keys (bucket sizes, live
      cap, persistence threshold, optimizer, precision blocks) the setups keep. precision: "bf16",
      "fp16" or "fp32" (default: the config's, else bf16); optimizer: the type when the config
      names none (default AdamW). pipeline_stages: the stage counts to consider (default: 1, and
      for layer lists the powers of two up to the GPUs and layers)."""
    spec = model_spec(model, name)
    if not spec.numels:
        raise ValueError("plan: the model has no trainable parameters")
    for what, v in (("gpus_per_node", gpus_per_node), ("nodes", nodes), ("micro_batch", micro_batch),
                    ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"plan: {what}: got {v!r}, expected an integer >= 1")
    hw = Hardware(gpus_per_node, nodes, parse_bytes(device_memory, "device_memory"),
                  parse_bytes(host_memory, "host_memory"),
                  None if nvme_space is None else parse_bytes(nvme_space, "nvme_space"))
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    base = _with_module_chunks(dict(config or {}), spec)
    if precision is None and not any(base.get(k, {}).get("enabled") for k in ("bf16", "fp16")):
        precision = "bf16" if not any(k in base for k in ("bf16", "fp16")) else None
    if precision not in (None, "fp32", "bf16", "fp16"):
        raise ValueError(f"plan: precision: got {precision!r}, expected one of fp32, bf16, fp16")
    named = (base.get("optimizer") or {}).get("type")
    if optimizer is not None and named is not None and optimizer.lower() != str(named).lower():
        raise ValueError(f"plan: optimizer: got {optimizer!r}, but the config's optimizer.type is {named!r}; "
                         "give one of them")
    pipeline_stages = _pipeline_stages(spec, pipeline_stages, hw)
    if seq_len is None:
        seq_len = spec.decoder.seq_len if spec.decoder else 1
    notes = []
    if "train_batch_size" in base:
        notes.append("train_batch_size is left out of the written config (the world differs per setup); "
                     "train_micro_batch_size_per_gpu and gradient_accumulation_steps give the batch")
    pipeline_stages = _runnable_stages(pipeline_stages, spec, hw, notes, base, gradient_accumulation_steps)
    rows = []
    for setup in candidate_setups(pipeline_stages, nvme=hw.nvme_bytes is not None):
        pp = setup.pipeline_stages
        micro_batches = _micro_batches(pp, gradient_accumulation_steps)
        cfg = setup_config(setup, base, micro_batch, micro_batches, precision, optimizer, nvme_path)
        row = evaluate(setup, spec, hw.gpus, cfg, micro_batch, seq_len, micro_batches)
        row.notes += notes
        if micro_batches != gradient_accumulation_steps:
            row.notes.append(f"pipeline setups run gradient_accumulation_steps = the stages "
                             f"(not {gradient_accumulation_steps}): fewer micro-batches than stages is all bubble")
        if row.settings.offload_optimizer != "none" and row.settings.offload_ratio < 1:
            row.notes.append("offload_optimizer.ratio < 1 is planned as 1 (everything offloaded): the GPU "
                             "keeps the first sub-groups' master and state, more than shown")
        if row.fit(hw) == "ckpt":
            if pp > 1:
                row.config = setup_config(setup, base, micro_batch, micro_batches, precision, optimizer,
                                          nvme_path, checkpointing=True)
            else:
                row.notes.append("ckpt without a pipeline: the model's forward must checkpoint every layer "
                                 "(zeroshard.checkpointing.checkpoint); no config key switches it on")
        rows.append(row)
    fitting = [r for r in rows if r.fit(hw) in ("yes", "ckpt")]
    best = min(fitting, key=lambda r: r.order_key(hw)) if fitting else None
    return Plan(spec.name, spec.total_numel, hw, rows, best, best is not None and best.fit(hw) == "ckpt",
                micro_batch, seq_len)


def _micro_batches(pp: int, gradient_accumulation_steps: int) -> int:
    """A pipeline runs at least as many micro-batches as stages, or it is all bubble."""
    return max(gradient_accumulation_steps, pp) if pp > 1 else gradient_accumulation_steps


def _with_module_chunks(base: dict, spec) -> dict:
    """A PipelineModule built with virtual_stages > 1 runs only under a config that says so (the
    engine refuses another count), interleaved unless the config names a schedule: the planned
    and written configs carry it."""
    chunks = spec.pipeline_virtual_stages
    if chunks == 1:
        return base
    pipe = dict(base.get("pipeline", {}))
    if pipe.get("virtual_stages", chunks) != chunks:
        raise ValueError(f"plan: config: pipeline.virtual_stages: got {pipe['virtual_stages']}, the "
                         f"PipelineModule was built with virtual_stages={chunks}; give the same to both")
    pipe["virtual_stages"] = chunks
    pipe.setdefault("schedule", "interleaved_1f1b")
    return {**base, "pipeline": pipe}


def _runnable_stages(asked: list, spec, hw: Hardware, notes: list, base: dict,
                     gradient_accumulation_steps: int) -> list:
    """The pipeline stage counts that can run on hw.gpus GPUs: each divides the GPU count (a
    pipe x data grid), has a layer per model chunk, and gives a shape the config's schedule runs
    (_C.pipeline.build refuses, for one, interleaved_1f1b micro-batches that are not a multiple
    of the stages). Those left out are noted; none left is an error that names them."""
    schedule, virtual_stages = schedule_of(base)

    def why_not(pp):
        if hw.gpus % pp:
            return f"{hw.gpus} GPUs ({hw.nodes} x {hw.gpus_per_node}) are not a multiple of it"
        if pp == 1:
            return ""
        chunks = pp * (1 if spec.pipeline_parts else virtual_stages)  # a PipelineModule's are built
        if chunks > spec.num_layers:
            return (f"the model has {spec.num_layers} layers, fewer than " +
                    ("stages" if chunks == pp else f"its {chunks} model chunks (stages x pipeline.virtual_stages)"))
        try:
            schedule_in_flight(schedule, pp, _micro_batches(pp, gradient_accumulation_steps), virtual_stages)
        except ValueError as error:
            return str(error)
        return ""
    why = {pp: why_not(pp) for pp in asked}
    runnable = [pp for pp in asked if not why[pp]]
    left_out = "; ".join(f"{pp} stages: {why[pp]}" for pp in asked if why[pp])
    if not runnable:
        fix = (f"build the PipelineModule with a num_stages that divides the {hw.gpus} GPUs" if spec.pipeline_parts
               else f"give a stage count that divides the {hw.gpus} GPUs")
        raise ValueError(f"plan: pipeline_stages: got {list(asked)}, and none can run ({left_out})" +
                         (f"; {fix}" if any(hw.gpus % pp for pp in asked) else ""))
    if left_out:
        notes.append(f"pipeline stages not planned: {left_out}")
    return runnable


def _pipeline_stages(spec, asked, hw) -> list:
    """The pipeline stage counts to plan: a PipelineModule's own; for a layer list the ones asked
    for, by default 1 and the powers of two up to the GPUs and layers; 1 for anything else."""
    if spec.pipeline_stages:
        if asked is not None and list(asked) != [spec.pipeline_stages]:
            raise ValueError(f"plan: pipeline_stages: got {list(asked)}, but the PipelineModule has "
                             f"num_stages {spec.pipeline_stages}, which the engine requires")
        return [spec.pipeline_stages]
    if asked is not None:
        if any(not isinstance(pp, int) or pp < 1 for pp in asked):
            raise ValueError(f"plan: pipeline_stages: got {list(asked)}, expected integers >= 1")
        if not spec.num_layers and any(pp > 1 for pp in asked):
            raise ValueError(f"plan: pipeline_stages: got {list(asked)}, but the model is an nn.Module, not "
                             "a layer list or PipelineModule; it cannot be split into stages")
        return list(asked)
    stages = [1]
    if spec.num_layers and spec.decoder is None:
        while stages[-1] * 2 <= min(hw.gpus, spec.num_layers):
            stages.append(stages[-1] * 2)
    return stages


# host_bytes_per_node models a model known only by its size as tensors of this many elements (a
# 4096 x 4096 projection): the NVMe staging buffers are sized by the largest tensor piece.
_UNSHAPED_TENSOR_NUMEL = 4096 * 4096


def host_bytes_per_node(config_dict: dict, num_params: int, gpus_per_node: int, nodes: int = 1) -> int:
    """Host memory one node needs for the offload `config_dict` sets up (the planner's host
    categories: offloaded master, optimizer state, parameter chunks and pinned staging buffers of
    its gpus_per_node ranks) for a model of `num_params` trainable parameters in one group, on a
    data-parallel world of gpus_per_node x nodes. 0 without offload. For the preflight check."""
    if not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"host_bytes_per_node: num_params: got {num_params!r}, expected an integer >= 0")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1 or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"host_bytes_per_node: gpus_per_node {gpus_per_node!r} and nodes {nodes!r}: "
                         "expected integers >= 1")
    if num_params == 0:
        return 0
    whole, rest = divmod(num_params, _UNSHAPED_TENSOR_NUMEL)
    numels = [_UNSHAPED_TENSOR_NUMEL] * whole + ([rest] if rest else [])
    z = resolved_settings(config_dict)
    b = model_state_bytes(numels, gpus_per_node * nodes, z, min(num_params, _UNSHAPED_TENSOR_NUMEL))
    return gpus_per_node * sum(b[c] for c in HOST_CATEGORIES)
