"""CPU optimizers backed by zeroshard's SIMD kernels, with DeepSpeed's class names and
constructors: ``zeroshard.ops.adam.CPUAdam`` (alias ``DeepSpeedCPUAdam``),
``zeroshard.ops.adagrad.CPUAdagrad`` (``DeepSpeedCPUAdagrad``), ``zeroshard.ops.lion.CPULion``
(``DeepSpeedCPULion``)."""

from zeroshard.ops.adagrad import CPUAdagrad, DeepSpeedCPUAdagrad
from zeroshard.ops.adam import CPUAdam, DeepSpeedCPUAdam
from zeroshard.ops.lion import CPULion, DeepSpeedCPULion

__all__ = ["CPUAdam", "DeepSpeedCPUAdam", "CPUAdagrad", "DeepSpeedCPUAdagrad", "CPULion",
           "DeepSpeedCPULion"]
