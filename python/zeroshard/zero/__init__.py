"""ZeRO-3 helpers with DeepSpeed's names (deepspeed.zero.*)."""
from zeroshard.zero.gathered import GatheredParameters
from zeroshard.zero.hooks import register_external_parameter
from zeroshard.zero.partition_init import Init

__all__ = ["GatheredParameters", "Init", "register_external_parameter"]
