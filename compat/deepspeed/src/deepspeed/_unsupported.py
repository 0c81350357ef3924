"""What zeroshard does not provide under DeepSpeed's names, and what to do instead: the one table
that the refusing modules (ImportError) and functions (NotImplementedError) read."""

_INFERENCE = ("DeepSpeed's inference engine: deepspeed.inference, deepspeed.init_inference",
              "run inference on the plain PyTorch model (under ZeRO-3, inside "
              "deepspeed.zero.GatheredParameters), or use DeepSpeed itself")

# DeepSpeed name -> (what is not supported, what to do instead)
UNSUPPORTED = {
    "deepspeed.runtime.sequence_parallel": (
        "sequence parallelism: DeepSpeed-Ulysses / ALST, ulysses_sp",
        "train without it (leave parallelism_config sp_size at 1), or use DeepSpeed itself"),
    "deepspeed.utils.groups": (
        "sequence-, tensor- and expert-parallel process groups: zeroshard shards over the "
        "data-parallel ranks only",
        "use torch.distributed's default group (deepspeed.comm), or use DeepSpeed itself"),
    "deepspeed.moe": (
        "expert parallelism: MoE layers, expert groups",
        "use the model's own MoE layers as plain modules, which ZeRO shards like any other, or "
        "use DeepSpeed itself"),
    "deepspeed.inference": _INFERENCE,
    "deepspeed.init_inference": _INFERENCE,
    "deepspeed.runtime.pipe.schedule": (
        "DeepSpeed's pipeline schedule classes (PipeSchedule, TrainSchedule, InferenceSchedule and "
        "their PipeInstructions): zeroshard builds and checks its schedules in C++",
        "pick a built-in schedule with the config's pipeline.schedule (\"gpipe\", \"1f1b\", "
        "\"interleaved_1f1b\", \"zero_bubble\") and run it with engine.train_batch() / eval_batch(), "
        "or use DeepSpeed itself"),
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer": (
        "DeepSpeed's bf16 optimizer wrapper: under bf16, zeroshard's engine keeps the fp32 master "
        "weights in its own optimizer (engine.optimizer, with DeepSpeed's overflow and loss_scale)",
        "let initialize() build the optimizer from the config's bf16 block"),
    "deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler": (
        "curriculum learning (data efficiency's curriculum scheduler)",
        "train without curriculum_learning, or use DeepSpeed itself"),
    "deepspeed.tp_model_init": (
        "tensor parallelism: AutoTP, tensor_parallel.autotp_size > 1",
        "remove tensor_parallel from the config (autotp_size 1), or use DeepSpeed itself"),
}


def message(name: str) -> str:
    what, instead = UNSUPPORTED[name]
    return (f"{name} is not supported by zeroshard ({what}); this `deepspeed` is zeroshard's "
            f"compatibility package. Instead: {instead}.")


def refuse_import(name: str):
    """Called by a refusing module's body, so that importing it fails with the table's message."""
    raise ImportError(message(name), name=name)


def refuse_call(name: str):
    raise NotImplementedError(message(name))
