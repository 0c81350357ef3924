"""The optimizer object initialize() returns: torch-style param_groups (lr, betas, ... that users and
schedulers edit) in front of the C++ ZeroOptimizer, which owns every buffer and runs the step."""
import json
import zlib

import torch
import torch.distributed as dist

from zeroshard import _C
from zeroshard.dtypes import PRECISION_OF

# torch.optim classes whose update the C++ kernels reproduce, with the spec they map to.
_CLIENT_TYPES = {
    # torch.optim.Adam(decoupled_weight_decay=True) is AdamW.
    "Adam": lambda opt: ({"type": "AdamW", "adam_w_mode": True} if opt.defaults.get("decoupled_weight_decay")
                         else {"type": "Adam", "adam_w_mode": False}),
    "AdamW": lambda opt: {"type": "AdamW", "adam_w_mode": True},
    "SGD": lambda opt: {"type": "SGD"},
    "Adagrad": lambda opt: {"type": "Adagrad",
                            "initial_accumulator_value": opt.defaults.get("initial_accumulator_value", 0.0)},
    # zeroshard.ops / DeepSpeed CPU optimizers built by the user's script.
    "CPUAdam": lambda opt: {"type": "AdamW" if opt.defaults.get("adamw_mode", True) else "Adam",
                            "adam_w_mode": opt.defaults.get("adamw_mode", True),
                            "bias_correction": opt.defaults.get("bias_correction", True)},
    "CPUAdagrad": lambda opt: {"type": "Adagrad"},
    "CPULion": lambda opt: {"type": "Lion"},
}
_CLIENT_TYPES["DeepSpeedCPUAdam"] = _CLIENT_TYPES["CPUAdam"]
_CLIENT_TYPES["DeepSpeedCPUAdagrad"] = _CLIENT_TYPES["CPUAdagrad"]
_CLIENT_TYPES["DeepSpeedCPULion"] = _CLIENT_TYPES["CPULion"]

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


# Client optimizers that DeepSpeed takes with offload_optimizer while zero_force_ds_cpu_optimizer
# is true: its CPU optimizers (and zeroshard.ops' own names for them); DeepSpeed leaves out its
# CPU Adagrad, which is as much a host optimizer as the others.
_CPU_OPTIMIZERS = ("DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion", "CPUAdam", "CPUAdagrad", "CPULion")


def client_optimizer_spec(opt: torch.optim.Optimizer, settings: dict) -> dict:
    """The kernel spec a client optimizer maps to; `settings` is _C.engine_settings(config)."""
    name = type(opt).__name__
    # By exact class, as _CLIENT_TYPES maps them: a subclass may change the update, so it is
    # refused below whatever this rule says (DeepSpeed's isinstance would take it).
    if (settings["offload_optimizer"] != "none" and settings["zero_force_ds_cpu_optimizer"]
            and name not in _CPU_OPTIMIZERS):
        # DeepSpeed's rule, kept so a config behaves the same on both. zeroshard would step a
        # torch optimizer on its own host kernels anyway, so false loses nothing here.
        raise ValueError(
            f"optimizer: a client {name} with zero_optimization.offload_optimizer.device "
            f"\"{settings['offload_optimizer']}\" is refused while \"zero_force_ds_cpu_optimizer\" is "
            "true (the default, as in DeepSpeed): pass zeroshard.ops.adam.DeepSpeedCPUAdam (or "
            "DeepSpeedCPUAdagrad / DeepSpeedCPULion), name the optimizer in the config's "
            "\"optimizer\" block, or set "
            "\"zero_force_ds_cpu_optimizer\": false; the step is the same host kernel either way")
    if name not in _CLIENT_TYPES:
        raise ValueError(
            f"optimizer: a client {name} cannot run on zeroshard's sharded step; pass one of "
            f"{', '.join(sorted(_CLIENT_TYPES))}, or name the optimizer in the config's "
            f"\"optimizer\" block")
    for flag in _UNSUPPORTED_FLAGS:
        if opt.defaults.get(flag) or any(g.get(flag) for g in opt.param_groups):
            raise ValueError(f"optimizer: {name}({flag}=True) is not supported by zeroshard")
    # One kernel for every group: a flag that picks the update's form must agree across groups.
    for flag in ("decoupled_weight_decay", "adamw_mode", "bias_correction"):
        values = {bool(g[flag]) for g in opt.param_groups if flag in g}
        if len(values) > 1:
            raise ValueError(f"optimizer: {name}'s param_groups differ in {flag}; zeroshard steps "
                             "every group with one form of the update, so it must be the same in all")
    return _CLIENT_TYPES[name](opt)


def held_groups(param_groups) -> list:
    """The groups the C++ core holds, as indices into param_groups: those with parameters to train."""
    return [i for i, g in enumerate(param_groups) if g["params"]]


def _json_value(v):
    """A value JSON cannot hold: a tensor's or numpy scalar's numbers, else its type's name (a
    repr may hold an address, which differs between processes)."""
    return v.tolist() if hasattr(v, "tolist") else type(v).__name__


def group_fingerprint(group) -> float:
    """A param group's hyper-parameters as one number (CRC32 of their sorted JSON), which ranks
    compare to see whether they passed the same group at one place. Left out: what names or holds
    the parameters, which differ by stage (torch's "param_names", a script's list of names). Groups
    alike in every hyper-parameter count as the same group, whatever they hold."""
    hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")
             and not (isinstance(v, (list, tuple)) and v and all(isinstance(x, str) for x in v))}
    try:
        text = json.dumps(hyper, sort_keys=True, default=_json_value)
    except (TypeError, ValueError):  # keys JSON cannot sort: the keys' names alone
        text = json.dumps(sorted(map(str, hyper)))
    return float(zlib.crc32(text.encode()))


class ZeroShardOptimizer(torch.optim.Optimizer):
    """What `initialize` returns as its optimizer (DeepSpeed returns its ZeRO optimizer here). A
    torch.optim.Optimizer so torch and Hugging Face schedulers accept it; its param_groups hold the
    hyperparameters the next step uses, while every buffer lives in the C++ core.

    param_groups are the script's groups in its order, each group's "params" its trainable ones. A
    group whose parameters are all frozen stays, with none (DeepSpeed's engine keeps it too); one
    passed with no parameters at all is removed (as DeepSpeed's engine removes it), except in a
    pipeline where some stage passed parameters in it (pipe/engine.py), so that every stage numbers
    the groups alike (`numbered_alike`) and a scheduler sees the same groups on each. The core holds
    only the groups with parameters (`held_groups`)."""

    def __init__(self, core, param_groups, numbered_alike=True):
        # torch's constructor would re-add the groups and build per-parameter state; the C++ core
        # owns the state, so only the attributes schedulers and scripts read are set here.
        self.core = core
        self.param_groups = param_groups
        self.held_groups = held_groups(param_groups)
        self.numbered_alike = numbered_alike
        self.defaults = {k: v for k, v in param_groups[0].items() if k != "params"}
        self.state = {}
        self._opt_called = False
        self.last_step = None  # the engine's last StepResult (applied, grad_norm, loss_scale)

    @property
    def overflow(self) -> bool:
        """DeepSpeed's fp16 and ZeRO optimizers' flag, which Megatron and GPT-NeoX read every step:
        whether the last step was skipped for an fp16 gradient overflow."""
        return self.last_step is not None and not self.last_step.applied

    @property
    def loss_scale(self) -> float:
        return self.core.state.loss_scale

    cur_scale = loss_scale

    def zero_grad(self, set_to_none: bool = True):
        # The engine's zero_grad: stages 0/1 set param.grad to None whatever set_to_none says (the
        # flat buffer behind it is rewritten by the next backward, not cleared); stages 2/3 zero
        # the owned gradient shards.
        self.core.zero_grad()
        if self.core.strategy.keeps_full_grads:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

    def apply_step(self, samples: int, duplicate_sum_sq: float = 0.0):
        """The core's step with the hyperparameters of the groups it holds (the engine's step at the
        accumulation boundary; `duplicate_sum_sq`: see pipe/engine.py); sets and returns last_step."""
        hypers = [{k: v for k, v in self.param_groups[i].items() if k != "params"} for i in self.held_groups]
        self.last_step = self.core.step(hypers, samples, duplicate_sum_sq, group_numbers=self.held_groups)
        return self.last_step

    def add_param_group(self, param_group):
        raise ValueError("optimizer.add_param_group: zeroshard's parameter groups are fixed at "
                         "initialize(), where their parameters are flattened and sharded; pass every "
                         "group to initialize (model_parameters or the client optimizer)")

    def step(self, closure=None):
        raise RuntimeError("call engine.step(), not optimizer.step(): the engine runs the "
                           "sharded step at the gradient accumulation boundary")

    # ----- this rank's state, as DeepSpeed's ZeRO optimizers give it -----
    def _layout(self) -> dict:
        dtype = self.param_groups[self.held_groups[0]]["params"][0].dtype  # the model's (a chunk at stage 3)
        return {"world_size": dist.get_world_size(), "rank": dist.get_rank(),
                "zero_stage": self.core.strategy.stage, "precision": PRECISION_OF[dtype],
                "optimizer": self.core.optimizer_type}

    def state_dict(self) -> dict:
        """This rank's part of the optimizer (as DeepSpeed's ZeRO optimizers return it): the values
        it holds (its parameter chunks or copies, fp32 masters, optimizer state), copied, with the
        parameter groups' hyperparameters and the training state. load_state_dict restores it on
        the same rank of a run of the same world size, stage, precision and optimizer; to resume
        at another world size, stage or precision, use engine.save_checkpoint / load_checkpoint,
        which reshard."""
        stepped = any(n > 0 for n in self.core.state.state_dict()["group_steps"])
        live = self.core.shard_entries(stepped)
        try:
            entries = {f"{kind}/{index}/{begin}": values.detach().clone() for kind, index, begin, values, _ in live}
        finally:
            self.core.end_entries(False)
        groups = []
        first = 0
        for g in self.param_groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            hyper["params"] = list(range(first, first + len(g["params"])))
            first += len(g["params"])
            groups.append(hyper)
        return {"zeroshard": self._layout(), "state": entries, "param_groups": groups,
                "training_state": self.core.state.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what state_dict() returned on this rank. Every rank calls it (at stage 3 the
        parameters gathered for the next forward are refreshed, a collective)."""
        saved = state_dict.get("zeroshard") if isinstance(state_dict, dict) else None
        if saved is None:
            raise ValueError("optimizer.load_state_dict: not a zeroshard optimizer state_dict "
                             "(it has no 'zeroshard' layout entry); a torch.optim or DeepSpeed "
                             "optimizer's state loads through engine.load_checkpoint")
        mine = self._layout()
        differ = [f"{k} {saved.get(k)!r} (this run: {v!r})" for k, v in mine.items() if saved.get(k) != v]
        if differ:
            raise ValueError("optimizer.load_state_dict: saved by another layout: " + ", ".join(differ) +
                             "; each rank's optimizer state_dict holds only its shard, so it loads "
                             "only into the same rank, world size, stage, precision and optimizer. "
                             "To resume elsewhere, save with engine.save_checkpoint and load with "
                             "engine.load_checkpoint, which reshard")
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"optimizer.load_state_dict: {len(state_dict['param_groups'])} parameter "
                             f"groups saved, this optimizer has {len(self.param_groups)}")
        values = state_dict["state"]
        stepped = any(k.split("/", 1)[0] in self.core.state_names for k in values)
        entries = self.core.shard_entries(stepped)
        try:  # a refused load leaves NVMe state where it was (end_entries)
            # Saved before the first step: this run's state (if it stepped) is dropped below.
            keys = {f"{kind}/{index}/{begin}": v for kind, index, begin, v, _ in entries
                    if stepped or kind not in self.core.state_names}
            missing = sorted(set(keys) - set(values))
            extra = sorted(set(values) - set(keys))
            if missing or extra:
                raise ValueError(f"optimizer.load_state_dict: the saved shard does not match this "
                                 f"rank's: missing {missing[:3]}, unexpected {extra[:3]} (was the model "
                                 "or its parameter groups changed?)")
            for key, live in keys.items():
                if values[key].shape != live.shape:
                    raise ValueError(f"optimizer.load_state_dict: {key} has shape "
                                     f"{tuple(values[key].shape)}, this rank holds {tuple(live.shape)}")
            # Everything is checked before the first value changes: the training state's own check
            # (a loss scaler this run's fp16 settings cannot have) runs first.
            self.core.state.load_state_dict(state_dict["training_state"])
        except BaseException:
            self.core.end_entries(False)
            raise
        try:
            if not stepped:
                self.core.drop_optimizer_state()  # saved before the first step: so is this run now
            with torch.no_grad():
                for key, live in keys.items():
                    live.copy_(values[key])
            for group, hyper in zip(self.param_groups, state_dict["param_groups"]):
                group.update({k: v for k, v in hyper.items() if k != "params"})
        except BaseException:
            self.core.end_entries(False)  # nothing more is held in host memory for the load
            raise
        self.after_load()

    def after_load(self):
        """After a load wrote new state (load_state_dict, load_checkpoint): the runtime's part (a
        collective at stage 3), and no step of this run's describes the loaded state yet."""
        self.core.after_load()
        self.last_step = None

    def __repr__(self):
        return f"ZeroShardOptimizer(stage={self.core.strategy.stage}, groups={len(self.param_groups)})"
