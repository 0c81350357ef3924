"""How a checkpoint numbers the optimizer's parameter groups, and how its groups meet the run's.

A checkpoint saved now numbers the groups as optimizer.param_groups lists them (optimizer.py: also a
group with nothing to train on the saving rank, all frozen or, in a pipeline, on other stages), in
its "param_groups" section, the layout's per-parameter "group" and the training state's
"group_steps"; the layout's optimizer entry says so (EVERY_GROUP). So do DeepSpeed's checkpoints
(their optimizers' param_groups, which keep an all-frozen group too). An older zeroshard checkpoint
counted only the groups with trainable parameters, each pipeline stage its own.

The C++ core holds only the groups with parameters (optimizer.held_groups): its training state's
group_steps are one per held group, which is what save and load convert from and to."""

EVERY_GROUP = "every_param_group"  # the layout's optimizer entry: groups numbered as passed


def numbered_as_passed(source, layout) -> bool:
    return source.kind != "zeroshard" or bool(layout["optimizer"].get(EVERY_GROUP))


def saved_group_targets(optimizer, source, layout) -> list:
    """The run's group (an index into optimizer.param_groups) of each saved group, in saved order."""
    if numbered_as_passed(source, layout):
        return list(range(len(optimizer.param_groups)))
    return list(optimizer.held_groups)


def steps_as_passed(group_steps, optimizer, applied_steps: int) -> list:
    """The core's group_steps (one per held group) as one per group the script passed. A group this
    rank does not hold gets the step count of those it holds (every group steps together), or the
    applied steps (global minus skipped) where it holds none."""
    common = max(group_steps, default=applied_steps)
    out = [common] * len(optimizer.param_groups)
    for held, steps in zip(optimizer.held_groups, group_steps):
        out[held] = steps
    return out


def held_steps(saved_steps, targets, optimizer) -> list:
    """A checkpoint's group_steps (one per saved group; `targets` from saved_group_targets) as the
    core's, one per held group."""
    position = {target: i for i, target in enumerate(targets)}
    return [saved_steps[position[held]] for held in optimizer.held_groups]
