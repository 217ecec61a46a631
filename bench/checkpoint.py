"""Benchmark of elastic.checkpoint (not a test).

For each state size (canonical random tensors split over 2 "ranks", run as spawned processes
like Ray worker processes) and each backend (local disk; an S3 server on moto that this script
starts), it measures:

- blocked: the time training is blocked per checkpoint, i.e. ``ShardWriter.begin()`` (host
  copy only), the slower of the 2 ranks, cold (first checkpoint: fresh host buffer) and warm
  (median of the next ones);
- sync save: a synchronous ``torch.save`` of the same whole state to the same backend (to a
  new file each time: what a rank-0 save in the training loop costs);
- upload: the shard upload of both ranks (bytes / the slower rank's upload time) against a raw
  pyarrow write of the same bytes from both ranks (same block size, no checksums, no index).

Each configuration also loads its first checkpoint back and asserts it is bit-exact.

- blocked, overlapped: what a job does (``begin(..., later=...)``): the parameter and
  optimizer copies run on the upload thread while the rank computes the next step's forward
  and backward (a real one: an MLP of ``Linear(1024, 1024)`` layers with as many parameters
  as the state has "model/" floats, batch 32, one thread), and the update waits for them
  (``staged()``). Blocked = ``begin()`` + that wait. Also reported: how much slower that
  forward+backward was than the same one with no copy beside it (on 2 cores the copy
  thread competes with the other rank). The deferred copy takes each chunk's CRC right after
  copying it (in cache), so the upload after it only writes: **upload, overlapped** is
  bytes / the slower rank's upload, and **host copy + CRC + upload** adds the deferred copy
  (``ShardInfo.copy_seconds``), the whole background path. Because the overlapped upload
  competes with the compute for the cores, **upload after a fused copy** takes the same
  deferred checkpoint with nothing computing beside it (``staged()`` at once), like the raw
  write it is compared with.

Optionally (``--ray-train``) the same state through Ray Train's
``ray.train.report(checkpoint=...)`` in a 1-worker TorchTrainer with a local storage_path.
That starts a Ray cluster, so it is off by default.

Usage: python bench/checkpoint.py [--sizes-mb 50 500] [--backends local s3] [--repeats 4]
       [--device cpu|cuda] [--ray-train]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.checkpoint import (  # noqa: E402
    CheckpointStore,
    ShardInfo,
    ShardWriter,
    apply_retention,
    commit,
    load,
    owned_pieces,
)

WORLD = 2
BLOCK = 8 << 20


def make_state(total_mb: int, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Canonical state: 'model/' and 'optim/' keys, a few large matrices plus small vectors."""
    g = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    target = total_mb * 1_000_000
    i = 0
    size = 0
    while size < target:
        rows = min(1024, max(1, (target - size) // 4096))
        for key in (f"model/layers.{i}.weight", f"optim/layers.{i}.weight/exp_avg"):
            state[key] = torch.randn(rows, 1024, generator=g, device=device)
        state[f"model/layers.{i}.bias"] = torch.randn(1024, generator=g, device=device)
        state[f"optim/layers.{i}.weight/step"] = torch.tensor(float(i), device=device)
        size = sum(t.numel() * t.element_size() for t in state.values())
        i += 1
    return state


def _rank_main(
    rank: int, mb: int, device: str, uri: str, options: dict[str, Any], conn: Any
) -> None:
    """One "rank" process: builds the same state, keeps the pieces it owns, obeys commands."""
    torch.set_num_threads(1)  # as in the worker actors
    state = make_state(mb, device=device)
    pieces = owned_pieces(state, rank, WORLD)
    nbytes = sum(p.nbytes for p in pieces)
    store = CheckpointStore(uri, options)
    writer = ShardWriter(store, rank)
    model_floats = sum(t.numel() for k, t in state.items() if k.startswith("model/"))
    del state
    layers = max(1, round(model_floats / (1024 * 1024 + 1024)))
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)])
    x = torch.randn(32, 1024)

    def fwd_bwd() -> float:  # the next step's compute, as a real model of this size
        t0 = time.perf_counter()
        net(x).square().mean().backward()
        net.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    while True:
        cmd, step = conn.recv()
        if cmd == "ckpt":
            blocked = writer.begin(step, pieces)
            conn.send((blocked, writer.wait().to_dict()))
        elif cmd == "ckpt_overlap":
            plain = min(fwd_bwd() for _ in range(2))
            blocked = writer.begin(step, pieces, later=lambda _k: True)
            during = fwd_bwd()
            wait = writer.staged()
            conn.send((blocked + wait, writer.wait().to_dict(),
                       {"begin": blocked, "wait": wait, "plain": plain, "during": during}))
        elif cmd == "ckpt_deferred":  # as a job copies (fused CRCs), nothing computing beside
            blocked = writer.begin(step, pieces, later=lambda _k: True)
            wait = writer.staged()
            conn.send((blocked + wait, writer.wait().to_dict()))
        elif cmd == "committed":
            writer.committed(step)
            conn.send(None)
        elif cmd == "raw":  # the same bytes, same block size, no checksum, no index
            buf = memoryview(writer._staging.numpy())  # type: ignore[union-attr]
            path = store.path(f"raw-{step}-{rank}.bin")
            t0 = time.perf_counter()
            with store.fs.open_output_stream(path) as f:
                for pos in range(0, nbytes, BLOCK):
                    f.write(buf[pos : min(pos + BLOCK, nbytes)])
            conn.send((nbytes, time.perf_counter() - t0))
            store.fs.delete_file(path)
        else:
            writer.close()
            conn.send(None)
            return


class Ranks:
    """WORLD rank processes (spawned, like Ray worker processes) driven over pipes."""

    def __init__(self, mb: int, device: str, uri: str, options: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(WORLD):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, mb, device, uri, options, child))
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def all(self, cmd: str, step: int = 0) -> list[Any]:
        for c in self.conns:
            c.send((cmd, step))
        return [c.recv() for c in self.conns]

    def close(self) -> None:
        self.all("stop")
        for p in self.procs:
            p.join(30)


def bench_backend(
    uri: str,
    options: dict[str, Any],
    state: dict[str, torch.Tensor],
    mb: int,
    device: str,
    repeats: int,
    sync_path: Callable[[int], str],
    overlap: bool = True,
) -> dict[str, float]:
    store = CheckpointStore(uri, options)
    store.check_writable()
    ranks = Ranks(mb, device, uri, options)
    blocked: list[float] = []
    upload_rate: list[float] = []
    raw_rate: list[float] = []
    sync: list[float] = []
    commit_s: list[float] = []
    deferred_rate: list[float] = []  # upload after a deferred copy with fused CRCs
    deferred_copy: list[float] = []  # that copy's seconds (slower rank)
    total = 0
    try:
        for step in range(repeats + 1):
            res = ranks.all("ckpt", step)
            infos = [ShardInfo.from_dict(d) for _, d in res]
            t0 = time.perf_counter()
            commit(store, step, infos)
            commit_s.append(time.perf_counter() - t0)
            if step == 0:  # correctness: the committed checkpoint reads back bit-exact
                back = load(store, step)
                assert all(torch.equal(back[k], v.cpu()) for k, v in state.items()), "mismatch"
                del back
            ranks.all("committed", step)
            total = sum(i.size for i in infos)
            blocked.append(max(b for b, _ in res))
            upload_rate.append(total / max(i.seconds for i in infos))
            apply_retention(store, keep_last=1)

            raw = ranks.all("raw", step)
            raw_rate.append(sum(n for n, _ in raw) / max(t for _, t in raw))

            # the same checkpoint as a job takes it (deferred copy, CRCs fused into it), alone
            res = ranks.all("ckpt_deferred", 1000 + step)
            infos = [ShardInfo.from_dict(d) for _, d in res]
            commit(store, 1000 + step, infos)
            ranks.all("committed", 1000 + step)
            apply_retention(store, keep_last=1)
            deferred_rate.append(sum(i.size for i in infos) / max(i.seconds for i in infos))
            deferred_copy.append(max(i.copy_seconds for i in infos))

            # synchronous torch.save of the whole state to the same backend, new file each time
            path = sync_path(step)
            t0 = time.perf_counter()
            if store.kind == "local":
                torch.save(state, path)
            else:
                with store.fs.open_output_stream(path) as f:
                    torch.save(state, f)
            sync.append(time.perf_counter() - t0)
            store.fs.delete_file(path)
    finally:
        ranks.close()
    ranks_over = Ranks(mb, device, uri, options) if overlap and device == "cpu" else None
    over: list[float] = []
    extra: list[float] = []
    over_upload: list[float] = []  # bytes / the slower rank's upload (after the host copy)
    over_e2e: list[float] = []  # bytes / the slower rank's deferred copy + CRCs + upload
    if ranks_over is not None:
        try:
            for step in range(repeats + 1, 2 * repeats + 2):
                res = ranks_over.all("ckpt_overlap", step)
                infos = [ShardInfo.from_dict(d) for _, d, _ in res]
                commit(store, step, infos)
                if step == repeats + 1:
                    back = load(store, step)
                    assert all(torch.equal(back[k], v.cpu()) for k, v in state.items()), \
                        "mismatch (overlapped copy)"
                    del back
                ranks_over.all("committed", step)
                apply_retention(store, keep_last=1)
                over.append(max(b for b, _, _ in res))
                extra.append(max(d["during"] - d["plain"] for _, _, d in res))
                nbytes = sum(i.size for i in infos)
                over_upload.append(nbytes / max(i.seconds for i in infos))
                over_e2e.append(nbytes / max(i.seconds + i.copy_seconds for i in infos))
                print(f"  overlapped step {step}: " + "; ".join(
                    f"begin {d['begin'] * 1e3:.1f} ms wait {d['wait'] * 1e3:.1f} ms, fwd+bwd "
                    f"{d['plain'] * 1e3:.0f} -> {d['during'] * 1e3:.0f} ms" for _, _, d in res),
                    flush=True)
        finally:
            ranks_over.close()
    warm = lambda xs: statistics.median(xs[1:])  # noqa: E731
    return {
        "blocked_overlap_warm": warm(over) if len(over) > 1 else float("nan"),
        "step_extra": warm(extra) if len(extra) > 1 else float("nan"),
        "bytes": total,
        "blocked_cold": blocked[0],
        "blocked_warm": warm(blocked),
        "blocked_max": max(blocked[1:]),
        "sync_save": warm(sync),
        "upload": warm(upload_rate),
        "raw": warm(raw_rate),
        "upload_deferred": warm(deferred_rate),
        "copy_deferred": warm(deferred_copy),
        "upload_overlap": warm(over_upload) if len(over_upload) > 1 else float("nan"),
        "e2e_overlap": warm(over_e2e) if len(over_e2e) > 1 else float("nan"),
        "commit": warm(commit_s),
    }


def bench_ray_train(state: dict[str, torch.Tensor], repeats: int) -> float:
    """Median seconds of torch.save + ray.train.report(checkpoint=...) in a 1-worker
    TorchTrainer with a local storage_path. Starts (and stops) a local Ray cluster."""
    import ray
    from ray.train import Checkpoint, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config: dict[str, Any]) -> None:
        import ray.train

        times = []
        for i in range(config["repeats"] + 1):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                torch.save(config["state"], os.path.join(d, "state.pt"))
                ray.train.report({"i": i, "times": times}, checkpoint=Checkpoint.from_directory(d))
                times.append(time.perf_counter() - t0)
        ray.train.report({"i": -1, "times": times})

    storage = tempfile.mkdtemp(prefix="bench-raytrain-")
    ray.init(address="local", include_dashboard=False, num_cpus=2)
    try:
        trainer = TorchTrainer(
            loop,
            train_loop_config={"state": state, "repeats": repeats},
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(storage_path=storage, name="bench"),
        )
        result = trainer.fit()
        times = result.metrics["times"]
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--backends", nargs="+", default=["local", "s3"])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="where the state lives (cpu or cuda)")
    ap.add_argument(
        "--ray-train",
        action="store_true",
        help="also time ray.train.report(checkpoint=...) (starts a Ray cluster)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)  # as in the worker actors

    server = None
    rows = []
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-", dir="/tmp")
    try:
        for mb in args.sizes_mb:
            state = make_state(mb, device=args.device)
            for backend in args.backends:
                options: dict[str, Any] = {}
                if backend == "local":
                    uri = os.path.join(tmp, "ckpt")
                    sync_path = lambda s: os.path.join(tmp, f"sync-{s}.pt")  # noqa: E731
                else:
                    if server is None:
                        from tests.s3_server import S3Server

                        server = S3Server()
                        server.start()
                        server.new_bucket()
                    options = server.options(request_timeout=60.0, retries=3)
                    uri = server.uri(f"bench-{mb}")
                    bucket = server.bucket
                    sync_path = lambda s, b=bucket: f"{b}/sync-{s}.pt"  # noqa: E731
                r = bench_backend(uri, options, state, mb, args.device, args.repeats, sync_path)
                r.update(
                    size_mb=mb,
                    backend=backend if args.device == "cpu" else f"{backend} ({args.device} state)",
                )
                rows.append(r)
                print(f"done {mb} MB {backend}: {r}", flush=True)
            if args.ray_train:
                rows.append(
                    {
                        "size_mb": mb,
                        "backend": "ray-train-local",
                        "ray_report": bench_ray_train(state, args.repeats),
                    }
                )
            del state
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(rows)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        "| state | backend | sync torch.save (s) | blocked cold (s) | blocked warm (s) "
        "| warm/sync | blocked warm, overlapped (s) | overlapped/sync | fwd+bwd slower by (s) "
        "| upload (MB/s) | raw write (MB/s) | upload/raw | upload after a fused copy (MB/s) "
        "| fused/raw | fused copy + CRC (s) | upload, overlapped (MB/s) | overlapped/raw "
        "| host copy + CRC + upload, overlapped (MB/s) | commit (s) |"
    )
    print(head)
    print("|---" * 19 + "|")
    for r in rows:
        if "ray_report" in r:
            print(f"| {r['size_mb']} MB | Ray Train torch.save + report | {r['ray_report']:.3f} "
                  "| | | | | | | | | | | | | | | | |")
            continue
        print(
            f"| {r['size_mb']} MB | {r['backend']} | {r['sync_save']:.3f} "
            f"| {r['blocked_cold']:.3f} | {r['blocked_warm']:.4f} "
            f"| {r['blocked_warm'] / r['sync_save']:.1%} | {r['blocked_overlap_warm']:.4f} "
            f"| {r['blocked_overlap_warm'] / r['sync_save']:.1%} | {r['step_extra']:.3f} "
            f"| {r['upload'] / 1e6:.0f} "
            f"| {r['raw'] / 1e6:.0f} | {r['upload'] / r['raw']:.0%} "
            f"| {r['upload_deferred'] / 1e6:.0f} | {r['upload_deferred'] / r['raw']:.0%} "
            f"| {r['copy_deferred']:.3f} "
            f"| {r['upload_overlap'] / 1e6:.0f} | {r['upload_overlap'] / r['raw']:.0%} "
            f"| {r['e2e_overlap'] / 1e6:.0f} | {r['commit']:.3f} |"
        )


if __name__ == "__main__":
    main()
