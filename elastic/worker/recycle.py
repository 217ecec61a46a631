"""A pooled worker's process between jobs: what it looked like before any job, and the reset
that brings it back there as far as one process can (``elastic.control.pool``).

``Baseline`` is taken once, when the worker process is up and before its first job: the
modules loaded (torch, the process group's machinery, elastic), the environment variables,
the threads running, and the torch settings a job may change. ``reset`` runs after a job has
left its group and dropped its components: it

* unloads every module the job brought in that is not a library (its ``__file__`` outside
  the interpreter's prefixes): the next job imports its code afresh, so it sees neither the
  previous job's module globals nor an older version of a module it shares a name with;
* puts the environment variables back as they were (set, changed and removed), and the
  import path (``sys.path``: a job's ``sys.path.insert`` would make the next job's
  ``import model`` find the last job's file);
* restores torch's default dtype, deterministic-algorithms mode, grad mode, anomaly
  detection and thread count, cuDNN's switches (benchmark, deterministic, enabled) and the
  attention kernels' (flash, memory-efficient, math); the float32 precision settings (TF32,
  ``set_float32_matmul_precision``) are compared only, and a worker whose job changed them is
  retired (torch tracks which of its two APIs wrote them and raises on mixing them);
* collects garbage (unfreezing what the job froze first) and, on a GPU, empties CUDA's cache;
* counts the threads the job started that still run (the pool then retires the worker: a
  thread cannot be stopped from outside).

What it cannot undo is said in docs/scheduler.md ("Warm workers"): libraries the job
imported stay loaded (with any global state it gave them), and a CUDA context that hit a
sticky error stays broken (the pool retires a worker whose job failed in user code).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Baseline", "reset", "user_modules", "warm_up"]

_OWN = ("elastic", "strategies", "clusters")  # the project's packages: kept loaded


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


def warm_up(device: torch.device) -> float:
    """What a job's first layout would otherwise pay in this process, paid once ahead of
    any job: every layout's module imported, and one dp step of a tiny model on a process
    group of one (the backend's library, DDP's reducer, Adam's kernels, a collective).
    Returns the seconds taken."""
    import torch.distributed as dist

    from strategies import Runtime, StrategySpec, registry

    t0 = time.perf_counter()
    for name in registry.names():
        importlib.import_module(registry._LAYOUTS[name][0])
    if dist.is_initialized():
        return time.perf_counter() - t0
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        strat = registry.get("dp")(StrategySpec("dp", 1, (2,)), Runtime(0, 1, device), model,
                                   lambda ps: torch.optim.Adam(ps, lr=1e-3),
                                   torch.nn.functional.mse_loss)
        strat.train_step(torch.zeros(2, 4, device=device), torch.zeros(2, 1, device=device))
        strat.full_state()
        strat.close()
        del strat, model
    finally:
        dist.destroy_process_group()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return time.perf_counter() - t0


def _cuda_allocated() -> int:
    """Bytes allocated on this process's GPU (0 without CUDA in use)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return 0


@dataclass
class Baseline:
    """The process as it was before any job (see the module docstring)."""

    modules: frozenset[str]
    environ: dict[str, str]
    threads: frozenset[int]
    dtype: torch.dtype
    deterministic: bool
    num_threads: int
    roots: tuple[str, ...] = field(default_factory=_library_roots)
    path: tuple[str, ...] = field(default_factory=lambda: tuple(sys.path))  # import path
    cuda_bytes: int = field(default_factory=_cuda_allocated)  # the start's own
    backends: dict[str, Any] = field(default_factory=lambda: _backends())
    _ready: set[tuple[int, int]] = field(default_factory=set)  # (thread, job): on_thread

    def on_thread(self, job: int) -> None:
        """At a job's call: per-thread torch switches a job's code may flip (grad mode,
        anomaly detection, the intra-op thread count) set back to these on a thread job
        ``job`` has not called on yet. ``reset`` sets them on the thread it runs on only,
        and a worker actor has two."""
        me = (threading.get_ident(), job)
        if me in self._ready:
            return
        self._ready = {r for r in self._ready if r[1] == job} | {me}
        torch.set_grad_enabled(True)
        torch.autograd.set_detect_anomaly(False)
        torch.set_num_threads(self.num_threads)

    @staticmethod
    def take() -> Baseline:
        return Baseline(frozenset(sys.modules), dict(os.environ),
                        frozenset(t.ident for t in threading.enumerate() if t.ident),
                        torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                        torch.get_num_threads())


# torch's process-wide numerics switches a job may flip: left as a job set them, the next job
# on the process would run other arithmetic than a fresh worker's. These are restored (each
# (read, write)); the float32 precision settings (TF32, the matmul precision) are only
# compared: torch tracks which of its two APIs set them and raises on reading one after the
# other was written, so a worker whose job changed them is retired instead of reset.
_SWITCHES: dict[str, tuple[Any, Any]] = {
    "cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                        lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    "cudnn.deterministic": (lambda: torch.backends.cudnn.deterministic,
                            lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
    "cudnn.enabled": (lambda: torch.backends.cudnn.enabled,
                      lambda v: setattr(torch.backends.cudnn, "enabled", v)),
    "flash_sdp": (lambda: torch.backends.cuda.flash_sdp_enabled(),
                  lambda v: torch.backends.cuda.enable_flash_sdp(v)),
    "mem_efficient_sdp": (lambda: torch.backends.cuda.mem_efficient_sdp_enabled(),
                          lambda v: torch.backends.cuda.enable_mem_efficient_sdp(v)),
    "math_sdp": (lambda: torch.backends.cuda.math_sdp_enabled(),
                 lambda v: torch.backends.cuda.enable_math_sdp(v)),
}
_PRECISION = ("fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision",
              "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision",
              "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision",
              "mkldnn.rnn.fp32_precision")


def _backends() -> dict[str, Any]:
    """The switches' values and the precision settings' (the new API's attributes, readable
    whichever API wrote them); what this torch lacks is left out."""
    out: dict[str, Any] = {}
    for name, (read, _) in _SWITCHES.items():
        try:
            out[name] = read()
        except (AttributeError, RuntimeError):
            pass
    for path in _PRECISION:
        obj: Any = torch.backends
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        out[path] = obj
    return out


def _restore_backends(saved: dict[str, Any]) -> tuple[int, list[str]]:
    """Set every switch back; (how many had changed, the precision settings that differ)."""
    now = _backends()
    changed = 0
    for name, (_, write) in _SWITCHES.items():
        if name in saved and now.get(name) != saved[name]:
            write(saved[name])
            changed += 1
    return changed, [p for p in _PRECISION if p in saved and now.get(p) != saved[p]]


def user_modules(base: Baseline) -> list[str]:
    """Modules loaded since ``base`` that are neither libraries (installed under the
    interpreter's prefixes) nor the project's own packages: the job's code."""
    out = []
    for name, mod in list(sys.modules.items()):
        if name in base.modules or name.split(".")[0] in _OWN:
            continue
        path = getattr(mod, "__file__", None)
        if path and os.path.realpath(path).startswith(base.roots):
            continue  # a library (stdlib or site-packages)
        out.append(name)
    return sorted(out)


def reset(base: Baseline, keep_threads: set[int] | frozenset[int] = frozenset(),
          freeze: bool = True, unfreeze: bool = True) -> dict[str, Any]:
    """Bring the process back to ``base`` as far as it can (module docstring). Returns what
    was done: ``modules_dropped``, ``env_restored``, ``backends_restored`` (cuDNN and
    attention switches set back), ``precision_changed`` (float32 precision settings the job
    changed: the caller retires the worker), ``threads`` (threads started since
    ``base`` that still run, beyond ``keep_threads``, elastic's own ``elastic-*`` threads and
    the threads Ray's core runs Python on), ``cuda_bytes`` (still allocated on the device).
    ``freeze``: move what survives to the collector's permanent generation (as the worker
    does at start-up), keeping later collections short. ``unfreeze``: collect the permanent
    generation too (needed when the job's objects were frozen; otherwise only they are
    scanned, not the ~320k objects frozen at start-up)."""
    dropped = user_modules(base)
    for name in dropped:
        sys.modules.pop(name, None)
    path_restored = tuple(sys.path) != base.path  # a job's sys.path.insert: the next job's
    if path_restored:  # ``import model`` would find the last job's module of that name
        sys.path[:] = base.path
        importlib.invalidate_caches()
    env_changed = 0
    for k in set(os.environ) - set(base.environ):
        del os.environ[k]
        env_changed += 1
    for k, v in base.environ.items():
        if os.environ.get(k) != v:
            os.environ[k] = v
            env_changed += 1
    torch.set_default_dtype(base.dtype)
    torch.use_deterministic_algorithms(base.deterministic)
    torch.set_grad_enabled(True)
    torch.autograd.set_detect_anomaly(False)
    torch.set_num_threads(base.num_threads)
    backends_restored, precision_changed = _restore_backends(base.backends)
    if unfreeze:
        gc.unfreeze()
    gc.collect()
    cuda_bytes = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        cuda_bytes = int(torch.cuda.memory_allocated())
    if freeze:
        gc.freeze()
    extra = [t for t in threading.enumerate() if t.is_alive() and t.ident not in base.threads
             and t.ident not in keep_threads and not t.name.startswith("elastic")
             and not isinstance(t, threading._DummyThread)]  # Ray's own (C++) threads
    return {"modules_dropped": dropped, "env_restored": env_changed,
            "path_restored": path_restored, "threads": len(extra),
            "thread_names": [t.name for t in extra][:5], "cuda_bytes": cuda_bytes,
            "backends_restored": backends_restored, "precision_changed": precision_changed}



def precision_changed(out: dict[str, Any]) -> str:
    """Why a process ``reset`` reported ``out`` for should not serve another job because its
    job changed torch's float32 precision ("": it did not); not undone in place."""
    if not out.get("precision_changed"):
        return ""
    return ("the job changed torch's float32 precision ("
            f"{', '.join(out['precision_changed'])}): not undone in place")
