import copy, os
import torch
from harness import run_distributed
from test_engine import _base_config

def w(stage, f):
    import zeroshard
    from zeroshard.utils import safe_get_full_grad
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    reference = copy.deepcopy(model)
    cfg = _base_config(communication_data_type="bf16", gradient_predivide_factor=f,
                       zero_optimization={"stage": stage})
    engine, *_ = zeroshard.initialize(model=model, config=cfg)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
    engine.backward(engine(x).pow(2).mean())
    reference(x).pow(2).mean().backward()
    flat = torch.cat([reference.weight.grad.reshape(-1), reference.bias.grad])
    got = torch.cat([safe_get_full_grad(model.weight).reshape(-1), safe_get_full_grad(model.bias)])
    bf = torch.bfloat16
    a = (flat.to(bf) * (1/f))
    i = (got != a.float() * f).nonzero()[0].item()
    return dict(g=flat[i].item(), gbf=flat[i].to(bf).item(), a=a[i].item(), got=got[i].item(), af=a[i].float().item()*f, ratio=got[i].item()/flat[i].to(bf).item())

if __name__ == "__main__":
    print(run_distributed(w, 1, 2, 3.0)[0])
