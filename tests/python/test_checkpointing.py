"""DeepSpeed's activation checkpointing API as Megatron-style scripts call it, in a model that is
not pipelined: `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`, then
`deepspeed.checkpointing.checkpoint(block, x)` in forward. Same values and gradients as without
it, the block run again in backward, and cpu_checkpointing from the config or the argument. The
RNG tracker: fork() streams that are reproducible and leave the default stream alone, names and
seeds used once, and Megatron-DeepSpeed's seeding with dropout inside fork() under checkpoint."""
import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zeroshard import checkpointing
from zeroshard.accelerator import get_accelerator


class Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.fc(x))


@pytest.fixture(autouse=True)
def _reset():
    yield
    checkpointing.configure(None, checkpoint_in_cpu=False)
    checkpointing._settings["mpu"] = None
    checkpointing.get_cuda_rng_tracker().reset()


def _grads(use_checkpoint):
    block = Counting()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = checkpointing.checkpoint(block, x) if use_checkpoint else block(x)
    y.square().sum().backward()
    return y.detach(), x.grad, block.fc.weight.grad, block.calls


def test_checkpoint_recomputes_and_matches():
    y0, gx0, gw0, calls0 = _grads(False)
    y1, gx1, gw1, calls1 = _grads(True)
    assert calls0 == 1 and calls1 == 2  # the forward ran again in backward
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)


def test_cpu_checkpointing_from_the_config_keeps_inputs_on_the_host(monkeypatch):
    entered, packed = [], []
    real = torch.autograd.graph.save_on_cpu

    def spy(*args, **kwargs):
        entered.append(kwargs)
        hooks = real(*args, **kwargs)
        pack = hooks.pack_hook

        def recording(tensor):  # what the hooks move to the host: the checkpoint's saved input
            packed.append(tuple(tensor.shape))
            return pack(tensor)

        hooks.pack_hook = recording
        return hooks

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.is_configured()
    _, gx, _, _ = _grads(True)
    assert len(entered) == 1 and gx is not None
    assert (4, 8) in packed, packed  # the input x went through save_on_cpu's pack hook
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                            checkpoint_in_cpu=False)  # the argument wins over the config
    _grads(True)
    assert len(entered) == 1


def test_what_it_cannot_do_is_an_error(monkeypatch):
    said = []
    monkeypatch.setattr(checkpointing, "log_rank0", lambda msg, rank: said.append(msg))
    with pytest.raises(ValueError, match="contiguous_memory_optimization.*needs partition_activations"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    # Two tensor-parallel ranks to split each activation over: zeroshard has none.
    with pytest.raises(ValueError, match="partition_activations.*2 tensor-parallel ranks"):
        checkpointing.configure(_megatron_mpu(0), partition_activations=True)
    # The mpu an earlier call gave is kept when a later one gives None, as in DeepSpeed.
    checkpointing.configure(_megatron_mpu(0))
    with pytest.raises(ValueError, match="partition_activations.*2 tensor-parallel ranks"):
        checkpointing.configure(None, partition_activations=True)
    # One tensor-parallel rank: a pipeline grid (two stages, whose get_model_parallel_* count them,
    # one slice), then no mpu, as DeepSpeed's tests/unit/pipe calls it: nothing to split, so it runs
    # and says that both options change nothing.
    grid = types.SimpleNamespace(get_slice_parallel_rank=lambda: 0, get_slice_parallel_world_size=lambda: 1,
                                 get_model_parallel_rank=lambda: 1, get_model_parallel_world_size=lambda: 2)
    checkpointing.configure(grid, partition_activations=True)
    checkpointing._settings["mpu"] = None
    checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=9)
    assert any("partition_activations=True has no effect" in m for m in said), said
    assert any("contiguous_memory_optimization=True has no effect" in m for m in said), said
    checkpointing.reset()


def test_deepspeed_names(tmp_path):
    import json
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "activation_checkpointing": {"cpu_checkpointing": True}}))
    checkpointing.configure(None, deepspeed_config=str(path))
    assert checkpointing._settings["cpu_checkpointing"] is True
    checkpointing.reset()


# ----- the RNG tracker: on the engine's device (CUDA where available, else the CPU) -----

def _device():
    return torch.device(get_accelerator().device_name())


def _draws(n, seed=None):
    """n uniform draws from the default generator, or from a fresh one seeded with `seed`."""
    if seed is None:
        return torch.rand(n, device=_device())
    return torch.rand(n, device=_device(), generator=torch.Generator(device=_device()).manual_seed(seed))


def test_fork_streams_are_reproducible_and_leave_the_default_alone():
    tracker = checkpointing.get_cuda_rng_tracker()
    tracker.add("a", 7)
    tracker.add("b", 8)
    start = tracker.get_states()
    torch.manual_seed(0)
    default_alone = _draws(6)

    torch.manual_seed(0)
    d1 = _draws(3)
    with tracker.fork("a"):
        a1 = _draws(4)
    d2 = _draws(3)
    with tracker.fork("a"):
        a2 = _draws(4)
    with tracker.fork("b"):
        b1 = _draws(4)
    assert torch.equal(torch.cat([d1, d2]), default_alone)  # the forks drew nothing from it
    assert torch.equal(torch.cat([a1, a2]), _draws(8, seed=7))  # one stream, continued across forks
    assert torch.equal(b1, _draws(4, seed=8))

    tracker.set_states(start)  # get_states / set_states rewind the streams
    with tracker.fork("a"):
        assert torch.equal(_draws(4), a1)

    torch.manual_seed(5)
    with pytest.raises(RuntimeError, match="inside"):
        with tracker.fork("b"):
            _draws(2)
            raise RuntimeError("inside")
    assert torch.equal(_draws(2), _draws(2, seed=5))  # the default is back after an exception too
    with pytest.raises(ValueError, match="RNG state 'c' is not added; tracked states are \\['a', 'b'\\]"):
        with tracker.fork("c"):
            pass


def test_add_refuses_a_name_or_a_seed_twice():
    tracker = checkpointing.get_cuda_rng_tracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="RNG state 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    assert list(tracker.get_states()) == ["a"]  # a refused add changes nothing
    tracker.add("b", 2)
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add("a", 1)  # after reset, names and seeds are free again


# What megatron/core/tensor_parallel/random.py (Megatron-DeepSpeed) does once DeepSpeed's
# checkpointing is configured: its tracker, seeding and checkpoint are DeepSpeed's.
def _megatron_random(deepspeed):
    def get_cuda_rng_tracker():
        assert deepspeed.checkpointing.is_configured()
        return deepspeed.checkpointing.get_cuda_rng_tracker()

    def model_parallel_cuda_manual_seed(seed):
        assert deepspeed.checkpointing.is_configured()
        return deepspeed.checkpointing.model_parallel_cuda_manual_seed(seed)

    def checkpoint(function, distribute_saved_activations, *args):
        return deepspeed.checkpointing.checkpoint(function, *args)

    return types.SimpleNamespace(get_cuda_rng_tracker=get_cuda_rng_tracker, checkpoint=checkpoint,
                                 model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed)


def _megatron_mpu(tp_rank):
    """The parts of megatron.core.mpu (parallel_state) that DeepSpeed's checkpointing reads."""
    return types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: tp_rank,
                                 get_tensor_model_parallel_world_size=lambda: 2,
                                 get_tensor_model_parallel_group=lambda: None,
                                 get_data_parallel_rank=lambda: 0)


class MegatronBlock(torch.nn.Module):
    """Dropout inside the tensor-parallel region (under fork()) and outside it (default stream),
    as ParallelAttention and the residual path have them."""

    def __init__(self, tensor_parallel):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(8, 8)
        self.tp = tensor_parallel
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.fc(x)
        with self.tp.get_cuda_rng_tracker().fork():
            h = F.dropout(h, p=0.5, training=True)
        return F.dropout(torch.tanh(h), p=0.3, training=True)


@pytest.mark.parametrize("checkpointed", [False, True, "non_reentrant"])
def test_megatron_deepspeed_seeding_and_dropout_under_checkpoint(checkpointed):
    import zeroshard as deepspeed
    tp = _megatron_random(deepspeed)
    tp_rank, seed = 1, 1234
    # megatron/initialize.py: setup_deepspeed_random_and_activation_checkpointing(args)
    deepspeed.checkpointing.configure(_megatron_mpu(tp_rank), partition_activations=False,
                                      contiguous_checkpointing=False, num_checkpoints=2,
                                      checkpoint_in_cpu=False, synchronize=False, profile=False)

    def set_random_seed():  # megatron/initialize.py: _set_random_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        tp.model_parallel_cuda_manual_seed(seed)

    set_random_seed()
    states = tp.get_cuda_rng_tracker().get_states()
    # The default stream is `seed`; the model-parallel one seed + 2718 + the tensor-parallel rank.
    assert list(states) == ["model-parallel-rng"]
    assert torch.equal(states["model-parallel-rng"],
                       torch.Generator(device=_device()).manual_seed(seed + 2718 + tp_rank).get_state())
    assert torch.equal(_draws(3), _draws(3, seed=seed))

    def train(run_checkpointed):
        set_random_seed()
        block = MegatronBlock(tp).to(_device())
        x = torch.randn(4, 8, device=_device(), generator=torch.Generator(device=_device()).manual_seed(1),
                        requires_grad=True)
        y = x
        for _ in range(2):  # two layers: the tracker has moved on by the first one's backward
            if run_checkpointed == "non_reentrant":
                y = deepspeed.checkpointing.non_reentrant_checkpoint(block, y)
            elif run_checkpointed:
                y = tp.checkpoint(block, False, y)
            else:
                y = block(y)
        y.square().sum().backward()
        return y.detach(), x.grad, block.fc.weight.grad

    plain = train(False)
    assert (plain[0] == 0).any()  # the dropouts dropped
    got = train(checkpointed)
    for a, b in zip(plain, got):
        assert torch.equal(a, b)  # the recomputation drew the forward's masks, in both streams


def test_split_backward_recomputes_with_the_forwards_masks_each_time():
    # Zero bubble's two passes: input gradients first (the graph kept), weight gradients later.
    # Each recomputes the segment, and each must draw the forward's masks.
    import zeroshard as deepspeed
    tp = _megatron_random(deepspeed)
    deepspeed.checkpointing.configure(None)

    def run(checkpointed):
        checkpointing.model_parallel_cuda_manual_seed(3)
        block = MegatronBlock(tp).to(_device())
        x = torch.randn(4, 8, device=_device(), requires_grad=True)
        y = checkpointing.checkpoint(block, x) if checkpointed else block(x)
        loss = y.square().sum()
        (grad_x,) = torch.autograd.grad(loss, x, retain_graph=True)
        with tp.get_cuda_rng_tracker().fork():  # the stream moves on between the two passes
            torch.rand(5, device=_device())
        torch.autograd.backward(loss, inputs=[block.fc.weight, block.fc.bias])
        return block.calls, y.detach(), grad_x, block.fc.weight.grad, block.fc.bias.grad

    plain, got = run(False), run(True)
    assert (plain[0], got[0]) == (1, 3)  # the forward, then one recomputation per pass
    for a, b in zip(plain[1:], got[1:]):
        assert torch.equal(a, b)


# mpu naming generations: Megatron's tensor rank, DeepSpeed's grid (slice rank), the oldest.
MPUS = {
    "megatron": (types.SimpleNamespace(get_tensor_model_parallel_rank=lambda: 3), 3),
    "deepspeed-grid": (types.SimpleNamespace(get_slice_parallel_rank=lambda: 0,
                                             get_model_parallel_rank=lambda: 5), 0),
    "legacy": (types.SimpleNamespace(get_model_parallel_rank=lambda: 2), 2),
    "none": (None, 0),
}


@pytest.mark.parametrize("kind", list(MPUS))
def test_model_parallel_seed_follows_the_mpus_tensor_rank(kind):
    mpu, tp_rank = MPUS[kind]
    checkpointing.configure(mpu)
    checkpointing.model_parallel_cuda_manual_seed(10)
    with checkpointing.get_cuda_rng_tracker().fork():
        assert torch.equal(_draws(4), _draws(4, seed=10 + 2718 + tp_rank))
    checkpointing.model_parallel_reconfigure_tp_seed(20)  # re-seeds that stream only
    with checkpointing.get_cuda_rng_tracker().fork():
        assert torch.equal(_draws(4), _draws(4, seed=20 + 2718 + tp_rank))
    assert torch.equal(_draws(4), _draws(4, seed=10))
