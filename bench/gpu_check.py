"""GPU path check (run on a CUDA machine; `--device cpu` dry-runs it here with gloo).

Exercises elastic's worker on a real device without Ray (the device machine has no Ray):
NCCL group formation, the per-step control all-reduce on device tensors, live switches
dp -> zero3 -> zero1 -> dp moving CUDA state in memory, an asynchronous checkpoint of CUDA
tensors (pinned host copy), commit, and a restore into a fresh worker; parameters are compared
with the single-process CPU reference; then bf16 autocast with gradient clipping and an lr
schedule on the device through a switch; then the warm pool's path (a pooled worker serving two
jobs in turn, reset between them); then the live per-rank compute spans (CUDA events) against a
synchronized wall time. Prints one line per check and exits non-zero on failure.

    python bench/gpu_check.py            # on the GPU machine
    python bench/gpu_check.py --device cpu
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from elastic.checkpoint import CheckpointMeta, commit, load  # noqa: E402
from elastic.config import JobConfig  # noqa: E402
from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp  # noqa: E402
from elastic.reference import reference_train  # noqa: E402
from elastic.worker import Worker  # noqa: E402
from elastic.worker.spans import SpanHooks  # noqa: E402
from strategies import StrategySpec  # noqa: E402

G = 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _diff(state: dict, ref: dict) -> float:
    """Largest absolute difference of a canonical state's parameters from a state dict."""
    return max(float((state[f"model/{k}"].cpu() - v).abs().max()) for k, v in ref.items())


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args()
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        print("FAIL no CUDA device")
        return 1
    ckdir = tempfile.mkdtemp(prefix="elastic-gpu-")
    cfg = JobConfig(model=tiny_mlp, optimizer=_adam, loss=mlp_loss, dataset=SyntheticRegression,
                    global_batch_size=G, max_steps=20, num_workers=1, checkpoint_uri=ckdir,
                    checkpoint_every=10)
    ok = True

    def check(name: str, cond: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= bool(cond)
        print(f"{'PASS' if cond else 'FAIL'} {name} {detail}", flush=True)

    print(f"torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name(0) if gpu else 'cpu'}", flush=True)
    w = Worker(cfg, 0, use_gpu=gpu, num_threads=4)
    t0 = time.perf_counter()
    w.join("127.0.0.1", _port(), 0, 1, 1, 60)
    check("group", torch.distributed.get_backend() == ("nccl" if gpu else "gloo"),
          f"backend {torch.distributed.get_backend()} in {time.perf_counter() - t0:.2f}s")
    from strategies._gather import group_timeout

    check("sub-groups take the job's timeout", group_timeout() == timedelta(seconds=60),
          str(group_timeout()))
    spec = lambda name: StrategySpec(name, 1, (G,))  # noqa: E731
    w.build(spec("dp"))
    dev = next(w.layout.strategy.local_model().parameters()).device
    check("device", dev.type == a.device, str(dev))
    w.run(0, 5)
    for name, (s0, s1) in (("zero3", (5, 10)), ("zero1", (10, 15)), ("dp", (15, 20))):
        out = w.build(spec(name))
        check(f"switch to {name}", out["hash_before"] == out["hash_after"],
              f"{out['seconds'] * 1e3:.0f} ms ({out.get('move', 'gather')}), state digest "
              f"{out['hash_after']}")
        r = w.run(s0, s1)
        if name == "zero3":  # the step-10 checkpoint was taken under zero3
            info = None
            for _ in range(600):
                info = w.checkpoint_poll()
                if info:
                    break
                time.sleep(0.05)
            check("checkpoint upload", bool(info and "info" in info), str(info)[:120])
            m = commit(w.checkpoints.store, 10, [info["info"]], CheckpointMeta(strategy="zero3"))
            w.checkpoint_done(10, True)
            check("checkpoint commit", m.step == 10, f"{m.total_bytes} bytes")
        check(f"run {name}", r["next_step"] == s1)
    steps = [m["step_time"] for m in w.drain()]
    final = w.full_state()
    ref, _ = reference_train(tiny_mlp, _adam, mlp_loss, SyntheticRegression(), G, 20, seed=0)
    diff = _diff(final, ref)
    check("matches CPU reference", diff < 1e-4, f"max |diff| {diff:.2e} after 20 Adam steps")
    print(f"INFO median step {sorted(steps)[len(steps) // 2] * 1e3:.2f} ms", flush=True)
    w.leave()  # parks the live state as CPU tensors and drops the device layout
    held = w.held_keys()
    check("leave parks the state", w.layout.strategy is None and w.progress()["has_state"]
          and len(held) > 0, f"{len(held)} entries parked")
    w.join("127.0.0.1", _port(), 0, 1, 3, 60)
    plan = [(k, 0, tuple(shape), dtype) for k, (shape, dtype) in sorted(held.items())]
    w.restore_from_peers(spec("zero3"), plan, 20)
    st = w.full_state()
    diff3 = _diff(st, ref)
    check("restore parked state into zero3 on the device", diff3 < 1e-4,
          f"max |diff| {diff3:.2e}")
    w.leave()
    w2 = Worker(cfg, 1, use_gpu=gpu, num_threads=4)
    w2.join("127.0.0.1", _port(), 0, 1, 2, 60)
    w2.build(spec("zero3"))
    saved = load(w.checkpoints.store, 10, want=["rng/rank0/cuda"], strict=False)
    if gpu:
        torch.cuda.manual_seed(1234)  # moved on: the restore must set it back
    w2.restore_checkpoint(spec("zero3"), 10)
    if gpu:
        check("restore sets the CUDA generator the checkpoint kept",
              "rng/rank0/cuda" in saved and torch.equal(
                  torch.cuda.get_rng_state(dev), saved["rng/rank0/cuda"]),
              f"saved keys {sorted(saved)}")
    w2.run(10, 20)
    st = w2.full_state()
    diff2 = _diff(st, ref)
    check("restore from checkpoint then train", diff2 < 1e-4, f"max |diff| {diff2:.2e}")
    w2.leave()
    # bf16 autocast, gradient clipping and an lr schedule on the device, through a switch
    from elastic.schedules import cosine

    sched = {"name": "cosine", "warmup_steps": 2}
    cfg3 = JobConfig(model=tiny_mlp, optimizer=_sgd, loss=mlp_loss, dataset=SyntheticRegression,
                     global_batch_size=G, max_steps=10, num_workers=1, precision="bf16",
                     max_grad_norm=0.5, lr_schedule=sched)
    w3 = Worker(cfg3, 2, use_gpu=gpu, num_threads=4)
    w3.join("127.0.0.1", _port(), 0, 1, 4, 60)
    w3.build(spec("dp"))
    w3.run(0, 5)
    w3.build(spec("zero3"))
    w3.run(5, 10)
    st = w3.full_state()
    norms = [m.get("grad_norm") for m in w3.drain()]
    fn = lambda s: cosine(s, total_steps=10, warmup_steps=2)  # noqa: E731
    ref_norms: list[float] = []
    ref3, _ = reference_train(tiny_mlp, _sgd, mlp_loss, SyntheticRegression(), G, 10, seed=0,
                              max_grad_norm=0.5, lr_schedule=fn, grad_norms=ref_norms,
                              precision="bf16")
    diff4 = _diff(st, ref3)
    check("bf16 + clip + schedule match the CPU autocast reference", diff4 < 5e-3,
          f"max |diff| {diff4:.2e}; norms {[round(n or 0, 3) for n in norms][:4]} vs "
          f"{[round(n, 3) for n in ref_norms][:4]}")
    w3.leave()
    # the warm pool's path: a pooled worker (built without a job: CUDA's context and a warm-up
    # step on the device) serves two jobs in turn, reset between them (CUDA's cache emptied);
    # ``_setup`` is what ``assign`` does, without the Ray node info ``assign`` returns
    before = torch.cuda.memory_allocated() if gpu else 0  # what the workers above still hold
    wp = Worker(None, -1, use_gpu=gpu, num_threads=4)
    check("pooled worker warmed up on the device", wp.warm_up_s > 0, f"{wp.warm_up_s:.2f}s")
    for n, (opt, n_steps) in enumerate(((_adam, 8), (_sgd, 6))):
        jc = JobConfig(model=tiny_mlp, optimizer=opt, loss=mlp_loss,
                       dataset=SyntheticRegression, global_batch_size=G, max_steps=n_steps,
                       num_workers=1)
        wp._setup(jc, 10 + n, None)  # noqa: SLF001
        wp.join("127.0.0.1", _port(), 0, 1, 1, 60)
        wp.build(spec("zero1" if n else "dp"))
        wp.run(0, n_steps)
        refp, _ = reference_train(tiny_mlp, opt, mlp_loss, SyntheticRegression(), G, n_steps,
                                  seed=0)
        dp_ = _diff(wp.full_state(), refp)
        check(f"pooled job {n + 1} matches its reference", dp_ < 1e-4, f"max |diff| {dp_:.2e}")
        out = wp.reset()
        check(f"reset after pooled job {n + 1}", out["ok"] and out["cuda_bytes"] <= before
              and out["threads"] == 0, f"cuda_bytes {out['cuda_bytes']} (before the pool: {before}), threads "
              f"{out['threads']}, modules dropped {len(out['modules_dropped'])}")
    # the closed loop's per-rank compute: the seconds inside the blocks' forwards, which on
    # CUDA must be the kernels' time (events), not the host's time to launch them
    dev = torch.device("cuda" if gpu else "cpu")
    n = 4096 if gpu else 512
    blocks = [torch.nn.Linear(n, n).to(dev) for _ in range(3)]
    x = torch.randn(2 * n, n, device=dev)
    hooks = SpanHooks()
    hooks.install(blocks, 1.0, dev)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            sync()
            hooks.take()
            t0 = time.perf_counter()
            y = x
            for b in blocks:
                y = b(y)
            sync()
            wall = time.perf_counter() - t0
    span = hooks.take()
    hooks.remove()
    check("live compute spans timed on the device", 0.5 * wall <= span <= 1.05 * wall,
          f"spans {span * 1e3:.2f} ms, synchronized wall {wall * 1e3:.2f} ms")
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
