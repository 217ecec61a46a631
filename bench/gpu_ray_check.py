"""GPU path through Ray (run on a CUDA machine with Ray; `--cpu` dry-runs it here on gloo).

`bench/gpu_check.py` drives the worker without Ray. This submits real jobs to a local Ray whose
GPU the workers are placed on (`use_gpu: true`: a `num_gpus=1` bundle per worker, NCCL): one job
switches dp -> zero3 -> zero1 live on the device with checkpoints every 10 steps, a second job
(the same job, continued) resumes the latest checkpoint under zero2 and trains on; both are compared with the
single-process CPU reference, and the GPU must be free again after each job. One line per
check; exits non-zero on a failure.

    python bench/gpu_ray_check.py          # on the GPU machine (bench/device_wheels.py: Ray)
    python bench/gpu_ray_check.py --cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import _strat_common as common  # noqa: E402
import torch  # noqa: E402

from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp  # noqa: E402
from elastic.reference import reference_train  # noqa: E402

G = 32


def _adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def _wait(handle, n: int, timeout: float = 120.0) -> None:
    t0 = time.time()
    while handle.status().get("step", 0) < n:
        if handle.done():
            handle.result()
        if time.time() - t0 > timeout:
            raise TimeoutError(f"step {n} not reached in {timeout:.0f} s")
        time.sleep(0.02)


def _gpus_free(ray, total: float, timeout: float = 30.0) -> float:
    """Ray's free GPUs once they are all back (or what is free after ``timeout``)."""
    t0 = time.time()
    while (free := ray.available_resources().get("GPU", 0)) < total and time.time() - t0 < timeout:
        time.sleep(0.1)
    return free


def _diff(state: dict, ref: dict) -> float:
    return max(float((state[k] - v).abs().max()) for k, v in ref.items())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU workers (gloo)")
    a = ap.parse_args()
    gpu = not a.cpu
    tmp = common.private_ray_env("rgpu-")
    import ray

    import elastic

    ok = True

    def check(name: str, cond: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= bool(cond)
        print(f"{'PASS' if cond else 'FAIL'} {name} {detail}", flush=True)

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        total = ray.cluster_resources().get("GPU", 0)
        print(f"ray {ray.__version__}, torch {torch.__version__}, GPUs in Ray: {total}", flush=True)
        if gpu and total < 1:
            check("Ray sees the GPU", False)
            return 1
        ck = os.path.join(tmp, "ckpt")
        common_kw = dict(model=tiny_mlp, optimizer=_adam, loss=mlp_loss,
                         dataset=SyntheticRegression(), global_batch_size=G, num_workers=1,
                         use_gpu=gpu, view="none", checkpoint_uri=ck, checkpoint_every=10,
                         hang_timeout_s=120)
        t0 = time.time()
        h = elastic.submit(**common_kw, strategy="dp", max_steps=100_000, name="gpu-a",
                           run_dir=os.path.join(tmp, "a"))
        _wait(h, 1)
        check("first step", True, f"{time.time() - t0:.1f} s after submit")
        for name in ("zero3", "zero1"):  # each after 8 more steps (at the next boundary)
            _wait(h, h.status()["step"] + 8)
            h.switch(name, reason="gpu check", timeout=120)
        _wait(h, h.status()["step"] + 8)
        h.stop()
        res = h.result(timeout=300)
        n1 = len(res.history)
        placed = next(e for e in res.events if e.kind == "placed")
        want = torch.cuda.get_device_name(0) if gpu else "cpu"
        check("worker placed on the device", want in placed.message, placed.message)
        strategies = [m["strategy"] for m in res.history]
        check("ran dp, zero3 and zero1", {"dp", "zero3", "zero1"} <= set(strategies),
              str(sorted(set(strategies))))
        ref, _ = reference_train(tiny_mlp, _adam, mlp_loss, SyntheticRegression(), G, n1, seed=0)
        d = _diff(res.state_dict(), ref)
        check("job 1 matches the CPU reference", d < 1e-4,
              f"{len(res.history)} steps, max |diff| {d:.2e} (tolerance 1e-4: CUDA kernels "
              "sum in another order)")
        free = _gpus_free(ray, total)
        check("the GPU is free after the job", free == total, f"{free} of {total}")
        h2 = elastic.submit(**common_kw, strategy="zero2", max_steps=n1 + 6, resume="latest",
                            name="gpu-a", run_dir=os.path.join(tmp, "b"))
        res2 = h2.result(timeout=300)
        first = res2.history[0]["step"] if res2.history else None
        ref2, _ = reference_train(tiny_mlp, _adam, mlp_loss, SyntheticRegression(), G, n1 + 6,
                                  seed=0)
        d2 = _diff(res2.state_dict(), ref2)
        check("job 2 resumed the checkpoint under zero2 and matches", first == n1
              and d2 < 1e-4, f"first step {first}, max |diff| {d2:.2e}")
        free = _gpus_free(ray, total)
        check("the GPU is free after the second job", free == total, f"{free} of {total}")
    finally:
        ray.shutdown()
    print("ALL PASS" if ok else "SOME FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
