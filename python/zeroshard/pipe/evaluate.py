"""PipelineEngine.eval_batch: forward only, each rank running its list from C++ (pipeline/schedule.h's
build_eval_schedules, proven runnable there as the training schedules are): micro-batches in
groups of p through the model chunks, so that with several chunks per rank every rank has work
while a micro-batch goes round the others."""
import torch

from zeroshard.pipe.list_run import ListRun
from zeroshard.pipe.p2p import as_tuple
from zeroshard.pipe.schedule import build_eval_schedule


def run_eval(engine, data_iter, return_logits, compute_loss, reduce_output, bcast_loss, micro_batches):
    if data_iter is None and engine._needs_data():
        raise ValueError("eval_batch: data_iter is None; pass an iterator over (inputs, labels) "
                         "micro-batches (the training iterator is not evaluated on, as in DeepSpeed)")
    if isinstance(reduce_output, str):
        reduce_output = reduce_output.lower()  # DeepSpeed lower-cases it
    if reduce_output not in ("avg", None):
        raise ValueError(f"eval_batch: reduce_output {reduce_output!r}, expected 'avg' or None")
    module = engine.module
    lists = build_eval_schedule(module.num_stages, micro_batches, module.virtual_stages)
    was_training = module.training
    module.eval()
    run = EvalStep(engine, data_iter, compute_loss, micro_batches)
    try:
        run.run(lists[module.stage_id])
    finally:
        module.train(was_training)
    results = [run.results[mb] for mb in sorted(run.results)]
    holds_last = module.stage_id == module.last_stage_rank
    if reduce_output is None:
        output = results if holds_last else None
    else:
        with engine._named_by_world("eval_batch output and loss reductions"):
            output = _reduced(engine, results, holds_last, compute_loss, bcast_loss)
    if return_logits:
        return output, (run.logits if holds_last else None)
    return output


class EvalStep(ListRun):
    """Runs one rank's eval_batch list: loads, activation receives, forwards, activation sends."""
    OPS = ("load_micro_batch", "forward", "send_activation", "receive_activation")
    REPORT_SUFFIX = " (eval)"

    def __init__(self, engine, data_iter, compute_loss, micro_batches):
        super().__init__(engine, data_iter)
        self.compute_loss = compute_loss
        self.last_micro_batch = micro_batches - 1
        self.outputs = {}   # (mb, chunk) -> the output, until sent on
        self.results = {}   # mb -> the last stage's loss (or output, without compute_loss)
        self.logits = None  # the last stage's output of the last micro-batch (DeepSpeed's)

    def forward(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("forward", mb, chunk):
            x = self._stage_input(mb, chunk, lambda: self.inputs.pop((mb, chunk)))
            out = self.module(x, chunk=chunk)
            if stage == self.last_stage:
                if mb == self.last_micro_batch:
                    self.logits = out
                self.results[mb] = (self.engine._loss_of(out, self._take(mb, 1), mb) if self.compute_loss
                                    else out)
            else:
                self.outputs[(mb, chunk)] = as_tuple(out, f"stage {stage} output")

    def send_activation(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("send_activation", mb, chunk):
            self.links.send(self.outputs.pop((mb, chunk)), "activation", stage + 1, mb, self._peer(peer))


def _reduced(engine, results, holds_last, losses, broadcast_loss):
    """reduce_output="avg": the mean over micro-batches and data-parallel replicas on the last
    stage of the losses, or of the outputs; with losses and broadcast_loss, that loss on every
    stage."""
    output = None
    if holds_last:
        # What each replica can average is decided locally; with replicas to average over, they
        # compare their reasons and shapes first, so that all refuse together before the
        # all-reduce (each replica's pipeline agrees its own shapes, and with dynamic_shape each
        # micro-batch has its own). A refusal of one replica alone is published as a stage
        # failure, so the other stages waiting for the eval loss learn of it too.
        why_not = _not_averageable(results)
        if engine.dp_world_size > 1 and not losses:  # a loss has one element everywhere
            _check_replicas_agree(engine, results[0], why_not)
        elif why_not:
            with engine._stage_failure_reported(f"eval_batch output of stage {engine.module.stage_id}"):
                raise ValueError(why_not)
        output = _mean(results)
        if engine.dp_world_size > 1:
            for t in _as_list(output):
                engine._comm.all_reduce(t, "eval_batch output")
                t /= engine.dp_world_size
    # Only a reduced loss is one number every rank can take (reduce_output=None keeps a list).
    if losses and broadcast_loss and engine._pipe_comm is not None:
        value = float(output) if holds_last else 0.0
        output = torch.tensor(engine._pipe_comm.all_reduce_values([value], str(engine.device), "eval loss")[0],
                              dtype=torch.float32, device=engine.device)  # as DeepSpeed: on the device
    return output


def _as_list(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


_AS_THEY_ARE = "pass reduce_output=None for every micro-batch's outputs as they are"


def _not_averageable(results):
    """Why the micro-batches' outputs have no element-wise mean, or None. reduce_output="avg"
    averages each output over micro-batches and data-parallel replicas, which only floating (or
    complex) tensors of one shape have: a mask or token ids averaged would come back as
    fractions, and shapes that change from micro-batch to micro-batch (dynamic_shape) have no
    such mean. Named by output and micro-batch (DeepSpeed fails on the first in an in-place
    division, on the second in torch's stack, with no name)."""
    first = _as_list(results[0])
    for mb, result in enumerate(results):
        outputs = _as_list(result)
        if len(outputs) != len(first):
            return (f"eval_batch: reduce_output='avg': micro-batch {mb} has {len(outputs)} outputs, micro-batch "
                    f"0 {len(first)}; {_AS_THEY_ARE}")
        for index, (t, t0) in enumerate(zip(outputs, first)):
            where = f"output {index} of micro-batch {mb}"
            if not torch.is_tensor(t):
                return (f"eval_batch: reduce_output='avg': {where} is {type(t).__name__}, expected tensors to "
                        f"average; {_AS_THEY_ARE}")
            if not (t.is_floating_point() or t.is_complex()):
                return (f"eval_batch: reduce_output='avg': {where} is {t.dtype} (a mask or indices has no mean), "
                        f"expected floating outputs only; {_AS_THEY_ARE}, or return only floating tensors from "
                        "the last layer")
            if t.shape != t0.shape or t.dtype != t0.dtype:
                return (f"eval_batch: reduce_output='avg': {where} is {t.dtype} {list(t.shape)}, micro-batch 0's "
                        f"{t0.dtype} {list(t0.shape)}, and an element-wise mean needs one; {_AS_THEY_ARE}")
    return None


def _check_replicas_agree(engine, result, why_not):
    """Every data-parallel replica refuses together (an all-reduce of tensors of different sizes
    would fail in the backend without a name, or wait out a timeout on a replica whose peer had
    raised) when one cannot average (`why_not`) or the replicas' shapes or dtypes differ: the
    largest and smallest of each number over the replicas, in two small all-reduces, the count
    and the refusing replica first, so that the second has one length everywhere."""
    dims = [float(n) for t in _as_list(result) if torch.is_tensor(t)
            for n in (_DTYPE_CODES.get(t.dtype, -1), t.dim(), *t.shape)]
    refusing = float(engine._grid.get_data_parallel_id() + 1) if why_not else 0.0
    first = torch.tensor([float(len(dims)), refusing, -float(len(dims))], dtype=torch.float64, device=engine.device)
    engine._comm.all_reduce_max(first, "eval_batch output shape count")
    count_max, refused_by, count_min = first.tolist()  # one read, not one per number
    refused_by, count_min = int(refused_by), -count_min
    if why_not:
        raise ValueError(why_not)
    if refused_by:
        raise ValueError(f"eval_batch: reduce_output='avg': data-parallel replica {refused_by - 1}'s outputs cannot "
                         f"be averaged (its error says why), so no replica's are; {_AS_THEY_ARE}")
    agree = count_max == count_min
    if agree:
        both = torch.tensor(dims + [-v for v in dims], dtype=torch.float64, device=engine.device)
        engine._comm.all_reduce_max(both, "eval_batch output shapes")
        agree = both[:len(dims)].tolist() == (-both[len(dims):]).tolist()
    if not agree:
        raise ValueError(f"eval_batch: reduce_output='avg': the data-parallel replicas' outputs differ in shape or "
                         f"dtype (this replica's: {[(str(t.dtype), list(t.shape)) for t in _as_list(result)]}), so "
                         f"they have no element-wise mean; {_AS_THEY_ARE}")


_DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128))}


def _mean(results):
    """The mean over micro-batches of the losses or outputs (a tuple of tensors averaged element
    by element), in their own floating dtype (_not_averageable has refused any other)."""
    if isinstance(results[0], (tuple, list)):
        return tuple(_mean([r[i] for r in results]) for i in range(len(results[0])))
    return (torch.stack([r.detach() for r in results]).sum(0) / len(results)).contiguous()
