"""DeepSpeed's activation checkpointing API as Megatron-style scripts call it, in a model that is
not pipelined: `deepspeed.checkpointing.configure(mpu, deepspeed_config=...)`, then
`deepspeed.checkpointing.checkpoint(block, x)` in forward. Same values and gradients as without
it, the block run again in backward, and cpu_checkpointing from the config or the argument."""
import pytest
import torch

from zeroshard import checkpointing


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
    entered = []
    real = torch.autograd.graph.save_on_cpu

    def spy(*args, **kwargs):
        entered.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy)
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})
    assert checkpointing.is_configured()
    _, gx, _, _ = _grads(True)
    assert len(entered) == 1 and gx is not None
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                            checkpoint_in_cpu=False)  # the argument wins over the config
    _grads(True)
    assert len(entered) == 1


def test_what_it_cannot_do_is_an_error():
    with pytest.raises(ValueError, match="contiguous_memory_optimization"):
        checkpointing.configure(None, contiguous_checkpointing=True)


def test_deepspeed_names(tmp_path):
    import json
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                "activation_checkpointing": {"cpu_checkpointing": True}}))
    checkpointing.configure(None, deepspeed_config=str(path))
    assert checkpointing._settings["cpu_checkpointing"] is True
    checkpointing.reset()
