# A rank for launcher tests, no torch: records what it was given (argv, env, cwd) in OUT_DIR/rank<R>.json,
# then exits, fails or hangs as told by ZS_TEST_* variables (set through the launcher's env file).
import json
import os
import sys
import time

rank = int(os.environ["RANK"])
out_dir = os.environ["ZS_TEST_OUT"]
record = {
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "pid": os.getpid(),
    "env": {k: os.environ.get(k) for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
        "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "ZS_FROM_ENV_FILE", "GLOO_TEST_VAR",
        "OMP_NUM_THREADS")},
    "affinity": sorted(os.sched_getaffinity(0)),
}
with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
    json.dump(record, f)
os.rename(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
print(f"hello from rank {rank}", flush=True)
if rank == int(os.environ.get("ZS_TEST_FAIL_RANK", "-1")):
    time.sleep(float(os.environ.get("ZS_TEST_FAIL_AFTER", "0.5")))
    sys.exit(int(os.environ.get("ZS_TEST_EXIT_CODE", "3")))
if os.environ.get("ZS_TEST_HANG"):
    if os.environ.get("ZS_TEST_CHILD"):  # a grandchild in its own session: the subreaper must end it
        import subprocess
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    time.sleep(600)
