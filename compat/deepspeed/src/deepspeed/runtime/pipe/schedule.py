"""Not supported by zeroshard: importing this fails with the reason (deepspeed/_unsupported.py)."""
from deepspeed._unsupported import refuse_import

refuse_import(__name__)
