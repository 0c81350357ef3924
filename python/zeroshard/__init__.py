"""zeroshard: ZeRO sharding, offload and pipeline runtime for PyTorch, driven by DeepSpeed's
ds_config.json. DeepSpeed scripts run unchanged with `import zeroshard as deepspeed`."""

__version__ = "0.1.0"

from zeroshard.comm import init_distributed  # noqa: E402
from zeroshard.config import add_config_arguments  # noqa: E402
from zeroshard.engine import ZeroShardEngine, initialize  # noqa: E402

DeepSpeedEngine = ZeroShardEngine

__all__ = ["initialize", "init_distributed", "add_config_arguments", "ZeroShardEngine",
           "DeepSpeedEngine", "__version__"]
