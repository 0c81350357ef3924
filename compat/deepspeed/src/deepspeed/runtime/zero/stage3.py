"""deepspeed.runtime.zero.stage3: DeepSpeed's ZeRO-3 memory estimators (zeroshard's own, in
zeroshard.planner.deepspeed_estimators). DeepSpeed's optimizer class is not provided: zeroshard's
ZeRO-3 runs inside its engine (zeroshard.initialize)."""
from zeroshard.planner.deepspeed_estimators import (estimate_zero3_model_states_mem_needs,  # noqa: F401
                                                    estimate_zero3_model_states_mem_needs_all_cold,
                                                    estimate_zero3_model_states_mem_needs_all_live)
from zeroshard.planner.deepspeed_estimators import zero3_model_to_params as model_to_params  # noqa: F401

__all__ = ["estimate_zero3_model_states_mem_needs", "estimate_zero3_model_states_mem_needs_all_live",
           "estimate_zero3_model_states_mem_needs_all_cold", "model_to_params"]
