"""The training precisions by the names the config and checkpoints use ("fp32", "bf16", "fp16"),
and their torch dtypes: the one table of them."""
import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_OF = {dtype: name for name, dtype in PRECISIONS.items()}
