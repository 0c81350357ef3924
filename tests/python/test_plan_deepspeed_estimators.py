"""DeepSpeed's estimators (zeroshard/planner/deepspeed_estimators.py): DeepSpeed's numbers and
printed tables, reachable at DeepSpeed's module paths through the compatibility package."""
import os
import shutil
import subprocess
import sys

import torch

from gpt import GPT
from models import SEQ, VOCAB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# DeepSpeed's formulas (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py), written out here.
def _ds_zero2(P, gpn, nodes, offload, f=1.5):
    gpus = gpn * nodes
    return ((P * max(4 * gpus, 16) * f, 2 * P) if offload else
            (P * 4 * gpn * f, 2 * P + int(18 * P / gpus)))


def _ds_zero3(P, L, gpn, nodes, opt, param, init, f=1.5):
    gpus, per = gpn * nodes, 1 / nodes
    if opt:
        host = 18 if param else 16
        gpu = 4 * L if param else 4 * L + int(2 * P / gpus)
        return P * (host * per if init else max(4 * gpn, host * per)) * f, gpu
    return (L if init else P) * 4 * gpn * f, 4 * L + int(18 * P / gpus)


def _line(cpu, gpu, options):
    return f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | {options}"


def test_deepspeed_estimators_print_deepspeeds_table(capsys):
    from zeroshard.planner import (estimate_zero2_model_states_mem_needs_all_cold,
                                   estimate_zero2_model_states_mem_needs_all_live,
                                   estimate_zero3_model_states_mem_needs_all_cold,
                                   estimate_zero3_model_states_mem_needs_all_live)
    P, L = 6_738_415_616, 131_072_000  # Llama-2-7B; its largest layer is the embedding
    estimate_zero2_model_states_mem_needs_all_cold(P, num_gpus_per_node=8, num_nodes=2)
    want = ["Estimated memory needed for params, optim states and gradients for a:",
            "HW: Setup with 2 nodes, 8 GPUs per node.", "SW: Model with 6738M total params.",
            "  per CPU  |  per GPU |   Options",
            _line(*_ds_zero2(P, 8, 2, True), "offload_optimizer=cpu "),
            _line(*_ds_zero2(P, 8, 2, False), "offload_optimizer=none")]
    assert capsys.readouterr().out.splitlines() == want
    estimate_zero3_model_states_mem_needs_all_cold(P, L, num_gpus_per_node=8, num_nodes=1)
    want = ["Estimated memory needed for params, optim states and gradients for a:",
            "HW: Setup with 1 node, 8 GPUs per node.",
            "SW: Model with 6738M total params, 131M largest layer params.", "  per CPU  |  per GPU |   Options"]
    for opt, param in ((True, True), (True, False), (False, False)):
        for init in (True, False):
            want.append(_line(*_ds_zero3(P, L, 8, 1, opt, param, init),
                              f"offload_param={'cpu ' if param else 'none'}, "
                              f"offload_optimizer={'cpu ' if opt else 'none'}, zero_init={int(init)}"))
    assert capsys.readouterr().out.splitlines() == want
    # live: from a module (on the meta device: nothing allocated); the tied head counts once.
    with torch.device("meta"):
        gpt = GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_layers=2, n_heads=2)
    total = sum(p.numel() for p in gpt.parameters())
    estimate_zero2_model_states_mem_needs_all_live(gpt, num_gpus_per_node=2)
    assert capsys.readouterr().out.splitlines()[-1] == _line(*_ds_zero2(total, 2, 1, False), "offload_optimizer=none")
    estimate_zero3_model_states_mem_needs_all_live(gpt)
    assert capsys.readouterr().out.splitlines()[-1] == _line(
        *_ds_zero3(total, 1088, 1, 1, False, False, False), "offload_param=none, offload_optimizer=none, zero_init=0")
    # Each DeepSpeed module's model_to_params (stage 3's also gives the largest layer).
    from zeroshard.planner import zero2_model_to_params, zero3_model_to_params
    assert zero2_model_to_params(gpt) == total and zero3_model_to_params(gpt) == (total, 1088)


def test_deepspeed_module_paths_reach_the_estimators(tmp_path):
    """deepspeed.runtime.zero.stage3 / stage_1_and_2 in the compatibility package (its source, with
    the version file its build writes) are zeroshard's functions."""
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "compat", "deepspeed", "src"), src)
    (src / "deepspeed" / "_version.py").write_text('__version__ = "0.19.8+zeroshard.test"\n')
    code = ("import deepspeed, zeroshard.planner as p\n"
            "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold as a\n"
            "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live as b\n"
            "assert a is p.estimate_zero3_model_states_mem_needs_all_cold\n"
            "assert b is p.estimate_zero2_model_states_mem_needs_all_live\n"
            "from deepspeed.runtime.zero.stage3 import model_to_params as c\n"
            "from deepspeed.runtime.zero.stage_1_and_2 import model_to_params as d\n"
            "assert c is p.zero3_model_to_params and d is p.zero2_model_to_params\n"
            "assert deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live"
            " is p.estimate_zero3_model_states_mem_needs_all_live\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
