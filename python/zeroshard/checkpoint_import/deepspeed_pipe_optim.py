"""The optimizer state of a checkpoint written by DeepSpeed 0.19's PipelineEngine under ZeRO-1:
each stage's `[bf16_]zero_pp_rank_<dp>_mp_rank_<stage>_optim_states.pt`, flat partitions per
data-parallel rank read by deepspeed.py's DeepSpeedCheckpoint(stage=s), with the stage's parameter
names (`param_shapes` in `mp_rank_<stage>_model_states.pt`): a layer's "<index>.<rest>", a tie's
"tied_modules.<key>.<attr>" on every stage that uses it. PipelineOptimizerState names them as the
layer files' tensors are named (deepspeed_pipe.py), a tie by its first layer."""
import torch

from zeroshard.checkpoint_import.deepspeed import OPTIM_FILE_RE, DeepSpeedCheckpoint
from zeroshard.tied_names import TIED_MODULES, tie_prefix

__all__ = ["PipelineOptimizerState"]


class PipelineOptimizerState:
    """Opened with the checkpoint; unread says why it cannot be read into the run (None when it can
    or none was saved). bind_tie_keys() names the tensors; then has(key) / tensor(key) answer
    "master/<name>" and "optim/<state>/<name>" with full fp32 tensors."""

    def __init__(self, path, file_names, stage_files, zero_stage):
        self.path = path
        self.saved = (any(n.endswith("_optim_states.pt") for n in file_names)
                      or any(state.get("optimizer") is not None for state in stage_files))
        self._stages, self._unread = self._open(file_names, stage_files, zero_stage) if self.saved else (None, None)
        self._at, self._tie_unread = {}, None  # name -> (its stage's reader, the stage's name for it)

    def _open(self, file_names, stage_files, zero_stage):
        """(a reader per stage, None) when the state can be read, else (None, why not)."""
        where = f"{self.path} is a DeepSpeed pipeline checkpoint (ZeRO stage {zero_stage}), "
        if not any(OPTIM_FILE_RE.match(n) for n in file_names):
            return None, where + ("whose optimizer state is a torch state_dict per stage numbered by the stage's "
                                  "parameter order, which its files do not name; zeroshard reads it as ZeRO-1 "
                                  "saves it")
        if not all(isinstance(state.get("param_shapes"), list) for state in stage_files):
            return None, where + ("whose optimizer files do not name their parameters: DeepSpeed saves "
                                  "param_shapes under ZeRO only (bf16 at ZeRO stage 0 is its BF16_Optimizer's); "
                                  "zeroshard reads it as ZeRO-1 saves it")
        stages = []
        for s in range(len(stage_files)):
            try:
                stages.append(DeepSpeedCheckpoint(self.path, stage=s))
            except Exception as error:  # noqa: BLE001 - any damage: the weights still load without it
                return None, where + (f"whose stage {s} optimizer files (*mp_rank_{s:02d}_optim_states.pt) cannot "
                                      f"be read: {type(error).__name__}: {error}")
            if stages[-1].state_problem:
                return None, f"{self.path}: {stages[-1].state_problem}"
        states = {tuple(s.optimizer_state_names) for s in stages}
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in s.sections()["optimizer"]["param_groups"]]
                  for s in stages]
        if len(states) > 1:
            return None, where + f"whose stages' optimizers hold different states ({sorted(states)})"
        if any(g != groups[0] for g in groups):
            return None, where + ("whose stages' optimizers hold different param groups (" +
                                  "; ".join(f"stage {s}: {g}" for s, g in enumerate(groups)) +
                                  "); zeroshard loads one set of groups into every stage")
        return stages, None

    @property
    def unread(self):
        return self._unread or self._tie_unread

    def bind_tie_keys(self, keys, layer_tensor):
        """keys: {"tied_modules.<key>": "<its first layer>"}, the run's TiedLayerSpec keys.
        layer_tensor(name): the layer files' tensor of that name, or None. DeepSpeed keeps a tie on
        each stage that uses it; its state is read from the first stage whose fp32 master rounds to
        the weight the layer files give (the stages' copies of a tie's tied_weight_attr differ by
        rounding, its other tensors may differ more)."""
        self._at, self._tie_unread = {}, None
        holders = {}
        for stage in self._stages or []:
            for name in stage.param_names:
                prefix = tie_prefix(name)
                if prefix is not None and prefix not in keys:
                    self._tie_unread = (
                        f"{self.path} is a DeepSpeed pipeline checkpoint, which keeps a tie's optimizer state "
                        f"under its TiedLayerSpec key ({prefix}), and this run has no TiedLayerSpec "
                        f"{prefix[len(TIED_MODULES):]!r} to say which layers that is: load it into a "
                        "PipelineModule built with the same TiedLayerSpecs")
                    return
                plain = keys[prefix] + name[len(prefix):] if prefix else name
                holders.setdefault(plain, []).append((stage, name))
        for plain, held in holders.items():
            weight = layer_tensor(plain)
            matching = [h for h in held if weight is None or len(held) == 1
                        or torch.equal(h[0].tensor(f"master/{h[1]}").to(weight.dtype), weight)]
            if not matching:
                self._at, self._tie_unread = {}, (
                    f"{self.path}: no stage's fp32 master of {plain} ({held[0][1]} on {len(held)} stages) rounds to "
                    "the weight its layer file holds: its optimizer and layer files do not belong together")
                return
            self._at[plain] = matching[0]

    @property
    def state_names(self):
        return self._stages[0].optimizer_state_names if self._at else []

    def has(self, key):
        """key: "master/<name>" or "optim/<state>/<name>"."""
        kind, _, rest = key.partition("/")
        if kind == "optim":
            state, _, rest = rest.partition("/")
            if state not in self.state_names:
                return False
        return kind in ("master", "optim") and rest in self._at

    def tensor(self, key):
        """The full fp32 tensor of has()'s `key` (rebuilt from the stage's partitions at each call)."""
        head, rest = key.rsplit("/", 1) if key.startswith("optim/") else key.split("/", 1)
        stage, name = self._at[rest]
        return stage.tensor(f"{head}/{name}")

    def sections(self):
        """The optimizer (type, step, param groups) and loss scaler sections of stage 0's files, or
        empty ones where the state is not read."""
        if not self._at:
            return {"optimizer": {"type": None, "step": None, "param_groups": []}, "loss_scaler": {}}
        first = self._stages[0].sections()
        return {"optimizer": first["optimizer"], "loss_scaler": first["loss_scaler"]}
