"""Checkpoints: `engine.save_checkpoint` / `engine.load_checkpoint` (save.py, load.py) on the C++
storage layer (runtime/checkpoint: safetensors shard files, the JSON manifest, the staged directory).

A checkpoint is `<save_dir>/<tag>/`: one `rankNNNNN.safetensors` per rank and `manifest.json`. Each
tensor is named by what it is and whose it is (layout.py): `param/<name>` (the model's weights in
its dtype), `master/<name>` (fp32 masters of a 16-bit run), `optim/<state>/<name>` (torch.optim's
state names), `buffer/<name>` and `client/<path>` (tensors in client_state); the manifest says which
element range of each lives in which file, so any world size and stage can read it."""
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint"]
