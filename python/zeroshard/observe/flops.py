"""FLOPs: DeepSpeed's flops_profiler block, and the count behind the progress line's TFLOPS.

One micro-step is counted with torch's FlopCounterMode, its forward and its backward apart, per
module (the counts are torch's formulas for the ops that do arithmetic: matmuls, convolutions,
attention). With flops_profiler.enabled the micro-step is the first of step `profile_step` (after
that many steps, as DeepSpeed's), its modules' forward latencies are timed too, and the profile is
printed (or written to output_file) in DeepSpeed's layout. Otherwise the first micro-step of the
run is counted once (ZEROSHARD_COUNT_FLOPS=0 turns that off) so that every progress line can say
how many model FLOPs per second this rank achieves."""
import functools
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from zeroshard.log import log_rank0


# torch's formulas cover the CUDA attention kernels; on CPU scaled_dot_product_attention runs these,
# counted the same way (the backward recomputes the scores, as flash attention's does).
def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_CPU_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
                  torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


def _numel(p):
    # ZeRO-3 leaves each rank a chunk; ds_numel is the whole parameter's.
    return int(getattr(p, "ds_numel", p.numel()))


def _num(value, unit=""):
    for scale, prefix in ((1e12, " T"), (1e9, " G"), (1e6, " M"), (1e3, " K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{prefix}{unit}"
    return f"{value:.2f} {unit}".rstrip()


def _of(table, full, module):
    """A module's figure in `table` (FLOPs or latency by name): its own where its forward ran
    (it includes its children's), else its children's summed, as DeepSpeed sums them: a container
    that is never called, such as a ModuleList, holds what its modules did."""
    if full in table:
        return table[full]
    return sum(_of(table, f"{full}.{name}", child) for name, child in module.named_children())


def _ms(seconds):
    return f"{seconds * 1e3:.2f} ms"


@functools.cache
def _warm_counter():
    """torch's first FlopCounterMode session imports and sets up what it needs inside the first
    forward it counts (most of a second here), which the profile would report as the root
    module's latency: one session over a tiny module pays that first, once per process."""
    layer = torch.nn.Linear(2, 2)
    with FlopCounterMode(display=False, depth=None):
        layer(torch.ones(1, 2)).sum().backward()


class _MicroStepCount:
    """Forward and backward FLOPs of one micro-step by module name ("Global" for the whole), and
    the forward latency of each module when timed. One FlopCounterMode session runs from the
    forward's start to the backward's end (torch attributes a backward's FLOPs to modules through
    hooks its forward set); the forward's counts are taken at its end, the backward's are the rest."""

    def __init__(self, module, timed):
        self.module, self.timed = module, timed
        self.forward, self.backward = {}, {}
        self.latency = {}  # module name -> forward seconds
        self._counter, self._hooks, self._starts = None, [], {}
        self._sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def _names(self):
        root = type(self.module).__name__  # FlopCounterMode's names: Class.child.grandchild
        return {m: root + ("." + n if n else "") for n, m in self.module.named_modules()}

    def _counts(self):
        return {name: sum(ops.values()) for name, ops in self._counter.get_flop_counts().items()}

    def begin_forward(self):
        _warm_counter()  # before any hook or clock: the profile times the model, not torch's imports
        if self.timed:
            for m, name in self._names().items():
                self._hooks.append(m.register_forward_pre_hook(lambda mod, args, name=name: self._pre(name)))
                self._hooks.append(m.register_forward_hook(lambda mod, args, out, name=name: self._post(name)))
        self._counter = FlopCounterMode(display=False, depth=None, custom_mapping=_CPU_ATTENTION)
        self._counter.__enter__()

    def _pre(self, name):
        self._sync()
        self._starts[name] = time.perf_counter()

    def _post(self, name):
        self._sync()
        if name in self._starts:
            self.latency[name] = self.latency.get(name, 0.0) + time.perf_counter() - self._starts.pop(name)

    def end_forward(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.forward = self._counts()

    def end_backward(self):
        self.close()
        self.backward = {name: total - self.forward.get(name, 0) for name, total in self._counts().items()}

    def close(self):
        """Leaves the counting mode (also for a count given up: a forward without a backward)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._counter is not None and self._counter.mode is not None:
            self._counter.__exit__(None, None, None)

    @property
    def total(self):
        return self.forward.get("Global", 0) + self.backward.get("Global", 0)


class FlopsProfiler:
    def __init__(self, block, module, rank, world_size, dp_world_size, micro_batch, gas):
        self.enabled = bool(block.get("enabled"))
        self._block, self._module, self._rank = block, module, rank
        self._world, self._dp, self._micro, self._gas = world_size, dp_world_size, micro_batch, gas
        self._count_once = os.environ.get("ZEROSHARD_COUNT_FLOPS", "1") not in ("0", "false", "False")
        self._counting = None
        self._counted = None
        self._times = {}

    @property
    def flops_per_step(self):
        """This rank's model FLOPs per optimizer step (forward and backward of every micro-step),
        once a micro-step was counted; None before."""
        return None if self._counted is None else self._counted.total * self._gas

    def _wanted(self, global_steps, first_micro_step):
        if not first_micro_step:
            return False
        if self.enabled:
            return global_steps == int(self._block.get("profile_step", 1))
        return self._count_once and self._counted is None

    # ----- the engine's micro-step -----
    def begin(self, phase, global_steps, first_micro_step):
        if phase == "forward":
            if self._counting is not None:  # the last counted forward had no backward: given up
                self._counting.close()
                self._counting = None
            if (self._wanted(global_steps, first_micro_step) and torch.is_grad_enabled()
                    and self._module.training):
                self._counting = _MicroStepCount(self._module, timed=self.enabled)
                self._times = {}
                self._counting.begin_forward()
        if self._counting is not None:
            self._times[phase] = time.perf_counter()

    def end(self, phase):
        if self._counting is None or phase not in self._times:
            return
        self._times[phase] = time.perf_counter() - self._times[phase]
        if phase == "forward":
            self._counting.end_forward()
            return
        self._counting.end_backward()
        self._counted, self._counting = self._counting, None
        self._report_pending = self.enabled

    def after_step(self, step_seconds, global_steps):
        if getattr(self, "_report_pending", False):
            self._report_pending = False
            self._report(step_seconds, global_steps)

    # ----- DeepSpeed's printed profile -----
    def _report(self, step_seconds, global_steps):
        if self._rank != 0:
            return
        c = self._counted
        params = sum(_numel(p) for p in self._module.parameters())
        fwd, bwd = c.forward.get("Global", 0), c.backward.get("Global", 0)
        t_fwd, t_bwd = self._times.get("forward", 0.0), self._times.get("backward", 0.0)
        iteration = t_fwd + t_bwd + step_seconds
        lines = ["-------------------------- zeroshard Flops Profiler --------------------------",
                 f"Profile Summary at step {global_steps}:",
                 "(flops counted by torch's FlopCounterMode for one micro-step, forward and backward "
                 "apart; latencies of that micro-step; the optimizer step of its whole step)", ""]
        rows = [("world size", self._world), ("data parallel size", self._dp),
                ("batch size per GPU", self._micro), ("params per GPU", _num(params)),
                ("fwd MACs per GPU", _num(fwd / 2, "MACs")), ("fwd flops per GPU", _num(fwd)),
                ("fwd latency", _ms(t_fwd)),
                ("fwd FLOPS per GPU = fwd flops / fwd latency", _num(fwd / max(t_fwd, 1e-12), "FLOPS")),
                ("bwd flops per GPU", _num(bwd)), ("bwd latency", _ms(t_bwd)),
                ("bwd FLOPS per GPU = bwd flops / bwd latency", _num(bwd / max(t_bwd, 1e-12), "FLOPS")),
                ("fwd+bwd FLOPS per GPU", _num((fwd + bwd) / max(t_fwd + t_bwd, 1e-12), "FLOPS")),
                ("step latency", _ms(step_seconds)), ("iter latency", _ms(iteration)),
                ("samples/second", f"{self._micro * self._dp / max(iteration, 1e-12):.2f}")]
        lines += [f"{name + ':':<70}{value}" for name, value in rows]
        lines += self._aggregated(c) + (self._detailed(c, fwd, params) if self._block.get("detailed", True) else [])
        lines.append("------------------------------------------------------------------------------")
        text = "\n".join(lines)
        path = self._block.get("output_file")
        if path:
            with open(path, "w") as f:
                f.write(text + "\n")
            log_rank0(f"flops profile of step {global_steps} written to {path}", self._rank)
        else:
            log_rank0(text, self._rank)

    def _modules(self):
        root = type(self._module).__name__
        for name, m in self._module.named_modules():
            full = root + ("." + name if name else "")
            yield full, m, (0 if not name else name.count(".") + 1)

    def _depth_limit(self):
        """The aggregated depths: 0 to module_depth - 1 (DeepSpeed's range), every depth for -1
        (DeepSpeed's code leaves the innermost out there; its documentation says it is shown)."""
        limit = int(self._block.get("module_depth", -1))
        return None if limit < 0 else limit

    def _aggregated(self, c):
        """DeepSpeed's aggregated profile: at each depth, the modules summed by class, the top
        `top_modules` classes by parameters, forward MACs and forward latency."""
        top, limit = int(self._block.get("top_modules", 1)), self._depth_limit()
        by_depth = {}  # depth -> class name -> [params, MACs, latency]
        for full, m, depth in self._modules():
            if limit is not None and depth >= limit:
                continue
            sums = by_depth.setdefault(depth, {}).setdefault(type(m).__name__, [0, 0.0, 0.0])
            sums[0] += sum(_numel(p) for p in m.parameters())
            sums[1] += _of(c.forward, full, m) / 2
            sums[2] += _of(c.latency, full, m)
        lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
                 f"Top {top} modules in terms of params, MACs or fwd latency at different model depths:"]
        for depth in sorted(by_depth):
            classes = by_depth[depth]

            def best(column, fmt):
                ranked = sorted(classes.items(), key=lambda kv: kv[1][column], reverse=True)[:top]
                return "{" + ", ".join(f"'{name}': '{fmt(sums[column])}'" for name, sums in ranked) + "}"

            lines += [f"depth {depth}:", f"    params      - {best(0, _num)}",
                      f"    MACs        - {best(1, lambda v: _num(v, 'MACs'))}",
                      f"    fwd latency - {best(2, _ms)}"]
        return lines

    def _detailed(self, c, total_fwd, total_params):
        total_latency = c.latency.get(type(self._module).__name__, 0.0) or 1e-12
        lines = ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                 "Each module profile is listed after its name in the following order:",
                 "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
                 "percentage of total fwd latency, fwd FLOPS, bwd flops", ""]
        for full, m, depth in self._modules():
            params = sum(_numel(p) for p in m.parameters())
            fwd, latency = _of(c.forward, full, m), _of(c.latency, full, m)
            label = full.split(".")[-1] if depth else full
            lines.append(f"{'  ' * depth}{label} ({type(m).__name__}): {_num(params)}, "
                         f"{100 * params / max(total_params, 1):.2f}% Params, {_num(fwd / 2, 'MACs')}, "
                         f"{100 * fwd / max(total_fwd, 1):.2f}% MACs, {_ms(latency)}, "
                         f"{100 * latency / total_latency:.2f}% latency, "
                         f"{_num(fwd / max(latency, 1e-12), 'FLOPS')}, {_num(_of(c.backward, full, m))} bwd flops")
        return lines
