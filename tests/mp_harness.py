"""A tiny multi-process harness: N spawned processes forming a gloo (or NCCL, one GPU per
process) group on 127.0.0.1.

``ProcessPool(n)`` spawns n long-lived processes once (importing torch costs seconds on a
loaded 2-core machine); ``pool.run(fn, *args, world_size=k)`` forms a fresh gloo group of the
first k processes (a new TCP store on a free port whenever k changes, as elastic re-forms its
group), calls ``fn(*args)`` on each of them and returns the k results in rank order. ``fn``
and its arguments must be picklable (module-level functions). If any rank raises, the pool is
torn down and ``WorkerFailed`` carries that rank's traceback; a broken pool refuses new work.

Every worker runs ``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import os
import queue
import random
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

__all__ = ["ProcessPool", "WorkerFailed", "run_distributed", "free_port"]


class WorkerFailed(RuntimeError):
    """A rank raised (or the pool timed out); the message holds the rank's traceback."""


_RNG = random.Random()  # its own: a test that seeds ``random`` must not make ports repeat


def free_port() -> int:
    """A port free now, for a store or server a test starts next. Not from the kernel's
    ephemeral range: the port is closed again before the store binds it, and any outgoing
    connection meanwhile (Ray opens many) may take an ephemeral port (a store once failed on
    one, EADDRINUSE); nor from Ray's worker ports (10002-19999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    lo, hi = 20000, min(32767, first - 1)
    for _ in range(200 if hi > lo else 0):
        port = _RNG.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(index: int, tasks: Any, results: Any, group_timeout_s: float, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(index)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    current: tuple[int, int] | None = None  # (world_size, port) of the group we are in
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, world_size, port = item
        try:
            if current != (world_size, port):
                if dist.is_initialized():
                    dist.destroy_process_group()
                current = None
                if index < world_size:
                    dist.init_process_group(
                        backend,
                        init_method=f"tcp://127.0.0.1:{port}",
                        rank=index,
                        world_size=world_size,
                        timeout=timedelta(seconds=group_timeout_s),
                    )
                    current = (world_size, port)
            if index >= world_size:
                continue  # not part of this run
            results.put((index, True, fn(*args)))
        except BaseException:  # report every failure, including assertion errors, to the parent
            results.put((index, False, traceback.format_exc()))
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessPool:
    """``n`` spawned worker processes that run functions as the ranks of a gloo group."""

    def __init__(self, n: int, group_timeout_s: float = 60.0, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.n = n
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(n)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(i, self._tasks[i], self._results, group_timeout_s, backend),
                daemon=True,
            )
            for i in range(n)
        ]
        for p in self._procs:
            p.start()
        self._group: tuple[int, int] | None = None
        self.broken = False

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        world_size: int | None = None,
        timeout_s: float = 120.0,
    ) -> list[Any]:
        """Call ``fn(*args)`` on ranks ``0..world_size-1``; return their results in rank order.

        Raises ``WorkerFailed`` (and closes the pool) if a rank raises or the run times out.
        """
        if self.broken:
            raise WorkerFailed("the pool is broken by an earlier failure")
        k = self.n if world_size is None else world_size
        if not 1 <= k <= self.n:
            raise ValueError(f"world_size {k} outside 1..{self.n}")
        if self._group is None or self._group[0] != k:
            self._group = (k, free_port())
        for q in self._tasks:
            q.put((fn, args, *self._group))
        out: dict[int, Any] = {}
        try:
            while len(out) < k:
                index, ok, value = self._results.get(timeout=timeout_s)
                if not ok:
                    raise WorkerFailed(f"rank {index} failed:\n{value}")
                out[index] = value
        except queue.Empty:
            self.close(grace_s=0.0)
            raise WorkerFailed(
                f"no result within {timeout_s} s (ranks done: {sorted(out)})"
            ) from None
        except WorkerFailed:
            self.close(grace_s=0.0)  # the other ranks may be stuck in a collective
            raise
        return [out[i] for i in range(k)]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop the workers; kill those that have not exited after ``grace_s`` seconds."""
        if not self.broken:
            for q in self._tasks:
                q.put(None)
        self.broken = True
        for p in self._procs:
            p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """One-shot: spawn ``world_size`` processes, run ``fn(*args)`` on each, return results."""
    pool = ProcessPool(world_size)
    try:
        return pool.run(fn, *args)
    finally:
        pool.close()
