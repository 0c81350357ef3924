"""deepspeed.runtime.bf16_optimizer: BF16_Optimizer as a name, for the isinstance checks scripts make
(GPT-NeoX: `isinstance(engine.optimizer, BF16_Optimizer)`, false here, then optimizer.overflow,
which zeroshard's optimizer has). Building one is an error that says what to do instead."""
from deepspeed._unsupported import refuse_call


class BF16_Optimizer:
    def __init__(self, *args, **kwargs):
        refuse_call("deepspeed.runtime.bf16_optimizer.BF16_Optimizer")
