"""PipelineEngine.eval_batch: forward only. Micro-batch after micro-batch, each through every
model chunk in order; with no backward to interleave there is nothing to schedule, and the
chain of sends and receives cannot deadlock (each receive waits only on an earlier stage)."""
import torch

from zeroshard.pipe.p2p import as_tuple


def run_eval(engine, data_iter, return_logits, compute_loss, reduce_output, bcast_loss, micro_batches):
    if data_iter is None and engine._needs_data():
        raise ValueError("eval_batch: data_iter is None; pass an iterator over (inputs, labels) "
                         "micro-batches (the training iterator is not evaluated on, as in DeepSpeed)")
    if isinstance(reduce_output, str):
        reduce_output = reduce_output.lower()  # DeepSpeed lower-cases it
    if reduce_output not in ("avg", None):
        raise ValueError(f"eval_batch: reduce_output {reduce_output!r}, expected 'avg' or None")
    module = engine.module
    p, last = module.num_stages, module.num_global_stages - 1
    was_training = module.training
    module.eval()
    results, logits = [], None
    try:
        for mb in range(micro_batches):
            batch = None
            for chunk in range(module.virtual_stages):
                stage = module.global_stage(chunk)
                what = f"pipeline stage {stage} forward (eval) of micro-batch {mb}"
                if stage == 0 or stage == last:
                    with engine._stage_failure_reported(what):
                        if batch is None and engine._needs_data():
                            batch = engine._next_micro_batch(data_iter, mb)
                if stage == 0:
                    x = batch[0]
                else:
                    received = engine._links.receive("activation", stage, mb, engine._grid.stage_to_global((stage - 1) % p))
                    x = received[0] if len(received) == 1 else received
                with engine._stage_failure_reported(what):
                    out = module(x, chunk=chunk)
                    if stage == last:
                        logits = out
                        results.append(engine._loss_of(out, batch[1], mb) if compute_loss else out)
                    else:
                        engine._links.send(as_tuple(out, f"stage {stage} output"), "activation", stage + 1, mb,
                                           engine._grid.stage_to_global((stage + 1) % p))
        # The sends are done before the outputs' tensors may be reused. Here and in the
        # reductions below, a rank that meets another stage's failure names it (the pipe and
        # data-parallel communicators have no store of their own; see _named_by_world).
        with engine._named_by_world("eval_batch's last sends"):
            engine._links.finish()
    finally:
        module.train(was_training)
    holds_last = module.stage_id == module.last_stage_rank
    if reduce_output is None:
        output = results if holds_last else None
    else:
        with engine._named_by_world("eval_batch output and loss reductions"):
            output = _reduced(engine, results, holds_last, compute_loss and bcast_loss)
    if return_logits:
        return output, (logits if holds_last else None)
    return output


def _reduced(engine, results, holds_last, broadcast_loss):
    """reduce_output="avg": the mean over micro-batches and data-parallel replicas on the last
    stage; with broadcast_loss, that loss on every stage."""
    output = None
    if holds_last:
        # Every last-stage replica has the same output dtypes, so all of them refuse here
        # together, before the data-parallel all-reduce; published as a stage failure, so the
        # other stages waiting for the eval loss learn of it too.
        with engine._stage_failure_reported(f"eval_batch output of stage {engine.module.stage_id}"):
            _check_averageable(results[0])
        output = _mean(results)
        if engine.dp_world_size > 1:
            for t in (output if isinstance(output, tuple) else (output,)):
                engine._comm.all_reduce(t, "eval_batch output")
                t /= engine.dp_world_size
    # Only a reduced loss is one number every rank can take (reduce_output=None keeps a list).
    if broadcast_loss and engine._pipe_comm is not None:
        value = float(output) if holds_last else 0.0
        output = torch.tensor(engine._pipe_comm.all_reduce_values([value], str(engine.device), "eval loss")[0],
                              dtype=torch.float32, device=engine.device)  # as DeepSpeed: on the device
    return output


def _check_averageable(result):
    """reduce_output="avg" takes the mean of each output over micro-batches and data-parallel
    ranks, which only a floating (or complex) tensor has: a mask or token ids averaged would come
    back as fractions. Such an output is refused by its index (DeepSpeed fails on it in an
    in-place division with no name)."""
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    for index, t in enumerate(outputs):
        if not torch.is_tensor(t):
            raise ValueError(f"eval_batch: reduce_output='avg': output {index} of the last stage is "
                             f"{type(t).__name__}, expected tensors to average; pass reduce_output=None "
                             "for every micro-batch's outputs as they are")
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"eval_batch: reduce_output='avg': output {index} of the last stage is "
                             f"{t.dtype} (a mask or indices has no mean), expected floating outputs "
                             "only; pass reduce_output=None for every micro-batch's outputs as they are, "
                             "or return only floating tensors from the last layer")


def _mean(results):
    """The mean over micro-batches of the losses or outputs (a tuple of tensors averaged element
    by element), in their own floating dtype (_check_averageable has refused any other)."""
    if isinstance(results[0], (tuple, list)):
        return tuple(_mean([r[i] for r in results]) for i in range(len(results[0])))
    return (torch.stack([r.detach() for r in results]).sum(0) / len(results)).contiguous()
