"""ZeRO-3 helpers with DeepSpeed's names (deepspeed.zero.*)."""
from zeroshard.zero.gathered import GatheredParameters
from zeroshard.zero.hooks import register_external_parameter

__all__ = ["GatheredParameters", "register_external_parameter"]
