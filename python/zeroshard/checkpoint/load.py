"""engine.load_checkpoint: each rank reads the keys that hold the element ranges it keeps under
this run's world size and stage, whatever wrote the checkpoint (any world, any ZeRO stage, fp32 or
16-bit, or DeepSpeed), then the training state, LR scheduler and client_state.

In phases, each ended by an agreement of all ranks so that a rank that fails never leaves the
others waiting in another collective: rank 0 finds the tag; every rank checks the checkpoint
against the run (names, shapes, optimizer, files present and whole) before anything is written;
then reads into the run; then stage 3 gathers its persistent parameters again. A pipeline engine
loads the same way, each rank reading its stage's names; a pipeline's checkpoint loads into the
same layers without a pipeline and back through checkpoint/pipeline.py's renaming of ties."""
import os
import time

import torch

from zeroshard.observe.bars import bar

from zeroshard.checkpoint.collective import broadcast_text, held_anywhere, raise_if_failed
from zeroshard.checkpoint.groups import (held_steps, numbered_as_passed, saved_group_targets,
                                         scheduler_state_for_run)
from zeroshard.checkpoint.layout import RunView, buffer_key, decode_client_state, tensor_name
from zeroshard.checkpoint.pipeline import in_run_names, outside_layers, tie_groups, tie_keys
from zeroshard.checkpoint.sources import find_checkpoint, open_source
from zeroshard.log import log_rank0, logger

_PARTIAL = ("; the engine now holds a partial load: load a complete checkpoint before training on")


def _saved_shapes(source, layout):
    saved = {p["name"]: list(p["shape"]) for p in layout["params"]}
    saved.update((n, list(source.shape(buffer_key(n)))) for n in layout["buffers"] if source.has(buffer_key(n)))
    return saved


def _my_shapes(run):
    mine = dict(zip(run.names, run.shapes))
    mine.update((n, list(p.shape)) for n, p in run.loose)
    mine.update((n, list(b.shape)) for n, b in run.buffers)
    return mine


def _check_names(run, source, layout, strict, held):
    """Names and shapes of parameters and buffers that the model and the checkpoint do not share: an
    error under strict, a warning listing them otherwise; returns the names to skip. `held`: the
    saved names some rank of the run holds (in a pipeline, each rank holds one stage's)."""
    saved = _saved_shapes(source, layout)
    mine = _my_shapes(run)
    missing = [n for n in mine if n not in saved]
    unsaved = []
    if layout.get("layers_only") and run.placement.pipeline is not None:
        # What a pipeline holds beside its layers (a loss_fn module's) was not saved.
        unsaved = [n for n in missing if outside_layers(n)]
        missing = [n for n in missing if n not in unsaved]
        told = [n for n in unsaved if n not in run.placement.not_written]  # once: where a save writes them
        if told and run.placement.describes:
            logger.warning(f"[rank {run.rank}] load_checkpoint: {', '.join(told[:8])} left as built: a "
                           f"{source.kind} checkpoint holds the layers only")
    if layout.get("frozen_excluded"):  # frozen parameters were left out on purpose
        frozen = {n for n, t in zip(run.names, run.trainable) if not t}
        frozen |= {n for n, p in run.loose if not p.requires_grad}
        missing = [n for n in missing if n not in frozen]
    unexpected = [n for n in saved if n not in held]
    wrong = [n for n in mine if n in saved and saved[n] != list(mine[n])]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"not in the model: {', '.join(unexpected[:8])}")
    if wrong:
        problems.append("shapes differ: " + ", ".join(f"{n} (checkpoint {saved[n]}, model {list(mine[n])})"
                                                      for n in wrong[:8]))
    if problems and strict:
        raise ValueError("load_checkpoint: the model's parameters and buffers and the checkpoint's differ; "
                         + "; ".join(problems) + " (load_module_strict=False loads the rest)")
    if problems:
        message = "warning: load_checkpoint (load_module_strict=False) skips " + "; ".join(problems)
        if run.placement.names_split and run.placement.describes and run.rank != 0:
            logger.warning(f"[rank {run.rank}] {message}")  # its stage's own names: rank 0 does not hold them
        else:
            log_rank0(message, run.rank)
    return set(missing) | set(wrong) | set(unsaved)


def _check_optimizer(engine, run, source, layout, skip):
    """Loading optimizer state needs the same optimizer: another one's state names (or, for a
    zeroshard checkpoint, its type), another number of parameter groups, a parameter in another
    group than where it was saved, or a parameter this run trains without saved state (where others
    have it) are an error."""
    saved = layout["optimizer"]
    if saved.get("unread"):
        raise ValueError(f"load_checkpoint: {saved['unread']}; pass load_optimizer_states=False (or "
                         "load_module_only=True) to load the weights and let this run's optimizer start anew")
    same_states = list(saved["state_names"]) == list(run.core.state_names)
    same_type = source.kind != "zeroshard" or saved["type"] == run.core.optimizer_type
    if not (same_states and same_type):
        raise ValueError(f"load_checkpoint: the checkpoint was saved with the {saved['type']} optimizer "
                         f"(state {', '.join(saved['state_names']) or 'none'}), this run uses "
                         f"{run.core.optimizer_type} (state {', '.join(run.core.state_names) or 'none'}); "
                         "pass load_optimizer_states=False to load the weights only")
    groups = source.section("param_groups")
    targets = saved_group_targets(engine.optimizer, source, layout)
    if targets is None:
        raise ValueError("load_checkpoint: the checkpoint was saved by a pipeline whose stages passed different "
                         "lists of param groups, each stage numbering its own, and holds stage 0's only, so it "
                         "cannot say which group a later stage's parameters were in; pass "
                         "load_optimizer_states=False to load the weights only")
    if groups is not None and len(groups) != len(targets):
        raise ValueError(f"load_checkpoint: the checkpoint has {len(groups)} parameter groups, this run "
                         f"{len(targets)}; pass load_optimizer_states=False to load the weights only")
    # Each saved group's hyper-parameters load onto the run's group it targets, so each parameter must
    # sit in that group. Comparable where both number the same groups: as the script passed them, or
    # (an older zeroshard checkpoint) those with parameters, of one whole model on both sides.
    one_model = (layout.get("num_stages", 1) == 1 and source.section("pipeline") is None
                 and run.placement.pipeline is None)
    target = dict(enumerate(targets))
    saved_group = {p["name"]: target.get(p["group"], p["group"])
                   for p in layout["params"] if p.get("group") is not None}
    comparable = numbered_as_passed(source, layout) or one_model
    moved = [f"{n} (checkpoint {saved_group[n]}, this run {g})" for n, g in zip(run.names, run.groups)
             if g is not None and n not in skip and saved_group.get(n, g) != g] if comparable else []
    if moved:
        more = f" and {len(moved) - 8} more" if len(moved) > 8 else ""
        raise ValueError(f"load_checkpoint: parameters sit in other param groups than in the checkpoint (group "
                         f"positions in the optimizer's param_groups): {', '.join(moved[:8])}{more}; build the "
                         "optimizer's groups as the saved run did, or pass load_optimizer_states=False to load "
                         "the weights only")
    lacking = [n for n, t in zip(run.names, run.trainable) if t and n not in skip
               and not all(source.has(tensor_name(k, n)) for k in run.core.state_names)]
    if lacking and _has_states(run, source):
        raise ValueError(f"load_checkpoint: the checkpoint has no optimizer state for {', '.join(lacking[:8])}, "
                         "which this run trains (frozen where it was saved?); pass load_optimizer_states=False "
                         "to load the weights only")


def _source_of(source, kind, name, same_dtype, states_asked):
    """Which stored tensor fills `kind` of parameter `name`. A source whose masters belong to its
    optimizer state (masters_with_optimizer: DeepSpeed's checkpoints, as DeepSpeed loads them) is
    read for them only when the caller asked for that state; otherwise masters and weights both
    come from its weights."""
    master, param = tensor_name("master", name), tensor_name("param", name)
    use_master = source.has(master) and (states_asked or not source.masters_with_optimizer)
    if kind == "param":  # the saved copy only in the same dtype, else the fp32 masters rounded
        return param if same_dtype or not use_master else master
    if kind == "master":
        return master if use_master else param
    return tensor_name(kind, name)


def _has_states(run, source):
    return any(source.has(tensor_name(k, n)) for k in run.core.state_names
               for n, t in zip(run.names, run.trainable) if t)


def _load_weights(run, source, skip, load_states):
    """Everything the run holds, read into its live storage (no collective)."""
    same_dtype = source.section("layout")["dtype"] == run.dtype_name
    states_asked = load_states
    if load_states and not _has_states(run, source):
        run.core.drop_optimizer_state()  # saved before its first step: so is this run now
        load_states = False
    entries = run.core.shard_entries(load_states)
    for kind, index, begin, values, _ in bar(entries, desc=f"loading {source.path}", unit="piece"):
        name = run.names[index]
        if name in skip or (kind not in ("param", "master") and not load_states):
            continue
        src = _source_of(source, kind, name, same_dtype, states_asked)
        if not source.has(src):
            if kind == "param" and not run.trainable[index]:
                continue  # a frozen parameter left out of the checkpoint (exclude_frozen_parameters)
            raise ValueError(f"load_checkpoint: {source.path} has no {src!r}")
        with torch.no_grad():
            source.read(src, begin, values)
    with torch.no_grad():
        for name, p in run.loose:
            if name not in skip and source.has(tensor_name("param", name)):
                source.read(tensor_name("param", name), 0, p.data)
        for name, b in run.buffers:
            if name not in skip:
                source.read(buffer_key(name), 0, b)


def _load_state(engine, run, source, layout, load_optimizer_states, load_lr_scheduler_states):
    saved = source.section("training_state")
    current = run.core.state.state_dict()
    targets = saved_group_targets(engine.optimizer, source, layout)
    if load_optimizer_states:
        saved = {**saved, "group_steps": held_steps(saved["group_steps"], targets, engine.optimizer)}
    else:  # Adam's step counts belong to the moments
        saved = {**saved, "group_steps": current["group_steps"]}
    # The loss scaler carries over only from fp16 to fp16; otherwise this run's own (its initial
    # scale, or static 1) stays.
    if not (load_optimizer_states and layout["dtype"] == "fp16" == run.dtype_name):
        saved = {**saved, "loss_scaler": current["loss_scaler"]}
    run.core.state.load_state_dict(saved)
    groups = decode_client_state(source.section("param_groups"))
    if load_optimizer_states and groups is not None:
        for target, theirs in zip(targets, groups):
            mine = engine.optimizer.param_groups[target]
            for key, value in theirs.items():
                if key in mine:
                    mine[key] = tuple(value) if isinstance(mine[key], tuple) else value
    sched = decode_client_state(source.section("lr_scheduler"))
    if load_lr_scheduler_states and engine.lr_scheduler is not None and sched is not None:
        try:
            sched = scheduler_state_for_run(sched, engine.lr_scheduler, targets, len(engine.optimizer.param_groups))
            engine.lr_scheduler.load_state_dict(sched)
        except Exception as e:  # noqa: BLE001 - named, with the way out
            raise ValueError(f"load_checkpoint: the checkpoint's LR scheduler state does not fit this run's "
                             f"{type(engine.lr_scheduler).__name__} ({e}); pass "
                             "load_lr_scheduler_states=False to keep this run's schedule") from e


def _agreed_checkpoint(run, load_dir, tag):
    """Rank 0 finds the tag (following `latest`); every rank gets it. None: no `latest`."""
    found, error = None, None
    try:
        if run.rank == 0:
            _, found = find_checkpoint(load_dir, tag)
    except Exception as e:  # noqa: BLE001 - every rank raises it below
        error = e
    raise_if_failed(run, error, f"load_checkpoint: finding the checkpoint in {os.fspath(load_dir)}")
    found = broadcast_text(run, found or "", "load_checkpoint: the tag")
    return found or None


def _num_stages(pipeline_section):
    return 1 if pipeline_section is None else pipeline_section["num_stages"]


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    run = RunView.of(engine)
    settings = engine._settings["checkpoint"]
    if custom_load_fn is not None:
        raise ValueError("load_checkpoint: custom_load_fn is not supported: zeroshard loads each rank's "
                         "shard by range and never builds the whole state_dict it would be given; load "
                         "the consolidated weights yourself (zeroshard.utils.zero_to_fp32) instead")
    if settings["load_universal"]:
        raise ValueError("checkpoint.load_universal: DeepSpeed universal checkpoints (ds_to_universal "
                         "output) are not read; zeroshard checkpoints load at any world size and stage "
                         "as they are, and DeepSpeed ZeRO checkpoints are read directly: set it false")
    load_dir = os.fspath(load_dir)
    tag = _agreed_checkpoint(run, load_dir, tag)
    if tag is None:
        log_rank0(f"warning: load_checkpoint: {load_dir} has no 'latest' file, so there is no checkpoint "
                  "to resume; nothing was loaded (pass tag=... to name one)", run.rank)
        return None, None
    t0 = time.perf_counter()
    states = load_optimizer_states and not load_module_only
    path, error = os.path.join(load_dir, tag), None
    try:  # everything checked before anything is written
        path, _ = find_checkpoint(load_dir, tag)
        source = open_source(path)
        if hasattr(source, "bind_ties"):  # a source whose files do not say which layers are tied
            source.bind_ties(tie_groups(run), tie_keys(run))
        source = in_run_names(source, run)
        source.open_all()
        layout = source.section("layout")
        saved_names = list(_saved_shapes(source, layout))
    except Exception as e:  # noqa: BLE001 - every rank learns which rank failed
        error = e
    raise_if_failed(run, error, f"load_checkpoint: checking {path}", consequence="; nothing was loaded")
    held = held_anywhere(run, saved_names, _my_shapes(run))  # a collective: after every rank opened it
    try:
        skip = _check_names(run, source, layout, load_module_strict, held)
        if states:
            _check_optimizer(engine, run, source, layout, skip)
    except Exception as e:  # noqa: BLE001 - every rank learns which rank failed
        error = e
    raise_if_failed(run, error, f"load_checkpoint: checking {path}", consequence="; nothing was loaded")
    try:
        _load_weights(run, source, skip, states)
        if not load_module_only:
            _load_state(engine, run, source, layout, states, load_lr_scheduler_states)
        client = decode_client_state(source.section("client_state") or {}, source.read_whole)
    except Exception as e:  # noqa: BLE001
        error = e
        run.core.end_entries(False)  # NVMe optimizer state stays as it is on disk
    raise_if_failed(run, error, f"load_checkpoint: reading {path}", consequence=_PARTIAL)
    engine.optimizer.after_load()  # a collective at stage 3: only once every rank has read
    saved_stages = layout.get("num_stages") or _num_stages(source.section("pipeline"))
    my_stages = _num_stages(run.placement.pipeline)
    if (layout["world_size"], layout["zero_stage"], layout["dtype"], saved_stages) != \
            (run.world, run.stage, run.dtype_name, my_stages):
        stages = f", {saved_stages} -> {my_stages} pipeline stage(s)" if saved_stages != my_stages else ""
        log_rank0(f"load_checkpoint: resharded a {source.kind} checkpoint saved at world "
                  f"{layout['world_size']}, ZeRO stage {layout['zero_stage']}, {layout['dtype']} to world "
                  f"{run.world}, stage {run.stage}, {run.dtype_name}{stages}", run.rank)
    log_rank0(f"load_checkpoint: {path} loaded in {time.perf_counter() - t0:.2f} s", run.rank)
    return os.path.join(load_dir, tag), client
