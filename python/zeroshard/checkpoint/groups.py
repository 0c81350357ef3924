"""How a checkpoint numbers the optimizer's parameter groups, and how its groups meet the run's.

A checkpoint saved now numbers the groups as optimizer.param_groups lists them (optimizer.py: also
a group with nothing to train on the saving rank, all frozen or, in a pipeline, on other stages),
in its "param_groups" section, the layout's per-parameter "group" and the training state's
"group_steps"; the layout's optimizer entry says so (EVERY_GROUP true). So do DeepSpeed's
checkpoints (their engines' param_groups). EVERY_GROUP false: a pipeline whose stages passed
different lists of groups (pipe/engine.py), each stage numbering its own, saved stage 0's; the
other stages' groups are not in it. Without the entry (an older zeroshard checkpoint) the groups counted are
those with trainable parameters, each pipeline stage its own.

The C++ core holds only the groups with parameters (optimizer.held_groups): its training state's
group_steps are one per held group, which is what save and load convert from and to."""

EVERY_GROUP = "every_param_group"  # the layout's optimizer entry: groups numbered as listed


def numbered_as_passed(source, layout) -> bool:
    return source.kind != "zeroshard" or layout["optimizer"].get(EVERY_GROUP) is True


def saved_group_targets(optimizer, source, layout):
    """The run's group (an index into optimizer.param_groups) of each saved group, in saved order;
    None where the checkpoint cannot say (EVERY_GROUP false)."""
    if numbered_as_passed(source, layout):
        return list(range(len(optimizer.param_groups)))
    if layout["optimizer"].get(EVERY_GROUP) is False:
        return None
    return list(optimizer.held_groups)


def steps_as_passed(group_steps, optimizer) -> list:
    """The core's group_steps (one per held group; it holds one at least) as one per listed group. A
    group this rank does not hold gets the count of those it holds: every group steps together."""
    out = [max(group_steps)] * len(optimizer.param_groups)
    for held, steps in zip(optimizer.held_groups, group_steps):
        out[held] = steps
    return out


def held_steps(saved_steps, targets, optimizer) -> list:
    """A checkpoint's group_steps (one per saved group; `targets` from saved_group_targets) as the
    core's, one per held group."""
    position = {target: i for i, target in enumerate(targets)}
    return [saved_steps[position[held]] for held in optimizer.held_groups]


def _per_group(value) -> bool:
    """A scheduler state's list that holds one entry per group: numbers (base_lrs, _last_lr, ...) or
    LambdaLR's lr_lambdas (None or a callable object's dict)."""
    return isinstance(value, list) and all(v is None or isinstance(v, (int, float, dict)) for v in value)


def scheduler_state_for_run(saved, scheduler, targets, count):
    """An LR scheduler's state_dict as this run's `count` groups take it. Saved with fewer groups (an
    older checkpoint; `targets` says which run groups its groups are), each per-group list (base_lrs,
    _last_lr, ...) gets the saved values at the targets and `scheduler`'s own elsewhere. Saved by a
    pipeline whose stages numbered their own groups (targets None), the lists are stage 0's: this
    run's own stay, and the rest (the step count) loads. SequentialLR's and ChainedScheduler's inner
    schedulers are taken the same way, each by its own."""
    if (targets is not None and len(targets) == count) or not hasattr(scheduler, "state_dict"):
        return saved
    current, out = scheduler.state_dict(), dict(saved)
    inner, saved_inner = getattr(scheduler, "_schedulers", None), saved.get("_schedulers")
    if isinstance(saved_inner, list) and isinstance(inner, list) and len(inner) == len(saved_inner):
        out["_schedulers"] = [scheduler_state_for_run(state, sub, targets, count)
                              for state, sub in zip(saved_inner, inner)]
    for key, value in saved.items():
        mine = current.get(key)
        if key == "_schedulers" or not (_per_group(value) and _per_group(mine) and len(mine) == count):
            continue
        if targets is None:
            out[key] = mine
        elif len(value) == len(targets):
            merged = list(mine)
            for target, v in zip(targets, value):
                merged[target] = v
            out[key] = merged
    return out
