"""deepspeed.runtime.data_pipeline.curriculum_scheduler: CurriculumScheduler as a name, so that a
module importing it loads; building one is an error (zeroshard has no curriculum learning, and
its config refuses curriculum_learning too)."""
from deepspeed._unsupported import refuse_call


class CurriculumScheduler:
    def __init__(self, *args, **kwargs):
        refuse_call("deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler")
