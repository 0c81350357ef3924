"""The schedule the runtime runs (pipeline/schedule.cpp through _C.pipeline.build), with its
refusals worded by the config key they are about, and the ZeRO stages a pipeline runs with: what
the pipeline engine and the memory planner both ask."""
import functools

from zeroshard import _C


def pipeline_accepts(stage: int) -> bool:
    """Whether a pipeline runs with ZeRO `stage`: only stages that keep whole gradients, reduced
    once per step; a stage that reduces or gathers every micro-batch does not fit the schedule's
    interleaving of micro-batches (as in DeepSpeed). The engine refuses the others, the planner
    does not offer them."""
    return _C.layout.stage_traits(stage)["keeps_full_grads"]


def build_schedule(schedule, num_stages, micro_batches, virtual_stages):
    """(per-rank instruction lists, report) of `schedule`; a shape it refuses is a ValueError
    naming the config key (gradient_accumulation_steps, pipeline.virtual_stages)."""
    try:
        return _C.pipeline.build(schedule, num_stages, micro_batches, virtual_stages)
    except ValueError as error:
        raise ValueError(_in_config_terms(str(error), micro_batches, schedule)) from None


# The arguments of pipeline/schedule.cpp's validate_schedule_args, by the config key each comes
# from; its messages start "<argument>: got ...".
# (num_stages comes from the PipelineModule, which checks it first.)
_SCHEDULE_ARGS = {"num_micro_batches": "gradient_accumulation_steps", "virtual_stages": "pipeline.virtual_stages"}


def _in_config_terms(message, gas, schedule):
    """A schedule rule's error under the config key it is about: the micro-batch rule reads as
    gradient_accumulation_steps (and says which schedule counts them), the others keep their own
    argument as its key; anything else passes as it is."""
    argument, sep, rest = message.partition(": ")
    if not sep or argument not in _SCHEDULE_ARGS:
        return message
    if argument == "num_micro_batches":
        return f"gradient_accumulation_steps: got {gas}, the schedule's micro-batches ({schedule}): {message}"
    return f"{_SCHEDULE_ARGS[argument]}: {rest}"


@functools.lru_cache(maxsize=16)
def build_eval_schedule(num_stages, micro_batches, virtual_stages):
    """Every rank's eval_batch list (forwards only; pipeline/schedule.h's build_eval_schedules,
    checked there), kept per shape: eval_batch runs again and again with the same one. A count
    it refuses is a ValueError naming eval_batch's num_micro_batches."""
    try:
        return _C.pipeline.build_eval(num_stages, micro_batches, virtual_stages)[0]
    except ValueError as error:
        raise ValueError(f"eval_batch: {error}") from None
