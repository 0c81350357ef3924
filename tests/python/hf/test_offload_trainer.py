"""Hugging Face Trainer with ZeRO-Offload (issue 19) as HF's docs write it: the stage-2 "auto"
config plus "offload_optimizer": {"device": "cpu", "pin_memory": true}, on 2 Gloo ranks. It trains
as the same run without offload does (fp32: losses within 1e-5 relative) and the optimizer state
is in host memory. Run as a script, this file is hf_trainer_worker.py that then writes the engine's
memory_bytes() (rank 0, <out>/memory.json)."""
import json
import os
import runpy

import hf_common as C

HERE = os.path.dirname(os.path.abspath(__file__))


def offload_args(runs, name):
    cfg = C.deepspeed_config(2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return ["--out", runs.out(name), "--model", runs.init_dir, "--deepspeed", runs.config(name, cfg)]


if __name__ == "__main__":
    worker = runpy.run_path(os.path.join(HERE, "hf_trainer_worker.py"), run_name="__main__")
    engine = worker["trainer"].model_wrapped  # the engine deepspeed.initialize gave the Trainer
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(worker["args"].out, "memory.json"), "w") as f:
            json.dump(engine.memory_bytes(), f)
else:
    import pytest

    from hf_runs import Runs, load_json
    from test_hf_trainer import LOSS_RTOL, assert_close_by_step, logged, trainer_args

    RUNS = {"zero2": trainer_args(stage=2), "zero2-offload": ("test_offload_trainer.py", offload_args)}

    @pytest.fixture(scope="module")
    def runs(compat_python, tmp_path_factory):
        return Runs(compat_python, str(tmp_path_factory.mktemp("hf_offload")), RUNS)

    def test_trainer_with_offload_optimizer_trains_like_without_and_keeps_the_state_on_the_host(runs):
        ref, run = runs.get("zero2"), runs.get("zero2-offload")
        losses = logged(run, "loss")
        assert_close_by_step(losses, logged(ref, "loss"), LOSS_RTOL, "loss with offload_optimizer")
        assert losses[C.STEPS] < losses[1], f"the loss did not go down: {losses}"
        memory = load_json(os.path.join(run, "memory.json"))
        assert memory["host_optimizer_state"] > 0 and memory["host_master_weights"] > 0, memory
        assert memory["optimizer_state"] == 0 and memory["master_weights"] == 0, memory
