"""Shared workload of bench/strategies.py and bench/_strat_profile.py: a ~50 MB MLP.

``model_factory()`` is an ``nn.Sequential`` of ``DEPTH`` blocks ``Linear(WIDTH, WIDTH) + Tanh``
(12 x 1,049,600 = 12,595,200 fp32 parameters, 50.4 MB of weights; Adam adds two moments, so
the canonical state is about 151 MB). Each block is a pipeline block and an FSDP unit. The
data are a seeded ``SyntheticRegression`` of ``WIDTH``-wide inputs and targets, loss MSE.
Imported as a top-level module (``bench/`` is put on PYTHONPATH by the scripts), so Ray
workers unpickle these factories by reference.
"""

from __future__ import annotations

import functools

from torch import nn

from elastic.models import SyntheticRegression, demo_dataset, gpt, gpt_loss

WIDTH = 1024
DEPTH = 12
DATA_N = 512
OPTIM = {"name": "adam", "lr": 1e-4}
LOSS = "mse"
SEED = 0


def model_factory(width: int = WIDTH, depth: int = DEPTH) -> nn.Module:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(depth)])


dataset_factory = functools.partial(SyntheticRegression, n=DATA_N, in_features=WIDTH,
                                    out_features=WIDTH, seed=SEED)


def n_params(width: int = WIDTH, depth: int = DEPTH) -> int:
    return depth * (width * width + width)


def gpt_factory() -> nn.Module:
    """The second workload (``--model gpt``): elastic.models' TinyGPT, 4 layers, 4 heads,
    n_embd 128 (0.82M parameters in 53 tensors), on the demo corpus, 64-token blocks."""
    return gpt(block_size=64, n_layer=4, n_head=4, n_embd=128)


gpt_dataset_factory = functools.partial(demo_dataset, 64)

# name -> what a job trains: model and dataset factories, loss
WORKLOADS = {
    "mlp": {"model": model_factory, "dataset": dataset_factory, "loss": LOSS},
    "gpt": {"model": gpt_factory, "dataset": gpt_dataset_factory, "loss": gpt_loss},
}


# ------------------------------------------------------------------ machine helpers
# (also used by bench/hetero.py and bench/recovery.py)

import os  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
_TICK = os.sysconf("SC_CLK_TCK")


def private_ray_env(prefix: str) -> str:
    """A private RAY_TMPDIR (short path: Ray's socket paths must stay under 107 bytes) and the
    environment every Ray process started from here inherits (bench/ and the repo importable,
    token auth off, no RAY_ADDRESS). Call before ``ray.init``. Returns the directory."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    os.environ["OMP_NUM_THREADS"] = "1"
    cache = os.path.join(tmp, "elastic-cache")  # measured speeds: a private profile cache
    os.makedirs(cache, exist_ok=True)
    os.environ["ELASTIC_CACHE_DIR"] = cache
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [ROOT, BENCH, *filter(None, [os.environ.get("PYTHONPATH")])])
    return tmp


def pids_mentioning(text: str) -> list[int]:
    out = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(d))
        except OSError:
            continue
    return out


def wait_settled(max_wait_s: float = 30.0, cores: float = 0.25, seconds: float = 1.0) -> float:
    """Wait (up to ``max_wait_s``) until the processes this one started (a fresh Ray's GCS,
    raylet and pre-started workers importing) use under ``cores`` together over ``seconds``;
    returns the seconds waited. So that no configuration is timed while the bench's own Ray is
    still starting, or the previous job's workers are still exiting."""
    import psutil  # Ray's own (ray/thirdparty_files), importable once Ray is

    t0 = time.time()
    while True:
        pids = [p.pid for p in psutil.Process().children(recursive=True)]
        a = sum(proc_cpu_s(p) for p in pids)
        time.sleep(seconds)
        used = (sum(proc_cpu_s(p) for p in pids) - a) / seconds
        if used < cores or time.time() - t0 > max_wait_s:
            return time.time() - t0


def kill_leftovers(tmp: str) -> int:
    """SIGTERM, then SIGKILL, every process whose command line names ``tmp`` (our private Ray
    temp dir: raylets, GCS, workers). Returns how many there were."""
    stray = pids_mentioning(tmp)
    for pid in stray:
        try:
            os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.time() + 5
    while time.time() < deadline and pids_mentioning(tmp):
        time.sleep(0.2)
    for pid in pids_mentioning(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(stray)


def _machine() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v[:8]) - idle, sum(v[:8])


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy machine-wide over ``seconds``."""
    b0, t0 = _machine()
    time.sleep(seconds)
    b1, t1 = _machine()
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def proc_cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        fields = st[st.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def proc_mem_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak over the process's life) in MB, from /proc."""
    out = {"rss_mb": float("nan"), "hwm_mb": float("nan")}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_mb"] = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    out["hwm_mb"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


class Sampler:
    """Background sampling (every ``period`` s) of machine-wide busy cores and of the RSS and
    CPU time of a set of pids; ``window(t_a, t_b)`` summarises a time window."""

    def __init__(self, period: float = 0.2) -> None:
        self.period = period
        self.pids: list[int] = []
        self.samples: list[tuple[float, tuple[int, int], dict[int, tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            pids = list(self.pids)
            per = {p: (proc_mem_mb(p)["rss_mb"], proc_cpu_s(p)) for p in pids}
            self.samples.append((time.time(), _machine(), per))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=2)

    def window(self, t_a: float, t_b: float) -> dict[str, object]:
        s = [x for x in list(self.samples) if t_a <= x[0] <= t_b]
        if len(s) < 2:
            return {}
        a, b = s[0], s[-1]
        dt = b[0] - a[0]
        ncpu = os.cpu_count() or 1
        machine = (b[1][0] - a[1][0]) / max(1, b[1][1] - a[1][1]) * ncpu
        ours = sum(b[2][p][1] - a[2].get(p, (0.0, b[2][p][1]))[1] for p in b[2]) / dt
        peak = {p: max(x[2][p][0] for x in s if p in x[2]) for p in b[2]}
        return {"machine_cores": machine, "workers_cores": ours,
                "others_cores": max(0.0, machine - ours), "peak_rss_mb": peak, "seconds": dt}


def code_version() -> str:
    """The commit the code under test comes from, "+dirty" when elastic/, strategies/ or
    clusters/ differ from it (other people commit to this repository while benchmarks run)."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "elastic",
                                "strategies", "clusters"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_gloo_ranks(target: Any, workers: int, args: Any, timeout_s: float = 3600) -> Any:
    """Spawn ``workers`` processes running ``target(rank, workers, port, args, queue)`` (one
    gloo group on a free local port) and return what rank 0 puts on the queue."""
    import torch.multiprocessing as mp

    from tests.mp_harness import free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, workers, port, args, q))
             for r in range(workers)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def join_gloo_family(rank: int, world: int, port: int, family: str
                     ) -> tuple[Any, Any, list[int], int]:
    """In a ``run_gloo_ranks`` target: one thread, the gloo group joined, and planner family
    ``family``'s (Family, dataset, shares of its global batch per rank, this rank's first
    sample)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from _planner_models import ALL as FAMILIES

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    fam = FAMILIES[family]
    g = fam.global_batch
    shares = [g // world + (1 if i < g % world else 0) for i in range(world)]
    return fam, fam.dataset(), shares, sum(shares[:rank])
