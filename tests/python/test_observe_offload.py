"""What a run with its state on NVMe reports about itself (issue 22): wall_clock_breakdown's offload
phases (transfer, host_step, nvme_wait) on the progress line and in the CSV monitor, each inside
the step it belongs to, and the trace's copies, parameter and optimizer swaps and disk requests.
One ZeRO-3 run with offload_optimizer and offload_param on NVMe, world 2 (the swaps and the disk
requests are per rank)."""
import json
import os

import pytest

from harness import run_distributed

STEPS, MICRO = 3, 2
OFFLOAD_PHASES = ("transfer", "host_step", "nvme_wait")


def _config(root):
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme, exist_ok=True)
    return {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {
                # Sub-groups beyond the staging buffers: some are read back from disk every step.
                "stage": 3, "sub_group_size": 8000, "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 20000,
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2,
                                      "pipeline_read": True, "pipeline_write": True},
                "offload_param": {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}},
            "wall_clock_breakdown": True,
            "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "job"},
            "trace": {"enabled": True, "output_path": os.path.join(root, "trace"), "steps": [2]}}


def _offload_worker(root):
    import zeroshard
    from models import global_batch, wide_gpt
    model = wide_gpt()
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=_config(root))
    rank, world = engine.global_rank, engine.world_size
    phases = []
    for step in range(STEPS):
        batch = global_batch("gpt-wide", step, MICRO * world)
        loss = engine(batch[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        phases.append(engine._observer.timers.last)
    return phases


def test_an_nvme_run_times_its_offload_phases_and_traces_its_copies_swaps_and_disk_requests(tmp_path, capfd):
    root = str(tmp_path)
    results = run_distributed(_offload_worker, 2, root, timeout=300)
    out = capfd.readouterr().out
    # ----- wall_clock_breakdown: the offload phases, each inside the optimizer step -----
    for rank, phases in enumerate(results):
        for step, times in enumerate(phases, start=1):
            assert set(OFFLOAD_PHASES) <= set(times), f"rank {rank} step {step}: {times}"
            assert times["host_step"] > 0 and times["transfer"] > 0, f"rank {rank} step {step}: {times}"
            # The swaps' waits are part of the transfer time; both it and the host update run
            # inside the step's optimizer phase.
            assert times["nvme_wait"] <= times["transfer"], f"rank {rank} step {step}: {times}"
            assert times["transfer"] + times["host_step"] <= times["step"], f"rank {rank} step {step}: {times}"
    lines = [line for line in out.splitlines() if line.startswith("[zeroshard] step ")]
    assert len(lines) == STEPS, out[-3000:]
    for line, times in zip(lines, results[0]):
        for name in OFFLOAD_PHASES:
            assert f"{name} {times[name]:.1f}" in line, (name, line)
    for name in OFFLOAD_PHASES:
        with open(os.path.join(root, "csv", "job", f"Train_Samples_elapsed_time_ms_{name}.csv")) as f:
            rows = [line.strip().split(",") for line in f]
        assert rows[0] == ["step", f"elapsed_time_ms_{name}"] and len(rows) == STEPS + 1, rows
        assert [float(v) for _, v in rows[1:]] == pytest.approx([t[name] for t in results[0]], rel=1e-6), rows
    # ----- the trace of step 2: copies, swaps (parameter chunks and optimizer sub-groups), disk I/O -----
    for rank in range(2):
        with open(os.path.join(root, "trace", f"trace_rank{rank}.json")) as f:
            events = json.load(f)["traceEvents"]
        names = {}
        for e in events:
            names.setdefault(e.get("cat"), set()).add(e["name"])
        assert {"copy", "swap", "io", "optimizer", "gather"} <= set(names), f"rank {rank}: {sorted(map(str, names))}"
        kinds = {" ".join(n.split(" ")[1:3]) for n in names["swap"]}
        assert kinds == {"in optimizer", "out optimizer", "in parameter", "out parameter"}, \
            f"rank {rank}: {sorted(names['swap'])}"
        disk = [e for e in events if e.get("cat") == "io" and e["ph"] == "b"]
        # Reads and writes of both files: the parameter chunks and the optimizer's sub-groups.
        requests = {(e["name"].split(" ")[0], os.path.basename(e["name"]).split("_")[0]) for e in disk}
        assert requests == {("read", "param"), ("write", "param"), ("read", "optimizer"), ("write", "optimizer")}, \
            f"rank {rank}: {sorted(requests)}"
        assert all(e["args"]["bytes"] > 0 for e in disk), f"rank {rank}: {disk[:4]}"
        # A disk request's end pairs with its start (async slices keyed by id), after it.
        ends = {e["id"]: e["ts"] for e in events if e.get("cat") == "io" and e["ph"] == "e"}
        assert all(e["id"] in ends and ends[e["id"]] >= e["ts"] for e in disk), f"rank {rank}"
        host_updates = sum(e["dur"] for e in events if e.get("cat") == "optimizer" and e["name"].endswith("on the host"))
        # The host kernel's time (host_step) is measured inside the traced host updates.
        assert results[rank][1]["host_step"] <= host_updates / 1e3 + 1e-3, (results[rank][1], host_updates)
