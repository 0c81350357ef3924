"""DeepSpeed's comms_logger: the C++ communicator counts every collective (runtime/comm_stats.h);
this prints the table, as deepspeed.comm.log_summary() does, on demand (engine.comms_summary())
and once at the end of the run on rank 0."""
import atexit

from zeroshard import _C
from zeroshard.log import log_rank0

_printed_at_exit = []


def configure(block, rank):
    block = block or {}
    _C.comms.configure(bool(block.get("enabled")), bool(block.get("verbose")),
                       bool(block.get("prof_all", True)), bool(block.get("debug")),
                       list(block.get("prof_ops") or []), rank)
    if block.get("enabled") and not _printed_at_exit:
        _printed_at_exit.append(atexit.register(_print_at_exit, rank))


def _print_at_exit(rank):
    if _C.comms.enabled() and _C.comms.rows():
        log_rank0(summary(), rank)


def summary():
    """The table: per collective kind and message size, count, total and average latency (issue
    to completion), and algorithm / bus bandwidth (nccl-tests' definitions, Gbit/s)."""
    rows = _C.comms.rows()
    if not _C.comms.enabled():
        return "comms_logger is not enabled (config: \"comms_logger\": {\"enabled\": true})"
    width = max([28] + [len(r["op"]) + 2 for r in rows])  # debug's rows name what moved
    header = (f"{'Comm. Op':<{width}}{'Message Size':>14}{'Count':>9}{'Total Latency(ms)':>19}"
              f"{'Avg Latency(ms)':>17}{'algbw_avg (Gbps)':>17}{'busbw_avg (Gbps)':>18}")
    lines = ["comms_logger summary (this rank)", header]
    last_op = None
    for r in rows:
        op = r["op"] if r["op"] != last_op else ""
        last_op = r["op"]
        lines.append(f"{op:<{width}}{r['message_size']:>14}{r['count']:>9}{r['total_ms']:>19.2f}"
                     f"{r['total_ms'] / r['count']:>17.3f}{r['algbw_gbps']:>17.2f}{r['busbw_gbps']:>18.2f}")
    if not rows:
        lines.append("(no collectives yet)")
    return "\n".join(lines)
