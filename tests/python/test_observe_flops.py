"""DeepSpeed's flops_profiler block and the progress line's TFLOPS (issue 22), from a script's side:
the FLOPs of a known GPT against the analytic 6 x params x tokens plus attention; the printed
profile's summary, aggregated (module_depth, top_modules) and detailed (on or off) parts against
the model; and the TFLOPS every progress line prints against the counted FLOPs and the samples/s
beside it."""
import ast
import os
import re
import sys

import pytest

from harness import run_distributed

VOCAB, SEQ, D, LAYERS, MICRO = 256, 32, 64, 2, 4


def _gpt():
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from gpt import GPT
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=D, n_layers=LAYERS, n_heads=4)


def _analytic_flops_per_micro_step():
    matmul_params = LAYERS * 12 * D * D + D * VOCAB  # qkv, proj, fc, out per block; the tied head
    tokens = MICRO * SEQ
    # Attention per layer and sequence: q @ k^T and probabilities @ v forward (4 s^2 d), and
    # backward the scores recomputed and four products (10 s^2 d), torch's flash-attention count.
    attention = LAYERS * MICRO * (4 + 10) * SEQ * SEQ * D
    return 6 * matmul_params * tokens + attention


def _flops_worker(block, gas=1, steps=3):
    import torch
    import zeroshard
    model = _gpt()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "steps_per_print": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "flops_profiler": block}
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps * gas):
        loss = engine(torch.randint(0, VOCAB, (MICRO, SEQ + 1)))
        engine.backward(loss)
        engine.step()
    flops = engine._observer.flops
    counted = flops._counted
    # What the aggregated profile should rank at depth 1: the root's children summed by class.
    params_by_class = {}
    for child in model.children():
        name = type(child).__name__
        params_by_class[name] = params_by_class.get(name, 0) + sum(p.numel() for p in child.parameters())
    return {"forward": counted.forward["Global"], "backward": counted.backward["Global"],
            "per_step": flops.flops_per_step, "batch": engine.train_batch_size(),
            "modules": [name for name, _ in model.named_modules()], "depth1_params": params_by_class}


def test_the_flops_profile_of_a_gpt_is_6_x_params_x_tokens_plus_attention(tmp_path):
    path = str(tmp_path / "profile.txt")
    r = run_distributed(_flops_worker, 1, {"enabled": True, "profile_step": 1, "output_file": path}, timeout=180)[0]
    analytic = _analytic_flops_per_micro_step()
    counted = r["forward"] + r["backward"]
    assert abs(counted - analytic) <= 0.05 * analytic, f"{counted} FLOPs against {analytic}"

    with open(path) as f:
        text = f.read()
    # profile_step 1: the step after one step (DeepSpeed's count), the progress lines' step 2.
    for part in ("Flops Profiler", "Profile Summary at step 2", "Aggregated Profile per GPU", "Detailed Profile per GPU",
                 "blocks (ModuleList)"):
        assert part in text, part
    macs = re.search(r"fwd MACs per GPU:\s+(\S+) (\S?)MACs", text)
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}[macs.group(2)]
    assert float(macs.group(1)) * scale == pytest.approx(r["forward"] / 2, rel=5e-3), macs.group(0)
    # The detailed tree (module_depth -1): every module, indented by its depth.
    detailed = text.split("Detailed Profile per GPU")[1]
    for name in r["modules"][1:]:
        depth = name.count(".") + 1
        assert re.search(rf"^{'  ' * depth}{re.escape(name.split('.')[-1])} \(", detailed, re.M), name
    # Latencies: the root's own time (beyond its children's) stays under 100 ms (torch's first
    # counting session's set-up once landed there), and the root within the engine's forward.
    latency = {m.group(1): float(m.group(2)) for m in
               re.finditer(r"^( *\w+) \(\w+\):.*?, ([\d.]+) ms, [\d.]+% latency", detailed, re.M)}
    root = latency["GPT"]
    children = sum(ms for name, ms in latency.items() if re.match(r"^  \w", name))
    assert root - 100 <= children <= root + 0.05, latency  # ms; the children run inside the root
    engine_forward = float(re.search(r"fwd latency:\s+([\d.]+) ms", text).group(1))
    assert root <= engine_forward * 1.01, (root, engine_forward)


def _aggregated(text):
    """{depth: {row: {class: value}}} of the printed aggregated profile."""
    part = text.split("Aggregated Profile per GPU")[1].split("Detailed Profile per GPU")[0]
    depths, current = {}, None
    for line in part.splitlines():
        if re.match(r"depth \d+:", line):
            current = depths.setdefault(int(line.split()[1].rstrip(":")), {})
        elif current is not None and " - " in line:
            row, value = line.split(" - ", 1)
            current[row.strip()] = ast.literal_eval(value)
    return depths


def test_module_depth_top_modules_and_detailed_shape_the_printed_profile(tmp_path):
    path = str(tmp_path / "profile.txt")
    block = {"enabled": True, "profile_step": 1, "output_file": path, "module_depth": 2, "top_modules": 2}
    r = run_distributed(_flops_worker, 1, block, timeout=180)[0]
    with open(path) as f:
        text = f.read()
    # module_depth shapes the aggregated part only: the detailed tree is whole (DeepSpeed's).
    assert re.search(r"^      qkv \(Linear\):", text.split("Detailed Profile per GPU")[1], re.M), text
    depths = _aggregated(text)
    # module_depth 2: depths 0 and 1 (DeepSpeed's range(module_depth)), at most 2 classes a row.
    assert sorted(depths) == [0, 1], text
    assert all(len(classes) <= 2 for rows in depths.values() for classes in rows.values()), text
    assert set(depths[0]["params"]) == {"GPT"}
    want = sorted(r["depth1_params"], key=r["depth1_params"].get, reverse=True)[:2]
    assert list(depths[1]["params"]) == want, (depths[1]["params"], r["depth1_params"])
    # The blocks (ModuleList) hold every matmul but the head's: the most forward MACs at depth 1.
    assert next(iter(depths[1]["MACs"])) == "ModuleList", depths[1]["MACs"]

    # The default module_depth (-1): every depth, down to the blocks' Linear layers (depth 3);
    # detailed false: no tree.
    path_all = str(tmp_path / "all.txt")
    run_distributed(_flops_worker, 1, {"enabled": True, "output_file": path_all, "detailed": False}, timeout=180)
    with open(path_all) as f:
        everything = f.read()
    depths = _aggregated(everything)
    assert sorted(depths) == [0, 1, 2, 3] and "Detailed Profile per GPU" not in everything, sorted(depths)
    assert all(len(classes) == 1 for rows in depths.values() for classes in rows.values())  # top_modules 1


def test_every_progress_line_prints_the_tflops_of_the_counted_flops(capfd):
    # No profile: the run's first micro-step is counted once (as every run does unless
    # ZEROSHARD_COUNT_FLOPS=0); a step is gas micro-steps.
    r = run_distributed(_flops_worker, 1, {}, 2, 4, timeout=180, env={"ZEROSHARD_COUNT_FLOPS": "1"})[0]
    assert r["per_step"] == 2 * (r["forward"] + r["backward"])
    analytic = _analytic_flops_per_micro_step()
    assert abs(r["per_step"] - 2 * analytic) <= 0.05 * 2 * analytic
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[zeroshard] step ")]
    assert len(lines) == 4, lines
    for line in lines[1:]:  # the first line's interval includes the count itself
        rate = float(re.search(r"samples/s (\S+)", line).group(1))
        tflops = float(re.search(r"TFLOPS (\S+)", line).group(1))
        # Both over the same interval: TFLOPS = FLOPs per step x steps per second.
        expected = r["per_step"] * rate / r["batch"] / 1e12
        assert tflops == pytest.approx(expected, rel=0.02), (line, expected)
