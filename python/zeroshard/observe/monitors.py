"""DeepSpeed's monitors: the tensorboard, csv_monitor, wandb and comet blocks, written by rank 0
with DeepSpeed's event names (Train/Samples/train_loss, Train/Samples/lr, ...) against the
samples seen so far. TensorBoard goes through torch's SummaryWriter (the tensorboard package),
CSV is written here (one file per event, DeepSpeed's layout), W&B and Comet through their own
packages. A block that is enabled but whose package is missing is an error at start that names
the package, not a run that trains without its logs."""
import csv
import os


def _require(package, block):
    try:
        return __import__(package)
    except ImportError as error:
        raise ImportError(f"{block}.enabled is true but the {package!r} package is not installed "
                          f"(pip install {package.replace('_', '-')}), or set {block}.enabled "
                          "to false") from error


class _TensorBoard:
    def __init__(self, block):
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter
        # DeepSpeed's path: output_path/job_name ("" is the working directory).
        self._writer = SummaryWriter(log_dir=os.path.join(block["output_path"], block["job_name"]))

    def write(self, events):
        for name, value, step in events:
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self):
        self._writer.close()


class _Csv:
    """One file per event, DeepSpeed's layout: output_path/job_name/Train_Samples_train_loss.csv
    with a "step,<last part of the name>" header."""

    def __init__(self, block):
        self._dir = os.path.join(block["output_path"], block["job_name"])
        os.makedirs(self._dir, exist_ok=True)
        self._started = set()

    def write(self, events):
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self._dir, filename + ".csv"), "a", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self):
        pass


class _Wandb:
    def __init__(self, block):
        self._wandb = _require("wandb", "wandb")
        self._wandb.init(project=block.get("project") or "deepspeed", group=block.get("group"),
                         entity=block.get("team"))

    def write(self, events):
        for name, value, step in events:
            self._wandb.log({name: value}, step=step)

    def close(self):
        self._wandb.finish()


class _Comet:
    def __init__(self, block):
        comet_ml = _require("comet_ml", "comet")
        options = {k: block[k] for k in ("api_key", "project", "workspace", "experiment_key", "mode", "online")
                   if block.get(k) is not None}
        self._experiment = comet_ml.start(**options)
        if block.get("experiment_name"):
            self._experiment.set_name(block["experiment_name"])
        self._every = int(block.get("samples_log_interval") or 100)
        self._last = {}

    def write(self, events):
        for name, value, step in events:
            # DeepSpeed's comet monitor logs an event at most once per samples_log_interval samples.
            if name in self._last and step - self._last[name] < self._every:
                continue
            self._last[name] = step
            self._experiment.log_metric(name, value, step=step)

    def close(self):
        self._experiment.end()


_KINDS = {"tensorboard": _TensorBoard, "csv_monitor": _Csv, "wandb": _Wandb, "comet": _Comet}


class Monitors:
    """The enabled monitors (rank 0 only: other ranks get none); write((name, value, step) ...)."""

    def __init__(self, config, rank):
        self._monitors = []
        if rank != 0:
            return
        for key, kind in _KINDS.items():
            block = config.get(key) or {}
            if block.get("enabled"):
                self._monitors.append(kind(block))

    @property
    def enabled(self):
        return bool(self._monitors)

    def write(self, events):
        for monitor in self._monitors:
            monitor.write(events)

    def close(self):
        for monitor in self._monitors:
            monitor.close()
        self._monitors = []
