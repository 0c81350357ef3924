"""What a run reports about itself (zeroshard/observe/, zeroshard/report.py), from the script's side.
One ZeRO-3 fp16 run at world 2 with every reporting key on checks: TensorBoard events (read back
with the tensorboard package's reader) and CSV files with DeepSpeed's tags, steps and values; the
per-rank and merged Chrome traces (valid JSON, every collective of the flight recorder on both ranks
with the same sequence number, spans nested, the memory counters' peaks equal to the runtime's own
peaks); zeroshard-report's PNGs and a summary whose phases add up to the step time; the comms table;
the progress line's TFLOPS, peak memory and phase times. Then missing monitor packages named, and a
pipeline's instructions traced (the flops profiler: test_observe_flops.py; offload's phases and the
trace of an NVMe run: test_observe_offload.py)."""
import json
import os
import re
import sys

import pytest

from harness import run_distributed

STEPS, MICRO, GAS = 4, 4, 2
TAGS = ["Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/loss_scale"] + [
    f"Train/Samples/elapsed_time_ms_{p}" for p in ("forward", "backward", "backward_inner", "backward_allreduce", "step")]


def _config(root):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3},
            "fp16": {"enabled": True, "initial_scale_power": 8},
            "wall_clock_breakdown": True, "memory_breakdown": True,
            "tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "job"},
            "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "job"},
            "comms_logger": {"enabled": True},
            "trace": {"enabled": True, "output_path": os.path.join(root, "trace"), "steps": [2, 3]}}


def _reporting_worker(root):
    import torch
    import zeroshard
    from models import global_batch, wide_gpt
    model = wide_gpt()  # compute large enough for the summary's phases to outweigh the glue between them
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(root))
    rank, world = engine.global_rank, engine.world_size
    window_losses, recent, peaks = [], None, None
    for step in range(STEPS):
        if step == 1:
            engine._core.memory.reset_peaks()  # the trace (steps 2-3) starts from here
        batch = global_batch("gpt-wide", step, MICRO * GAS * world)
        losses = []
        for micro in range(GAS):
            lo = (rank * GAS + micro) * MICRO
            loss = engine(batch[lo:lo + MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        window_losses.append(sum(losses) / GAS)
        if step == 2:  # the last traced step: what the flight recorder holds now is in the trace
            recent = engine._comm.recent_collectives()
            peaks = dict(engine._core.memory.peak_bytes())
    summary = engine.comms_summary()
    return {"window_losses": window_losses, "recent": recent, "peaks": peaks, "summary": summary,
            "batch": engine.train_batch_size()}


def _scalars(path, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(path)
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _nested(events):
    """Whether the complete spans of each (process, thread) nest: each one inside or apart from
    every other."""
    by_track = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for spans in by_track.values():
        stack = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + 1e-3:
                stack.pop()
            if stack and end > stack[-1][1] + 1e-3:
                return f"{name} [{start}, {end}] crosses {stack[-1][2]} [{stack[-1][0]}, {stack[-1][1]}]"
            stack.append((start, end, name))
    return None


def test_a_stage3_run_reports_everything(tmp_path, capfd):
    root = str(tmp_path)
    results = run_distributed(_reporting_worker, 2, root, timeout=300, env={"ZEROSHARD_COUNT_FLOPS": "1"})
    out = capfd.readouterr().out
    batch = results[0]["batch"]
    # ----- monitors: rank 0 writes, DeepSpeed's tags; train_loss at the samples before its step
    # (rank 0's mean over the window), lr and the rest after it -----
    tb = os.path.join(root, "tb", "job")
    for tag in TAGS:
        points = _scalars(tb, tag)
        expected_steps = [s * batch for s in range(STEPS)] if tag.endswith("train_loss") else \
            [s * batch for s in range(1, STEPS + 1)]
        assert [p[0] for p in points] == expected_steps, f"{tag}: steps {[p[0] for p in points]}"
        if tag.endswith("train_loss"):
            for (_, value), want in zip(points, results[0]["window_losses"]):
                assert abs(value - want) <= 1e-5 * abs(want), f"{tag}: {value} against rank 0's {want}"
    with open(os.path.join(root, "csv", "job", "Train_Samples_train_loss.csv")) as f:
        rows = [line.strip().split(",") for line in f]
    assert rows[0] == ["step", "train_loss"] and len(rows) == STEPS + 1, rows
    assert [float(v) for _, v in rows[1:]] == pytest.approx([v for _, v in _scalars(tb, TAGS[0])], rel=1e-6)
    assert sorted(os.listdir(os.path.join(root, "csv", "job"))) == sorted(t.replace("/", "_") + ".csv" for t in TAGS)
    # ----- traces -----
    trace_dir = os.path.join(root, "trace")
    per_rank = []
    for rank in range(2):
        with open(os.path.join(trace_dir, f"trace_rank{rank}.json")) as f:
            per_rank.append(json.load(f)["traceEvents"])
    with open(os.path.join(trace_dir, "trace_merged.json")) as f:
        merged = json.load(f)["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    collectives = [{(e["args"]["seq"], e["args"]["op"]) for e in evs if e.get("cat") == "comm" and e["ph"] == "b"}
                   for evs in per_rank]
    assert collectives[0] and collectives[0] == collectives[1], "the ranks' traces hold different collectives"
    for rank, r in enumerate(results):
        traced = sorted(s for s, _ in collectives[rank])
        # Every collective from the trace's start on is in it (the trace-start barrier, which moves
        # no tensor, is the only number it may skip), the flight recorder's among them.
        assert traced[-1] - traced[0] + 1 - len(traced) <= 1, f"rank {rank}: traced {traced}"
        recorded = [int(m) for m in re.findall(r"#(\d+) \w+\(", r["recent"])]
        compared = [seq for seq in recorded if seq >= traced[0]]
        assert compared, f"rank {rank}: no flight-recorder collective inside the trace: {r['recent']}"
        for seq in compared:
            assert seq in traced, f"rank {rank}: flight recorder's #{seq} not traced ({traced})"
    for rank, evs in enumerate(per_rank):
        crossing = _nested(evs)
        assert crossing is None, f"rank {rank}: spans do not nest: {crossing}"
        names = {e["name"] for e in evs if e.get("cat") == "module"}
        assert any(n.startswith("forward ") for n in names) and any(n.startswith("backward ") for n in names)
        # The runtime's own spans: stage 3's gathers and releases, the waits, the optimizer step.
        categories = {e.get("cat") for e in evs}
        assert {"gather", "wait", "optimizer"} <= categories, f"rank {rank}: categories {categories}"
        gathers = {e["name"].split(" ")[0] for e in evs if e.get("cat") == "gather"}
        assert gathers == {"fetch", "release"}, f"rank {rank}: gather spans {gathers}"
        counters = [e["args"] for e in evs if e["ph"] == "C" and e["name"] == "model state bytes"]
        for category, peak in results[rank]["peaks"].items():
            assert max(c[category] for c in counters) == peak, f"rank {rank}: {category} peak"
    # ----- zeroshard-report -----
    from zeroshard import report
    pictures = str(tmp_path / "pictures")
    assert report.main([trace_dir, "--out", pictures, "--timeline"]) == 0
    for name in ("memory_rank0.png", "memory_rank1.png", "timeline.png"):
        with open(os.path.join(pictures, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    for rank, evs in report._by_rank(report.load(trace_dir)).items():
        steps = report.step_summaries(evs)
        assert [s["name"] for s in steps] == ["step 2", "step 3"], steps
        for s in steps:
            phases = sum(s["phases_ms"].values())
            assert abs(phases - s["step_ms"]) <= 0.05 * s["step_ms"], f"rank {rank} {s}"
    # The process's own peaks (CPU: resident memory only), split into accounted state and the rest.
    text = report.summarize(report.load(trace_dir))
    for rank, evs in report._by_rank(report.load(trace_dir)).items():
        peaks = report.process_peaks(evs)
        resident = max(e["args"]["resident"] for e in evs if e["ph"] == "C" and e["name"] == "process bytes")
        assert set(peaks) == {"resident"} and peaks["resident"]["bytes"] == resident, peaks
        assert 0 < peaks["resident"]["accounted"] < resident, peaks
        assert f"peak resident memory {report._mb(resident)}" in text, text
    # ----- comms table, progress line -----
    for r in results:
        assert "all_gather" in r["summary"] and "Avg Latency(ms)" in r["summary"], r["summary"]
    lines = [line for line in out.splitlines() if line.startswith("[zeroshard] step ")]
    assert len(lines) == STEPS, out[-3000:]
    for field in ("TFLOPS", "peak model state", "peak host", "ms: forward", "backward_allreduce"):
        assert field in lines[-1], lines[-1]
    assert "memory after step 4" in out
    assert "trace written to" in out


def _missing_package_worker(block):
    import torch
    import zeroshard
    sys.modules[{"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}[block]] = None  # as if absent
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              block: {"enabled": True}}
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ImportError as error:
        return str(error)
    return None


@pytest.mark.parametrize("block,package", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet-ml")])
def test_a_monitor_whose_package_is_missing_is_named_at_start(block, package):
    message = run_distributed(_missing_package_worker, 1, block, timeout=120)[0]
    assert message is not None and f"{block}.enabled is true" in message and f"pip install {package}" in message, message


def _pipeline_trace_worker(root):
    import zeroshard
    from zeroshard.pipe import PipelineModule
    from pipe_models import batches, layer_specs, loss_fn, rank_micro_batches
    net = PipelineModule(layers=layer_specs(2, tied=False), num_stages=2, loss_fn=loss_fn)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "wall_clock_breakdown": True,
              "pipeline": {"schedule": "zero_bubble"}, "trace": {"enabled": True, "output_path": root, "steps": [3]},
              "csv_monitor": {"enabled": True, "output_path": root, "job_name": "csv"}}
    engine, _, _, _ = zeroshard.initialize(model=net, config=config, model_parameters=list(net.parameters()))
    for step in range(3):
        engine.train_batch(rank_micro_batches(batches(1, 2, 4, 1, seed=step), 2, 4, 0))
    return engine.global_rank


def test_a_pipelines_instructions_are_traced(tmp_path, capfd):
    run_distributed(_pipeline_trace_worker, 2, str(tmp_path), timeout=180)
    out = capfd.readouterr().out
    with open(tmp_path / "trace_merged.json") as f:
        events = json.load(f)["traceEvents"]
    for rank in range(2):
        ops = {e["name"].split(" mb ")[0] for e in events if e.get("cat") == "pipeline" and e["pid"] == rank}
        assert {"forward", "backward_input", "backward_weight"} <= ops, (rank, ops)
        assert ("send_activation" if rank == 0 else "receive_activation") in ops
        assert ("wait_gradient" if rank == 0 else "wait_activation") in ops, (rank, ops)
    assert "ms: forward" in [line for line in out.splitlines() if line.startswith("[zeroshard] step 3")][0]
    # The window was the last step: the merged file is written at its end. train_loss goes out
    # after each step, at the samples seen then (DeepSpeed's pipeline engine).
    with open(tmp_path / "csv" / "Train_Samples_train_loss.csv") as f:
        rows = [line.strip().split(",") for line in f][1:]
    assert [int(step) for step, _ in rows] == [8, 16, 24], rows


def _nesting_worker(root, max_events=None):
    import torch
    import zeroshard
    # Containers whose output is their last child's: their backward spans begin at the same node.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 8)))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}, "trace": {"enabled": True, "output_path": root, "steps": [2]}}
    if max_events is not None:
        config["trace"].update(max_events=max_events, steps=list(range(2, 41)))
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2 if max_events is None else 40):  # capped: a window past max_events
        loss = engine(torch.randn(2, 8)).sum()
        engine.backward(loss)
        engine.step()


def test_the_backward_spans_of_nested_containers_nest(tmp_path):
    run_distributed(_nesting_worker, 1, str(tmp_path), timeout=120)
    with open(tmp_path / "trace_rank0.json") as f:
        events = json.load(f)["traceEvents"]
    backward = {e["name"] for e in events if e.get("cat") == "module" and e["name"].startswith("backward ")}
    assert {"backward Sequential", "backward 1", "backward 1.1"} <= backward, backward
    assert _nested(events) is None, _nested(events)


def test_max_events_bounds_the_module_spans_and_the_runtimes_events_together(tmp_path):
    run_distributed(_nesting_worker, 1, str(tmp_path), 1000, timeout=120)
    with open(tmp_path / "trace_rank0.json") as f:
        trace = json.load(f)
    kept = [e for e in trace["traceEvents"] if e["ph"] not in ("M", "e")]  # a collective: b and e
    assert len(kept) == 1000 and trace["otherData"]["dropped_events"] > 0, (len(kept), trace["otherData"])


def _freeze_worker(root, script_froze):
    import gc
    import torch
    import zeroshard
    if script_froze:
        gc.freeze()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}, "trace": {"enabled": True, "output_path": root, "steps": [2]}}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    counts = [gc.get_freeze_count()]
    for _ in range(3):
        loss = engine(torch.randn(2, 8)).sum()
        counts.append(gc.get_freeze_count())  # inside step 1, 2 (traced), 3
        engine.backward(loss)
        engine.step()
    return counts + [gc.get_freeze_count()]


@pytest.mark.parametrize("script_froze", [False, True], ids=["plain", "script-froze"])
def test_the_trace_freezes_the_heap_only_for_its_window_and_keeps_a_scripts_freeze(tmp_path, script_froze):
    before, step1, traced, step3, after = run_distributed(_freeze_worker, 1, str(tmp_path), script_froze, timeout=120)[0]
    if script_froze:  # frozen objects that die leave the count; only gc.freeze adds to it
        assert before > 0 and after > 0 and max(step1, traced, step3, after) <= before, (before, traced, after)
    else:
        assert before == step1 == step3 == after == 0 and traced > 0


def _old_garbage_worker(root, steps):
    import gc
    import weakref
    import torch
    import zeroshard

    class Cycle:
        pass
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "trace": {"enabled": True, "output_path": root, "steps": steps}}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    garbage = Cycle()
    garbage.me = garbage
    alive = weakref.ref(garbage)
    gc.collect(1)  # it survives into the oldest generation, then becomes garbage there
    del garbage
    kept = []
    for _ in range(2):
        loss = engine(torch.randn(2, 4)).sum()  # step 1's forward starts the window
        kept.append(alive() is not None)
        engine.backward(loss)
        engine.step()
    gc.collect()
    return kept + [alive() is not None]


@pytest.mark.parametrize("steps", [[1], []], ids=["listed-steps", "open"])
def test_a_windows_freeze_keeps_old_garbage_only_for_a_window_of_listed_steps(tmp_path, steps):
    in_step1, in_step2, at_end = run_distributed(_old_garbage_worker, 1, str(tmp_path), steps, timeout=120)[0]
    if steps:  # young generations collected: the old cycle waits, frozen, until the window ends
        assert in_step1 and not at_end, (in_step1, in_step2, at_end)
    else:  # an open window may last the run: its start collects the whole heap first
        assert not in_step1 and not in_step2 and not at_end, (in_step1, in_step2, at_end)


def test_the_report_names_matplotlib_when_it_is_missing(monkeypatch, tmp_path, capsys):
    from zeroshard import report
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(ImportError, match=r"needs the matplotlib package.*pip install matplotlib"):
        report.plot_memory([], str(tmp_path))
    (tmp_path / "trace_rank0.json").write_text(json.dumps({"traceEvents": []}))
    assert report.main([str(tmp_path)]) == 2  # the summary printed, then the package named
    assert "pip install matplotlib" in capsys.readouterr().err


def test_the_reports_process_peaks_split_torchs_bytes_into_model_state_and_the_rest():
    from zeroshard import report

    def state(ts, **bytes_):
        return {"ph": "C", "name": "model state bytes", "pid": 0, "ts": ts, "args": bytes_}

    def process(ts, resident, allocated):
        return {"ph": "C", "name": "process bytes", "pid": 0, "ts": ts,
                "args": {"resident": resident, "torch_allocated": allocated}}
    # On CUDA: torch's allocated bytes hold the device categories, resident memory the host ones.
    mb = 10 ** 6
    events = [state(0, parameters=100 * mb, gathered_parameters=0, host_optimizer_state=40 * mb),
              process(1000, 1000 * mb, 150 * mb),
              state(2000, parameters=100 * mb, gathered_parameters=300 * mb, host_optimizer_state=40 * mb),
              process(3000, 900 * mb, 700 * mb),  # torch's peak: 400 MB accounted, 300 MB activations
              state(4000, parameters=100 * mb, gathered_parameters=0, host_optimizer_state=40 * mb)]
    peaks = report.process_peaks(events)
    assert peaks["torch_allocated"] == {"bytes": 700 * mb, "ts": 3000, "accounted": 400 * mb, "rest": 300 * mb}
    assert peaks["resident"] == {"bytes": 1000 * mb, "ts": 1000, "accounted": 40 * mb, "rest": 960 * mb}, peaks
    text = report.summarize(events)
    assert ("peak torch allocated 700.00 MB at 3.0 ms: accounted model state 400.00 MB, the rest "
            "(activations and temporaries) 300.00 MB") in text, text
    assert "peak resident memory 1000.00 MB at 1.0 ms: accounted model state 40.00 MB" in text, text


def test_trace_steps_from_the_environment_are_checked(monkeypatch):
    from zeroshard.observe.trace import settings
    monkeypatch.setenv("ZEROSHARD_TRACE", "/tmp/t")
    for bad in ("0", "3,5", "x"):
        monkeypatch.setenv("ZEROSHARD_TRACE_STEPS", bad)
        with pytest.raises(ValueError, match="ZEROSHARD_TRACE_STEPS"):
            settings({})
    monkeypatch.setenv("ZEROSHARD_TRACE_STEPS", "4,3")
    assert settings({})["steps"] == [4, 3]


def _progress_worker(nvme_path, save_dir):
    """Records every bar drawn: the runtime's NVMe writes at start (its progress channel), the
    checkpoint load's pieces and the consolidation's bytes, each run to its end."""
    import io

    import torch
    import zeroshard
    from zeroshard.observe import bars
    from zeroshard.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict
    drawn = {}
    runtime_progress = bars.runtime_progress

    def record_runtime(what, done, total):
        drawn.setdefault(what, []).append((done, total))
        runtime_progress(what, done, total)

    class Recording(bars.tqdm):  # drawn into a string (the test has no terminal)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "disable": False, "file": io.StringIO()})

        def close(self):
            drawn.setdefault(self.desc, []).append((self.n, self.total))
            super().close()

    bars.runtime_progress, bars.tqdm = record_runtime, Recording
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])  # chunks of whole pages: they leave memory
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "sub_group_size": 300000, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path},
                                    "offload_param": {"device": "nvme", "nvme_path": nvme_path, "max_in_cpu": 0}}}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, 512)).square().mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(save_dir, tag="t")
    engine.load_checkpoint(save_dir, tag="t")
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, save_dir + "_fp32", tag="t")
    return drawn


def test_long_work_draws_progress_bars_on_rank_0(tmp_path):
    nvme, save = tmp_path / "nvme", tmp_path / "ck"
    nvme.mkdir()
    drawn = run_distributed(_progress_worker, 1, str(nvme), str(save), timeout=180)[0]
    for what in ("NVMe: writing the optimizer state", "NVMe: writing the parameter chunks"):
        steps = drawn.get(what)
        assert steps and steps[-1][0] == steps[-1][1] >= 1 and [d for d, _ in steps] == list(range(1, len(steps) + 1)), (what, drawn)
    loads = [v for k, v in drawn.items() if k.startswith("[zeroshard] loading ")]
    assert loads and loads[0][-1][0] == loads[0][-1][1] > 0, drawn
    merged = [v for k, v in drawn.items() if k.startswith("[zeroshard] consolidating ")]
    assert merged and merged[0][-1][0] == merged[0][-1][1] > 0, drawn


def _wandb_comet_worker():
    """W&B and Comet through stand-in packages that record every call the monitors make."""
    import types
    import torch
    import zeroshard
    calls = []

    class Experiment:
        def set_name(self, name):
            calls.append(("comet.set_name", name))

        def log_metric(self, name, value, step=None):
            calls.append(("comet.log_metric", name, step))

        def end(self):
            calls.append(("comet.end",))

    wandb, comet_ml = types.ModuleType("wandb"), types.ModuleType("comet_ml")
    wandb.init = lambda **kw: calls.append(("wandb.init", kw))
    wandb.log = lambda data, step=None: calls.append(("wandb.log", sorted(data), step))
    wandb.finish = lambda: calls.append(("wandb.finish",))
    comet_ml.start = lambda **kw: calls.append(("comet.start", kw)) or Experiment()
    sys.modules["wandb"], sys.modules["comet_ml"] = wandb, comet_ml
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "wandb": {"enabled": True, "group": "g", "team": "t", "project": "p"},
              "comet": {"enabled": True, "project": "cp", "workspace": "ws", "experiment_name": "run1",
                        "samples_log_interval": 4, "mode": "offline"}}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(4):
        loss = engine(torch.randn(2, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()
    return calls


def test_wandb_and_comet_get_deepspeeds_events_through_their_packages():
    calls = run_distributed(_wandb_comet_worker, 1, timeout=120)[0]
    assert calls[0] == ("wandb.init", {"project": "p", "group": "g", "entity": "t"}), calls[:2]
    assert calls[1] == ("comet.start", {"project": "cp", "workspace": "ws", "mode": "offline"}), calls[:2]
    assert ("comet.set_name", "run1") in calls
    logged = {}
    for call in calls:
        if call[0] == "wandb.log":
            for name in call[1]:
                logged.setdefault(name, []).append(call[2])
    # Every step's events, against the samples seen (2 per step).
    assert logged["Train/Samples/lr"] == [2, 4, 6, 8], logged
    assert len(logged["Train/Samples/train_loss"]) == 4, logged
    comet = {}
    for call in calls:
        if call[0] == "comet.log_metric":
            comet.setdefault(call[1], []).append(call[2])
    # Comet logs an event at most once per samples_log_interval (4) samples.
    assert comet["Train/Samples/lr"] == [2, 6], comet
    assert calls[-2:] in ([("wandb.finish",), ("comet.end",)], [("comet.end",), ("wandb.finish",)]), calls[-3:]


def _comms_worker(block, summarize=True):
    import torch
    import zeroshard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 3}, "gradient_clipping": 1.0, "comms_logger": block}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(2):
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return engine.comms_summary() if summarize else None


# A script of its own (no harness), so that the table it prints at exit is seen after its last line.
_COMMS_SCRIPT = """
import sys
sys.path.insert(0, %r)
from test_observe import _comms_worker
_comms_worker(%r, summarize=False)
print("TRAINED", flush=True)
"""


def _run_comms_script(block):
    import subprocess
    script = _COMMS_SCRIPT % (os.path.dirname(os.path.abspath(__file__)), block)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    return out


@pytest.mark.parametrize("prof_all", [True, False], ids=["all", "prof_ops"])
def test_comms_logger_prof_ops_by_deepspeeds_name_with_debug_rows(prof_all):
    # DeepSpeed's op name for the gathers: with prof_all false the gradient buckets' and the norm's
    # all-reduces are left out.
    block = {"enabled": True, "prof_all": prof_all, "prof_ops": ["all_gather_into_tensor"], "debug": True}
    summary = run_distributed(_comms_worker, 2, block, timeout=120)[0]
    lines = summary.splitlines()
    header, table = lines[1], lines[2:]
    ops = {line.split("(")[0] for line in table if line[:1].strip()}
    assert ops == ({"all_gather", "all_reduce"} if prof_all else {"all_gather"}), summary
    # debug's long names widen the first column: every figure stays under its heading.
    assert all(len(line) == len(header) for line in table), summary


def test_comms_logger_verbose_prints_each_collective_and_the_table_at_exit():
    out = _run_comms_script({"enabled": True, "verbose": True})
    # verbose: a line per collective as it completes, DeepSpeed's format.
    lines = re.findall(r"comm op: (\w+) \| time \(ms\): [\d.]+ \| msg size: \S+ \| algbw \(Gbps\): [\d.]+ \| "
                       r"busbw \(Gbps\): [\d.]+", out)
    assert "all_gather" in lines, out
    assert out.index("comm op:") < out.index("TRAINED")
    # the table, once, after the script's last line (at exit).
    assert out.count("comms_logger summary (this rank)") == 1, out
    assert out.index("TRAINED") < out.index("comms_logger summary (this rank)"), out
