# The remote half of `zeroshard check`: check.py sends this file's text to every host as
# `python -u -c <text>` (over ssh, with the exports ranks get) and talks to it in JSON lines.
# It must stand alone: no zeroshard imports (that is one of the things it checks); torch on demand.
import datetime
import json
import mmap
import os
import platform
import queue
import socket
import subprocess
import sys
import threading
import time

PROBE_BYTES = 4096   # one O_DIRECT block, as the runtime's own probe (offload/swap_dir.cpp)
GPU_DEVICE_NODE = "/dev/nvidia0"  # present on a host with an NVIDIA GPU and its driver loaded
IN_MEMORY_FS = ("tmpfs", "ramfs")


def send(reply):
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def versions():
    out = {"python": platform.python_version()}
    try:
        import zeroshard
        out["zeroshard"] = str(getattr(zeroshard, "__version__", "unknown"))
        out["zeroshard_path"] = os.path.dirname(os.path.abspath(zeroshard.__file__))
    except Exception as e:  # what the ranks would hit: reported, not raised
        out["zeroshard_error"] = f"{type(e).__name__}: {e}"
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda or "none"
        out["gpus"] = torch.cuda.device_count()
    except Exception as e:
        out["torch_error"] = f"{type(e).__name__}: {e}"
        return out
    if out["gpus"] == 0 and os.path.exists(GPU_DEVICE_NODE):  # a GPU host whose torch sees none: why
        out["gpu_device_node"] = GPU_DEVICE_NODE
        out["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            torch.cuda.init()
        except Exception as e:
            lines = [s for s in str(e).splitlines() if s.strip()] or [""]
            out["cuda_error"] = f"{type(e).__name__}: {lines[0][:300]}"
    return out


def memory():
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            info[key] = int(rest.split()[0]) * 1024
    return {"mem_available_bytes": info.get("MemAvailable", 0), "mem_total_bytes": info.get("MemTotal", 0)}


def fs_type(path):
    """The filesystem type of the mount holding `path` (the longest mount point that prefixes it)."""
    real, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mount_point = fields[4].replace("\\040", " ")
            dash = fields.index("-")
            if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) \
                    and len(mount_point) >= len(best):
                best, kind = mount_point, fields[dash + 1]
    return kind


def nvme_problem(path):
    """None when `path` can take swap files (the runtime's SwapDir conditions), else why not."""
    if not path:
        return "is not set"
    if not os.path.exists(path):
        return "does not exist"
    if not os.path.isdir(path):
        return "is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable by this user"
    kind = fs_type(path)
    if kind in IN_MEMORY_FS:
        return f"is on {kind}, which keeps files in host memory (no real O_DIRECT)"
    probe = os.path.join(path, f".zeroshard-check-{socket.gethostname()}-{os.getpid()}")
    call = "open"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            call = "write"
            block = mmap.mmap(-1, PROBE_BYTES)  # page-aligned, as O_DIRECT needs
            if os.pwrite(fd, block, 0) != PROBE_BYTES:
                return f"a {PROBE_BYTES}-byte O_DIRECT write was short"
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        if e.errno == 22:  # EINVAL: the filesystem refuses O_DIRECT
            return f"is on {kind}, which does not support O_DIRECT ({call}: {e.strerror})"
        return f"{call} of a {PROBE_BYTES}-byte O_DIRECT test file failed: {e.strerror}"
    return None


def addresses():
    """This host's addresses as the launcher finds the master's (`hostname -I`), or why there are none."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"addrs": [], "addrs_error": str(e)}
    if out.returncode != 0 or not out.stdout.split():
        return {"addrs": [], "addrs_error": f"exited {out.returncode} {out.stderr.strip()!r}"}
    return {"addrs": out.stdout.split()}


def probe(req):
    out = {"hostname": socket.gethostname(), **addresses()}
    out.update(versions())
    out.update(memory())
    out["nvme"] = {key: nvme_problem(path) for key, path in req.get("nvme", {}).items()}
    return out


class Listener:
    """Stands in for rank 0's store on the rendezvous port: answers each connection with a token,
    so a connecting host knows it reached this listener and not something else."""

    def __init__(self, port, token):
        try:  # both address families where the host has IPv6, as torch's store listens
            self.sock = socket.socket(socket.AF_INET6)
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        except OSError:
            self.sock = socket.socket(socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(("", port))
        except OSError:
            self.sock.close()
            raise
        self.sock.listen(128)
        self.token, self.accepted = token.encode(), 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        with conn:
            conn.settimeout(10)
            try:
                conn.sendall(self.token)
                conn.recv(1)  # the client closes first: TIME_WAIT stays on its side, the port stays free
            except OSError:
                pass

    def close(self):
        try:  # wakes the thread blocked in accept(); a bare close() would leave the port listening
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(req):
    start = time.monotonic()
    try:
        with socket.create_connection((req["addr"], req["port"]), timeout=req["timeout"]) as s:
            got = b""
            while len(got) < len(req["token"]):
                chunk = s.recv(64)
                if not chunk:
                    break
                got += chunk
    except socket.timeout:
        return {"error": f"timed out after {req['timeout']:g} s (a firewall dropping packets?)"}
    except OSError as e:
        return {"error": e.strerror or str(e)}
    if got.decode(errors="replace") != req["token"]:
        return {"error": "something else answered there (not the master host's listener)"}
    return {"ok": True, "seconds": round(time.monotonic() - start, 3)}


def all_reduce(req):
    """One rank per host, world = the hosts checked: the real backend through the real rendezvous."""
    import torch
    import torch.distributed as dist
    addr = f"[{req['addr']}]" if ":" in req["addr"] else req["addr"]
    start = time.monotonic()
    try:
        dist.init_process_group(req["backend"], init_method=f"tcp://{addr}:{req['port']}",
                                rank=req["rank"], world_size=req["world"],
                                timeout=datetime.timedelta(seconds=req["timeout"]))
        if req["backend"] == "nccl":
            torch.cuda.set_device(0)
            x = torch.ones(1, device="cuda")
        else:
            x = torch.ones(1)
        dist.all_reduce(x)
        value = float(x.item())
        dist.destroy_process_group()
    except Exception as e:
        lines = [s for s in str(e).splitlines() if s.strip()] or [type(e).__name__]
        return {"error": f"{type(e).__name__}: {lines[0][:300]}"}
    return {"ok": value == req["world"], "value": value, "seconds": round(time.monotonic() - start, 3)}


def stdin_lines(out):
    for line in sys.stdin:
        out.put(line)
    os._exit(0)  # the check ended or its connection dropped: leave nothing behind, even mid-collective


def main():
    requests = queue.Queue()
    threading.Thread(target=stdin_lines, args=(requests,), daemon=True).start()
    send({"op": "hello", "pid": os.getpid()})
    listener = None
    while True:
        req = json.loads(requests.get())
        op = req["op"]
        try:
            if op == "probe":
                reply = probe(req)
            elif op == "listen":
                listener = Listener(req["port"], req["token"])
                reply = {"ok": True}
            elif op == "unlisten":
                reply = {"ok": True, "accepted": listener.accepted if listener else 0}
                if listener:
                    listener.close()
                    listener = None
            elif op == "connect":
                reply = connect(req)
            elif op == "all_reduce":
                reply = all_reduce(req)
            else:
                reply = {"error": f"unknown request {op!r}"}
        except OSError as e:
            reply = {"error": e.strerror or str(e)}
        reply["op"] = op
        send(reply)


if __name__ == "__main__":
    main()
