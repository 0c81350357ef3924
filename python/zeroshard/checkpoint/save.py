"""engine.save_checkpoint: every rank writes its pieces into one temporary directory beside the
target, rank 0 merges the ranks' manifests, and the directory is renamed into place only after
every rank reported success (runtime/checkpoint/atomic_dir.h). A failure anywhere leaves the
previous checkpoint and `latest` as they were, and every rank raises an error naming the rank.
A pipeline engine saves the same way over the whole world (checkpoint/pipeline.py says which
rank writes what); its other stages' layout entries reach rank 0 in their partial manifests."""
import os
import time

import zeroshard
from zeroshard import _C
from zeroshard.checkpoint.collective import broadcast_text, raise_if_failed, same_on_every_rank
from zeroshard.checkpoint.groups import steps_as_passed
from zeroshard.checkpoint.layout import (RunView, encode_client_state, encode_values, layout_entries,
                                         layout_section, rank_items)
from zeroshard.checkpoint.pipeline import STAGE_LAYOUT, join_stage_layouts, split_partial
from zeroshard.log import log_rank0

CK = _C.checkpoint
_UNCHANGED = "; nothing was committed, the previous checkpoint and 'latest' are unchanged"


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _partial_manifest(rank: int) -> str:
    return f"rank{rank:05d}.manifest.json"


def _agreed_tag(run, tag, validation):
    """The tag every rank saves under: rank 0's. Ranks that passed different ones are an error
    under tag_validation Fail, a warning under Warn."""
    if same_on_every_rank(run, tag, "save_checkpoint: tag check"):
        return tag
    used = broadcast_text(run, tag, "save_checkpoint: rank 0's tag")
    message = (f"save_checkpoint: the ranks passed different tags (rank {run.rank}: {tag!r}); "
               "checkpoint.tag_validation is " + validation)
    if validation == "Fail":
        raise ValueError(message + ": pass the same tag on every rank")
    if validation == "Warn":
        log_rank0(f"warning: {message}; saving under rank 0's tag {used!r}", run.rank)
    return used


def _training_state(run, optimizer):
    """The core's training state, its group_steps one per group the script passed (groups.py)."""
    state = run.core.state.state_dict()
    return {**state, "group_steps": steps_as_passed(state["group_steps"], optimizer)}


def _sections(engine, run, client_json, exclude_frozen):
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    scheduler = engine.lr_scheduler
    sched_state = scheduler.state_dict() if scheduler is not None and hasattr(scheduler, "state_dict") else None
    sections = {
        "layout": layout_section(run, exclude_frozen, layout_entries(run)),
        "training_state": _training_state(run, engine.optimizer),
        # inf (ReduceLROnPlateau's best), tuples (betas) come back as they were
        "param_groups": encode_values(groups, "optimizer.param_groups"),
        "lr_scheduler": encode_values(sched_state, "lr_scheduler.state_dict()"),
        "client_state": client_json,
        "config": engine.resolved_config(),
        "zeroshard": {"version": zeroshard.__version__},
    }
    if run.placement.pipeline is not None:
        sections["pipeline"] = run.placement.pipeline
    return sections


def _merge_partials(run, staged, manifest, sections):
    """Rank 0 merges the other ranks' manifests into its own; the stages' layout entries that
    come with them complete the layout (rank 0 holds only stage 0's parameters)."""
    stages = [sections["layout"]]  # rank 0's own entries (and the rest of the section)
    for r in range(1, run.world):
        path = staged.file(_partial_manifest(r))
        with open(path) as f:
            text, entries = split_partial(f.read())
        manifest.merge(CK.Manifest.parse(text, f"rank {r}'s manifest ({path})"))
        os.remove(path)
        if entries is not None:
            stages.append(entries)
    if run.placement.pipeline is not None:
        sections["layout"].update(join_stage_layouts(run.placement.pipeline, stages))


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False):
    run = RunView.of(engine)
    settings = engine._settings["checkpoint"]
    local_size = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE")  # ours, torchrun's
    if settings["use_node_local_storage"] and int(local_size or run.world) != run.world:
        raise ValueError("checkpoint.use_node_local_storage: true needs every rank on one node here: a "
                         "zeroshard checkpoint is one directory every rank writes and reads (which is "
                         "what lets it reshard); put save_dir on storage all nodes share, and set it false")
    tag = f"global_step{run.core.state.global_steps}" if tag is None else str(tag)
    tag = _agreed_tag(run, tag, settings["tag_validation"])
    CK.validate_tag(tag)  # the same tag on every rank now, so the same verdict
    save_dir = os.fspath(save_dir)
    t0 = time.perf_counter()

    # Phase 1: rank 0 makes the temporary directory; everyone checks client_state first.
    staged, error = None, None
    try:
        client_json, client_tensors = encode_client_state({} if client_state is None else client_state)
        sections = _sections(engine, run, client_json, exclude_frozen_parameters) if run.rank == 0 else None
        if run.rank == 0:
            staged = CK.StagedCheckpoint.create(save_dir, tag)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    raise_if_failed(run, error, "save_checkpoint: preparing " + os.path.join(save_dir, tag), staged, _UNCHANGED)
    temp_name = broadcast_text(run, staged.temp_name if staged else "", "save_checkpoint: temporary directory")

    # Phase 2: every rank writes its shard file and its part of the manifest.
    try:
        if staged is None:
            staged = CK.StagedCheckpoint.attach(save_dir, tag, temp_name)
        try:
            items = rank_items(run, exclude_frozen_parameters)
            if run.rank == 0:
                items += [(key, list(t.shape), 0, t.reshape(-1)) for key, t in client_tensors]
            manifest = CK.write_shard_file(staged.file(_rank_file(run.rank)), items)
        finally:
            run.core.end_entries(False)  # NVMe state and chunks leave host memory: written now
        if run.rank != 0:
            if run.placement.names_split and run.placement.describes:
                manifest.set_section(STAGE_LAYOUT, layout_entries(run))
            CK.write_file_durably(staged.file(_partial_manifest(run.rank)), manifest.to_json())
            staged.release()
    except Exception as e:  # noqa: BLE001
        error = e
    raise_if_failed(run, error, "save_checkpoint: writing the shard files of " + os.path.join(save_dir, tag),
                    staged, _UNCHANGED)

    # Phase 3: rank 0 merges, validates, writes manifest.json and renames the directory into place.
    if run.rank == 0:
        try:
            _merge_partials(run, staged, manifest, sections)
            for name, value in sections.items():
                manifest.set_section(name, value)
            manifest.validate_complete(os.path.join(save_dir, tag))
            manifest.save(staged.file(CK.MANIFEST))
            staged.commit(save_latest)
        except Exception as e:  # noqa: BLE001
            staged.abort()
            error = e
    # The message says what is in place: before the rename nothing moved; after it, only `latest`
    # may lag (runtime/checkpoint/atomic_dir.h).
    raise_if_failed(run, error, "save_checkpoint: committing " + os.path.join(save_dir, tag))
    seconds = time.perf_counter() - t0
    log_rank0(f"save_checkpoint: {os.path.join(save_dir, tag)} written by {run.world} rank(s) in "
              f"{seconds:.2f} s", run.rank)
    return True
