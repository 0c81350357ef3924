"""deepspeed.pipe's names: PipelineModule, LayerSpec, TiedLayerSpec and the topologies."""
from zeroshard.pipe.layers import LayerSpec, TiedLayerSpec
from zeroshard.pipe.module import PipelineModule
from zeroshard.pipe.topology import (PipeDataParallelTopology, PipelineParallelGrid,
                                     PipeModelDataParallelTopology, ProcessTopology)


class PipelineError(Exception):
    """DeepSpeed's error for an engine call a pipeline cannot take (forward/backward/step)."""


__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "PipelineError"]
