"""The memory planner: `zeroshard.plan(...)` and `zeroshard plan` (cli.py) say what every ZeRO
stage, offload and pipeline setup needs per GPU and per node, whether it fits, and which to run;
DeepSpeed's estimate_zero{2,3}_model_states_mem_needs_* under its own names; host_bytes_per_node
for the preflight check."""
from zeroshard.planner.deepspeed_estimators import (estimate_zero2_model_states_mem_needs,
                                                    estimate_zero2_model_states_mem_needs_all_cold,
                                                    estimate_zero2_model_states_mem_needs_all_live,
                                                    estimate_zero3_model_states_mem_needs,
                                                    estimate_zero3_model_states_mem_needs_all_cold,
                                                    estimate_zero3_model_states_mem_needs_all_live,
                                                    zero2_model_to_params, zero3_model_to_params)
from zeroshard.planner.model import Decoder, decoder_from_hf
from zeroshard.planner.plan import Plan, host_bytes_per_node, plan

__all__ = ["plan", "Plan", "Decoder", "decoder_from_hf", "host_bytes_per_node",
           "zero2_model_to_params", "zero3_model_to_params",
           "estimate_zero2_model_states_mem_needs", "estimate_zero2_model_states_mem_needs_all_live",
           "estimate_zero2_model_states_mem_needs_all_cold", "estimate_zero3_model_states_mem_needs",
           "estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold"]
