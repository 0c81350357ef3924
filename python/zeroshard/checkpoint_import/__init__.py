"""Readers for checkpoints written by other runtimes, so that a run moving to zeroshard keeps its state.
Pure Python + torch: nothing here imports the other runtime or zeroshard's C++ extension."""
from zeroshard.checkpoint_import.deepspeed import (  # noqa: F401
    DeepSpeedCheckpoint, is_deepspeed_checkpoint)
from zeroshard.checkpoint_import.deepspeed_pipe import (  # noqa: F401
    DeepSpeedPipelineCheckpoint, is_deepspeed_pipeline_checkpoint)

__all__ = ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "DeepSpeedPipelineCheckpoint",
           "is_deepspeed_pipeline_checkpoint"]
