"""Overhead benchmark: elastic DP vs plain torch DDP (torchrun) vs Ray Train's TorchTrainer.

Same model (a 4-layer 1024-wide tanh MLP, ~2.38M parameters), same data, same seed, same
global batch and number of steps, 2 workers with 1 CPU thread each, gloo. Each run is a fresh
process launched from here (a private RAY_TMPDIR for the Ray-based ones), in rounds
``elastic, ddp, raytrain, elastic, ddp, raytrain, ...``. For every run it measures

- start-up: from launching the process to the end of the first training step (rank 0's
  wall clock), and from the API call (``elastic.fit`` / ``ray.init`` + ``TorchTrainer.fit``;
  for torchrun, the launch) to the end of the first step;
- steady-state throughput: global samples per second over the steps after a warm-up
  (the first 20 % by default), from rank 0's per-step end timestamps; and the median
  step time over the same steps (robust to stalls from other load on the machine).

While a run trains, its processes' CPU time and the machine's are sampled every second, so each
run also says how many cores its two ranks used, how many the rest of the run used (launcher,
Ray driver, raylet, controller actors: orchestration), and how many everything else on the
machine used (other people's load; the machine this was written on is shared).

It prints a per-run table and the medians with the ratios elastic/DDP and elastic/Ray Train,
over all runs and over the quiet runs only (others under ``--quiet-cores`` during the steady
window). Usage::

    python bench/overhead.py                # up to 4 rounds of 300 steps, global batch 128
    python bench/overhead.py --rounds 2 --steps 300 --json results.json

This is a benchmark, not a test: it never fails on a ratio. All child processes (torchrun,
Ray clusters) are killed when a run ends, including on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
SYSTEMS = ("elastic", "ddp", "raytrain")
LABEL = {"elastic": "elastic DP (elastic.fit)", "ddp": "torch DDP (torchrun)",
         "raytrain": "Ray Train TorchTrainer"}


@dataclass
class Run:
    system: str
    round: int
    ok: bool
    wall_s: float
    startup_launch_s: float = float("nan")
    startup_api_s: float = float("nan")
    steady_samples_per_s: float = float("nan")
    median_step_ms: float = float("nan")
    steps: int = 0
    final_loss: float = float("nan")
    leftovers_killed: int = 0
    background_cores: float = float("nan")  # others' load just before the run
    ranks_cores: float = float("nan")  # CPU of the 2 busiest processes, steady window
    other_cores: float = float("nan")  # CPU of the run's other processes, steady window
    others_cores: float = float("nan")  # CPU of everything else on the machine, same window
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- processes


def _pids_mentioning(text: str) -> list[int]:
    """PIDs of processes whose command line contains ``text`` (our private temp dir)."""
    out = []
    me = os.getpid()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(d))
    return out


def _kill_leftovers(proc: subprocess.Popen[bytes], tmp: str) -> int:
    """Kill the run's process group and any process still naming its temp dir (Ray's
    raylet, GCS and workers). Returns how many such stray processes there were."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    stray = _pids_mentioning(tmp)
    for pid in stray:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + 5
    while time.time() < deadline and _pids_mentioning(tmp):
        time.sleep(0.2)
    for pid in _pids_mentioning(tmp):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(stray)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_times(session: int, tmp: str) -> dict[int, tuple[str, float, int]]:
    """CPU seconds (user+sys) and minor page faults of every process of a run: its session,
    or naming its temp dir."""
    out: dict[int, tuple[str, float, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
            fields = st[st.rindex(")") + 2:].split()
            mine = int(fields[3]) == session  # field 6: session id
            if not mine:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    mine = tmp.encode() in f.read()
            if mine:
                name = st[st.index("(") + 1:st.rindex(")")]
                out[int(d)] = (name, (int(fields[11]) + int(fields[12])) / _TICK,
                               int(fields[7]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _machine_busy_s() -> float:
    """CPU seconds spent busy machine-wide since boot (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / _TICK


def _busy_cores(seconds: float = 1.0) -> float:
    """Cores busy machine-wide over ``seconds`` (between runs: other people's load)."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + v[4]
        return sum(v[:8]) - idle, sum(v[:8])
    b0, t0 = snap()
    time.sleep(seconds)
    b1, t1 = snap()
    return (b1 - b0) / max(1, t1 - t0) * (os.cpu_count() or 1)


def _wait_quiet(max_wait_s: float, threshold: float) -> float:
    """Wait (up to ``max_wait_s``) until others use under ``threshold`` cores; return the last
    reading."""
    deadline = time.time() + max_wait_s
    busy = _busy_cores()
    while busy > threshold and time.time() < deadline:
        busy = _busy_cores(2.0)
    return busy


Sample = tuple[float, dict[int, tuple[str, float, int]], float]  # time, {pid: (name, cpu s,
# minor faults)}, machine busy s


def _window_cpu(samples: list[Sample], t_a: float, t_b: float) -> dict[str, Any] | None:
    """CPU use (cores) between the first and last samples in [t_a, t_b]: the run's two busiest
    processes (the training ranks), the run's other processes (orchestration), and everything
    else on the machine (other people's load)."""
    inside = [s for s in samples if t_a <= s[0] <= t_b]  # never a sample after the ranks exit
    if len(inside) < 2:
        return None
    a, b = inside[0], inside[-1]
    dt = b[0] - a[0]
    if dt <= 0.5:
        return None
    use = sorted(((b[1][p][1] - a[1].get(p, (n, 0.0, 0))[1], n, p) for p, (n, _, _) in
                  b[1].items()), reverse=True)
    faults = sum(b[1][p][2] - a[1].get(p, ("", 0.0, b[1][p][2]))[2] for _, _, p in use[:2]) / dt
    use = [(c, n) for c, n, _ in use]
    ranks = use[:2]
    rest = use[2:]
    top = ", ".join(f"{n} {c / dt:.2f}" for c, n in rest[:4] if c / dt >= 0.01)
    ranks_c, rest_c = sum(c for c, _ in ranks) / dt, sum(c for c, _ in rest) / dt
    others = max(0.0, (b[2] - a[2]) / dt - ranks_c - rest_c)
    return {"ranks_cores": ranks_c, "other_cores": rest_c, "others_cores": others,
            "other_top": top, "seconds": dt, "rank_faults_per_s": faults}


def _command(system: str, out: str, tmp: str, args: argparse.Namespace) -> list[str]:
    py = sys.executable
    steps, g = str(args.steps), str(args.global_batch)
    if system == "elastic":
        return [py, os.path.join(BENCH, "_overhead_elastic.py"), out, steps, g,
                os.path.join(tmp, "run")]
    if system == "ddp":
        torchrun = os.path.join(os.path.dirname(py), "torchrun")
        return [torchrun, "--standalone", "--nproc_per_node", "2",
                os.path.join(BENCH, "_overhead_ddp.py"), out, steps, g]
    if system == "raytrain":
        return [py, os.path.join(BENCH, "_overhead_raytrain.py"), out, steps, g,
                os.path.join(tmp, "storage"), str(args.raytrain_report_every)]
    raise ValueError(system)


def run_one(system: str, rnd: int, args: argparse.Namespace) -> Run:
    tmp = tempfile.mkdtemp(prefix=f"ovh-{system[:2]}-", dir="/tmp")
    out = os.path.join(tmp, "result.json")
    log = os.path.join(tmp, "log.txt")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_TMPDIR=os.path.join(tmp, "ray"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, BENCH, env.get("PYTHONPATH", "")]).rstrip(":"))
    os.makedirs(env["RAY_TMPDIR"])
    cmd = _command(system, out, tmp, args)
    background = _wait_quiet(args.quiet_wait_s, args.quiet_cores)
    samples: list[Sample] = []
    with open(log, "wb") as logf:
        t_launch = time.time()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True)
        err = ""
        try:
            while True:
                try:
                    rc = proc.wait(timeout=args.sample_s)
                    break
                except subprocess.TimeoutExpired:
                    if time.time() - t_launch > args.timeout_s:
                        raise
                    samples.append((time.time(), _cpu_times(proc.pid, tmp), _machine_busy_s()))
            if rc != 0:
                err = f"exit code {rc}"
        except subprocess.TimeoutExpired:
            err = f"timed out after {args.timeout_s}s"
        except BaseException:
            _kill_leftovers(proc, tmp)
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        t_exit = time.time()
        killed = _kill_leftovers(proc, tmp)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    r = Run(system, rnd, ok=False, wall_s=t_exit - t_launch, leftovers_killed=killed,
            background_cores=background)
    if not err and not os.path.exists(out):
        err = "no result file"
    if err:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        r.error = f"{err}; log tail:\n{tail}"
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        return r
    with open(out) as f:
        res = json.load(f)
    times = res["times"]
    n = len(times)
    k = min(int(n * args.warmup_frac), n - 2)
    window = times[k:]
    r.ok = True
    r.steps = n
    r.final_loss = float(res["losses"][-1])
    r.startup_launch_s = times[0] - t_launch
    r.startup_api_s = times[0] - res.get("t_api", t_launch)
    r.steady_samples_per_s = args.global_batch * (len(window) - 1) / (window[-1] - window[0])
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    r.median_step_ms = 1000 * statistics.median(gaps)
    cpu = _window_cpu(samples, window[0], window[-1])
    if cpu:
        r.ranks_cores, r.other_cores = cpu["ranks_cores"], cpu["other_cores"]
        r.others_cores = cpu["others_cores"]
    steps_per_s = (len(window) - 1) / (window[-1] - window[0])
    r.extra = {"max_step_ms": 1000 * max(gaps), "t_launch": t_launch,
               "rank_faults_per_step": (cpu["rank_faults_per_s"] / steps_per_s / 2
                                        if cpu else float("nan")),
               "other_top": cpu["other_top"] if cpu else "", "tmp": tmp if args.keep else None}
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return r


# ---------------------------------------------------------------------------------- report


def _med(runs: list[Run], attr: str) -> float:
    vals = [getattr(r, attr) for r in runs if r.ok]
    return statistics.median(vals) if vals else float("nan")


def _fmt(x: float, nd: int = 1) -> str:
    return "n/a" if x != x else f"{x:,.{nd}f}"


def _quiet(r: Run, args: argparse.Namespace) -> bool:
    return r.ok and r.others_cores == r.others_cores and r.others_cores < args.quiet_cores


def runs_table(runs: list[Run]) -> str:
    lines = ["| round | system | start-up from launch, s | from API call, s | steady samples/s | "
             "median step, ms | max step, ms | CPU ranks / rest / others, cores |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if not r.ok:
            lines.append(f"| {r.round + 1} | {r.system} | failed | | | | | |")
            continue
        lines.append(
            f"| {r.round + 1} | {r.system} | {r.startup_launch_s:.1f} | {r.startup_api_s:.1f} | "
            f"{r.steady_samples_per_s:,.0f} | {r.median_step_ms:.1f} | "
            f"{r.extra['max_step_ms']:.0f} | {_fmt(r.ranks_cores, 2)} / {_fmt(r.other_cores, 2)}"
            f" / {_fmt(r.others_cores, 2)} |")
    return "\n".join(lines)


def table(runs: list[Run], args: argparse.Namespace, quiet_only: bool = False) -> str:
    """Medians per system and the ratios; ``quiet_only``: only runs during which other
    processes used under ``--quiet-cores`` (paired ratios: rounds where both were quiet)."""
    keep = (lambda r: _quiet(r, args)) if quiet_only else (lambda r: True)
    by = {s: [r for r in runs if r.system == s] for s in args.systems}
    sel = {s: [r for r in rs if keep(r)] for s, rs in by.items()}
    lines = [
        "| system | runs | start-up from launch, s | start-up from API call, s | "
        "steady samples/s | median step, ms | CPU of ranks / rest, cores | others' load, "
        "cores | wall per run, s | per-round samples/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in args.systems:
        rs = sel[s]
        per = ", ".join(_fmt(r.steady_samples_per_s, 0) if r.ok else "fail" for r in rs)
        lines.append(
            f"| {LABEL[s]} | {sum(r.ok for r in rs)}/{len(by[s])} | "
            f"{_fmt(_med(rs, 'startup_launch_s'))}"
            f" | {_fmt(_med(rs, 'startup_api_s'))} | {_fmt(_med(rs, 'steady_samples_per_s'), 0)}"
            f" | {_fmt(_med(rs, 'median_step_ms'))} | {_fmt(_med(rs, 'ranks_cores'), 2)} / "
            f"{_fmt(_med(rs, 'other_cores'), 2)} | {_fmt(_med(rs, 'others_cores'), 2)}"
            f" | {_fmt(_med(rs, 'wall_s'))} | {per} |"
        )
    out = "\n".join(lines)
    ratios = []
    if "elastic" in by:
        for other in ("ddp", "raytrain"):
            if other not in by:
                continue
            e, o = sel["elastic"], sel[other]
            if not any(r.ok for r in e) or not any(r.ok for r in o):
                continue
            thr = _med(e, "steady_samples_per_s") / _med(o, "steady_samples_per_s")
            step = _med(o, "median_step_ms") / _med(e, "median_step_ms")
            paired = [a.steady_samples_per_s / b.steady_samples_per_s
                      for a, b in zip(by["elastic"], by[other], strict=False)
                      if a.ok and b.ok and keep(a) and keep(b)]
            pr = f"{statistics.median(paired):.3f}" if paired else "n/a"
            rng = f" (per round {min(paired):.3f}-{max(paired):.3f})" if paired else ""
            st = _med(e, "startup_launch_s") / _med(o, "startup_launch_s")
            ratios.append(
                f"| elastic / {LABEL[other]} | {thr:.3f} | {pr}{rng} | {step:.3f} | {st:.2f} |")
    if ratios:
        out += ("\n\n| ratio | steady samples/s (medians) | steady samples/s (paired rounds, "
                "median) | by median step time | start-up from launch |\n|---|---|---|---|---|\n"
                + "\n".join(ratios))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=540,
                    help="start no new round once this much time would be exceeded")
    ap.add_argument("--warmup-frac", type=float, default=0.2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--raytrain-report-every", type=int, default=0,
                    help="also call ray.train.report every N steps (0: only after the last)")
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--quiet-wait-s", type=float, default=10,
                    help="before each run, wait up to this long for the machine to be quiet")
    ap.add_argument("--quiet-cores", type=float, default=0.5,
                    help="'quiet': other processes use fewer cores than this (before a run, "
                    "and for the quiet-runs table, during its steady window)")
    ap.add_argument("--sample-s", type=float, default=1.0,
                    help="interval of the CPU-use samples of a run's processes")
    ap.add_argument("--json", help="write every run's figures here")
    ap.add_argument("--keep", action="store_true", help="keep temp dirs (logs, run dirs)")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    for s in args.systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r}; use {', '.join(SYSTEMS)}")

    def _on_sigterm(signum: int, frame: Any) -> None:  # clean up like Ctrl-C (run_one kills)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_sigterm)

    import torch

    print(f"overhead benchmark: {args.steps} steps, global batch {args.global_batch}, 2 workers x "
          f"1 thread, warm-up {args.warmup_frac:.0%}, up to {args.rounds} rounds; torch "
          f"{torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs",
          flush=True)
    t0 = time.time()
    runs: list[Run] = []
    round_s = 0.0
    for rnd in range(args.rounds):
        if rnd > 0 and time.time() - t0 + round_s > args.budget_s:
            print(f"stopping after {rnd} rounds: another would exceed --budget-s {args.budget_s:.0f}",
                  flush=True)
            break
        tr = time.time()
        for s in args.systems:
            r = run_one(s, rnd, args)
            runs.append(r)
            if r.ok:
                print(f"round {rnd + 1} {s:9s} start-up {r.startup_launch_s:6.2f}s (API "
                      f"{r.startup_api_s:6.2f}s)  steady {r.steady_samples_per_s:8.1f} samples/s  "
                      f"median step {r.median_step_ms:6.2f} ms  max step "
                      f"{r.extra['max_step_ms']:7.1f} ms  wall {r.wall_s:6.1f}s  loss "
                      f"{r.final_loss:.4f}  others' load before {r.background_cores:.2f} during "
                      f"{r.others_cores:.2f} cores  cpu ranks {r.ranks_cores:.2f} rest "
                      f"{r.other_cores:.2f} ({r.extra['other_top']})  minor faults per rank-step "
                      f"{r.extra['rank_faults_per_step']:.0f}"
                      + (f"  [killed {r.leftovers_killed} stray]"
                                                if r.leftovers_killed else ""), flush=True)
            else:
                print(f"round {rnd + 1} {s}: FAILED: {r.error}", flush=True)
        round_s = time.time() - tr
    print(f"\ntotal {time.time() - t0:.0f}s. Per run (CPU in the steady window: the 2 ranks, the "
          "run's other processes, everything else on the machine):\n")
    print(runs_table(runs))
    print("\nMedians over all rounds:\n")
    print(table(runs, args))
    print(f"\nMedians over quiet runs only (others used < {args.quiet_cores} cores during the "
          "steady window):\n")
    print(table(runs, args, quiet_only=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) for r in runs]}, f, indent=1)
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
