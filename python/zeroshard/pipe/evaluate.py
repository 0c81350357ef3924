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
        self.inputs = {}    # (mb, chunk) -> the received input, until its forward
        self.outputs = {}   # (mb, chunk) -> the output, until sent on
        self.results = {}   # mb -> the last stage's loss (or output, without compute_loss)
        self.logits = None  # the last stage's output of the last micro-batch (DeepSpeed's)

    def forward(self, mb, chunk, peer):
        stage = self.module.global_stage(chunk)
        with self._reported("forward", mb, chunk):
            if stage == 0:
                x = self._take(mb, 0)
            else:
                received = self.inputs.pop((mb, chunk))
                x = received[0] if len(received) == 1 else received
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

    def receive_activation(self, mb, chunk, peer):
        self.inputs[(mb, chunk)] = self.links.receive(
            "activation", self.module.global_stage(chunk), mb, self._peer(peer),
            posted=self.posted.pop(("receive_activation", mb, chunk), None))


def _reduced(engine, results, holds_last, losses, broadcast_loss):
    """reduce_output="avg": the mean over micro-batches and data-parallel replicas on the last
    stage of the losses, or of the outputs; with losses and broadcast_loss, that loss on every
    stage."""
    output = None
    if holds_last:
        # Every last-stage replica has the same output dtypes, so all of them refuse a dtype here
        # together; published as a stage failure, so the other stages waiting for the eval loss
        # learn of it too.
        with engine._stage_failure_reported(f"eval_batch output of stage {engine.module.stage_id}"):
            _check_floating(results[0])
        # Shapes may differ by micro-batch and by replica (each replica's pipeline agrees its own,
        # and with dynamic_shape each micro-batch has its own): with replicas to average over,
        # they compare theirs first, so that all refuse together, before the all-reduce.
        differs = _shapes_differ(results)
        if engine.dp_world_size > 1 and not losses:  # a loss has one element everywhere
            _check_replicas_agree(engine, results[0], differs)
        elif differs:
            raise ValueError(differs)
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


def _check_floating(result):
    """reduce_output="avg" takes the mean of each output over micro-batches and data-parallel
    ranks, element by element, which only a floating (or complex) tensor has: a mask or token ids
    averaged would come back as fractions. Such an output is refused by its index (DeepSpeed fails
    on it in an in-place division with no name)."""
    for index, t in enumerate(_as_list(result)):
        if not torch.is_tensor(t):
            raise ValueError(f"eval_batch: reduce_output='avg': output {index} of the last stage is "
                             f"{type(t).__name__}, expected tensors to average; {_AS_THEY_ARE}")
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"eval_batch: reduce_output='avg': output {index} of the last stage is "
                             f"{t.dtype} (a mask or indices has no mean), expected floating outputs "
                             f"only; {_AS_THEY_ARE}, or return only floating tensors from the last layer")


def _shapes_differ(results):
    """Why the micro-batches' outputs have no element-wise mean (their number or shapes change
    from micro-batch to micro-batch; DeepSpeed fails on it in torch's stack), or None."""
    first = _as_list(results[0])
    for mb, result in enumerate(results[1:], start=1):
        outputs = _as_list(result)
        if len(outputs) != len(first):
            return (f"eval_batch: reduce_output='avg': micro-batch {mb} has {len(outputs)} outputs, micro-batch "
                    f"0 {len(first)}; {_AS_THEY_ARE}")
        for index, (t, t0) in enumerate(zip(outputs, first)):
            if t.shape != t0.shape:
                return (f"eval_batch: reduce_output='avg': output {index} of micro-batch {mb} is "
                        f"{list(t.shape)}, micro-batch 0's {list(t0.shape)}, and an element-wise mean needs "
                        f"one shape; {_AS_THEY_ARE}")
    return None


def _check_replicas_agree(engine, result, differs):
    """Every data-parallel replica refuses together (an all-reduce of tensors of different sizes
    would fail in the backend without a name, or wait out a timeout on a replica whose peer had
    raised) when one's micro-batches differ (`differs`) or the replicas' shapes do: the largest
    and smallest of each number over the replicas, in two small all-reduces, the count and that
    flag first so that the second has one length everywhere."""
    dims = [float(n) for t in _as_list(result) for n in (t.dim(), *t.shape)]
    first = torch.tensor([float(len(dims)), float(differs is not None), -float(len(dims))], dtype=torch.float64,
                         device=engine.device)
    engine._comm.all_reduce_max(first, "eval_batch output shape count")
    count_max, any_differs, count_min = first[0].item(), first[1].item(), -first[2].item()
    if differs:
        raise ValueError(differs)
    if any_differs:
        raise ValueError("eval_batch: reduce_output='avg': another data-parallel replica's outputs change shape "
                         f"between its micro-batches, so they have no element-wise mean; {_AS_THEY_ARE}")
    agree = count_max == count_min
    if agree:
        both = torch.tensor(dims + [-v for v in dims], dtype=torch.float64, device=engine.device)
        engine._comm.all_reduce_max(both, "eval_batch output shapes")
        agree = both[:len(dims)].tolist() == (-both[len(dims):]).tolist()
    if not agree:
        raise ValueError(f"eval_batch: reduce_output='avg': the data-parallel replicas' outputs differ in shape "
                         f"(this replica's: {[list(t.shape) for t in _as_list(result)]}), so they have no "
                         f"element-wise mean; {_AS_THEY_ARE}")


def _mean(results):
    """The mean over micro-batches of the losses or outputs (a tuple of tensors averaged element
    by element), in their own floating dtype (_check_floating has refused any other)."""
    if isinstance(results[0], (tuple, list)):
        return tuple(_mean([r[i] for r in results]) for i in range(len(results[0])))
    return (torch.stack([r.detach() for r in results]).sum(0) / len(results)).contiguous()
