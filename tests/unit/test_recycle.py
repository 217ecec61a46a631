"""elastic.worker.recycle: what a pooled worker's reset undoes of a job in its process (no
Ray, no process group: the integration test checks it inside real workers)."""

from __future__ import annotations

import os
import sys
import threading

import torch

from elastic.worker.recycle import Baseline, reset, user_modules


def test_reset_unloads_job_modules_and_restores_env_and_torch(tmp_path, monkeypatch):
    (tmp_path / "job_code_xyz.py").write_text("COUNT = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    os.environ["ELASTIC_RECYCLE_KEEP"] = "base"
    os.environ["ELASTIC_RECYCLE_GONE"] = "there"
    sys.modules.pop("colorsys", None)
    base = Baseline.take()
    try:
        import colorsys  # noqa: F401 - a library the job imports: new, and kept

        import job_code_xyz  # noqa: F401 - the job's code

        assert "job_code_xyz" in user_modules(base)
        assert "colorsys" not in user_modules(base) and "colorsys" not in base.modules
        os.environ["ELASTIC_RECYCLE_NEW"] = "1"
        os.environ["ELASTIC_RECYCLE_KEEP"] = "changed"
        del os.environ["ELASTIC_RECYCLE_GONE"]
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(max(1, base.num_threads + 1))
        out = reset(base, freeze=False)
        assert "job_code_xyz" in out["modules_dropped"] and "job_code_xyz" not in sys.modules
        assert "colorsys" in sys.modules
        assert "ELASTIC_RECYCLE_NEW" not in os.environ
        assert os.environ["ELASTIC_RECYCLE_KEEP"] == "base"
        assert os.environ["ELASTIC_RECYCLE_GONE"] == "there"
        assert out["env_restored"] == 3
        assert torch.get_default_dtype() == base.dtype == torch.float32
        assert torch.get_num_threads() == base.num_threads
        assert out["threads"] == 0
    finally:
        torch.set_default_dtype(torch.float32)
        os.environ.pop("ELASTIC_RECYCLE_KEEP", None)
        os.environ.pop("ELASTIC_RECYCLE_GONE", None)


def test_reset_restores_the_import_path_a_job_changed(tmp_path):
    """Job A puts its directory first on ``sys.path``; job B's factory imports a module of
    the same name from its own: after the reset B's import must not find A's file. Was: the
    path was not restored, and B trained A's model (found by review)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model_xyz_recycle.py").write_text("WHO = 'a'\n")
    base = Baseline.take()
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(tmp_path / "a"))
        import model_xyz_recycle  # noqa: F401 - job A's code

        out = reset(base, freeze=False)
        assert out["path_restored"] and str(tmp_path / "a") not in sys.path
        assert tuple(sys.path) == base.path and "model_xyz_recycle" not in sys.modules
        assert reset(base, freeze=False)["path_restored"] is False
    finally:
        sys.path[:] = saved


def test_reset_restores_the_numerics_switches_a_job_flipped():
    """cuDNN autotuning and the attention kernels are process-wide: a job that set
    ``cudnn.benchmark`` would have the next job on the process run other arithmetic than a
    fresh worker's. The switches exist (and are checked here) on a CPU build too."""
    base = Baseline.take()
    try:
        torch.backends.cudnn.benchmark = not base.backends["cudnn.benchmark"]
        torch.backends.cuda.enable_math_sdp(not base.backends["math_sdp"])
        out = reset(base, freeze=False)
        assert out["backends_restored"] == 2 and out["precision_changed"] == []
        assert torch.backends.cudnn.benchmark == base.backends["cudnn.benchmark"]
        assert torch.backends.cuda.math_sdp_enabled() == base.backends["math_sdp"]
    finally:
        torch.backends.cudnn.benchmark = base.backends["cudnn.benchmark"]
        torch.backends.cuda.enable_math_sdp(base.backends["math_sdp"])


def test_a_job_that_changed_float32_precision_is_named_for_retirement():
    """``set_float32_matmul_precision("high")`` (TF32, and bf16 matmuls on CPU) or
    ``allow_tf32`` cannot be undone in place (torch raises on reading one precision API after
    the other was written): reset names them and the worker says not ok, so the pool retires
    it. In a fresh process: the setting is process-wide."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from elastic.worker.recycle import Baseline, reset\n"
        "base = Baseline.take()\n"
        "print(reset(base, freeze=False)['precision_changed'])\n"
        "torch.set_float32_matmul_precision('high')\n"
        "print(reset(base, freeze=False)['precision_changed'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.splitlines()[-2:]
    assert before == "[]" and "cuda.matmul.fp32_precision" in after, out.stdout


def test_reset_counts_a_thread_the_job_left_running():
    base = Baseline.take()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="user-thread", daemon=True)
    t.start()
    elastic_own = threading.Thread(target=stop.wait, name="elastic-heartbeat", daemon=True)
    elastic_own.start()
    try:
        out = reset(base, freeze=False)
        assert out["threads"] == 1 and out["thread_names"] == ["user-thread"]
    finally:
        stop.set()
        t.join()
        elastic_own.join()
    assert reset(base, freeze=False)["threads"] == 0


class _Cycle:
    """A job's garbage in a reference cycle (as modules with hooks make), holding a tensor."""

    def __init__(self) -> None:
        self.peer = _Peer(self)
        self.tensor = torch.ones(4)


class _Peer:
    def __init__(self, owner: _Cycle) -> None:
        self.owner = owner


def test_a_small_jobs_reset_collects_its_garbage_without_scanning_the_start_up_heap():
    """The start-up heap (torch's ~320k objects, frozen) is scanned again only when the job's
    own set-up was large enough to be frozen too (``_freeze_job``); a small job's reset
    collects its cycles alone. A garbage cycle frozen at "start-up" tells the two apart: it
    is collected only by a reset that unfreezes."""
    import gc
    import weakref

    from elastic.worker.actor import _FREEZE_JOB_OVER, _freeze_job

    old = _Cycle()
    in_start_up = weakref.ref(old)
    del old
    gc.freeze()  # as the worker does once torch and the layouts are loaded
    try:
        base = Baseline.take()
        job = _Cycle()
        small_job = weakref.ref(job)
        del job
        assert not _freeze_job()  # a few objects: left tracked
        reset(base, freeze=True, unfreeze=False)
        assert small_job() is None and in_start_up() is not None
        # a job whose set-up left many objects (a large library): frozen at assign, and its
        # reset unfreezes to collect them
        bulk = [[i] for i in range(_FREEZE_JOB_OVER + 1)]
        job = _Cycle()
        large_job = weakref.ref(job)
        del job
        assert _freeze_job()
        del bulk
        reset(base, freeze=True, unfreeze=True)
        assert large_job() is None and in_start_up() is None
    finally:
        gc.unfreeze()


def test_a_jobs_per_thread_switches_are_set_back_on_every_thread_of_the_next_job():
    """A worker actor runs calls on two threads; ``reset`` runs on one. A job's code that
    turned grad mode or anomaly detection off or changed the intra-op thread count on the
    other thread: the next job's first call there sets them back (``Baseline.on_thread``).
    Was: left as the job set them on that thread, so the next job's backward failed there
    (blamed as its user error, and the worker retired)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from elastic.worker.recycle import Baseline

    base = Baseline.take()
    seen = {}

    def job_code() -> None:  # job 1, on the actor's other thread
        torch.set_grad_enabled(False)
        torch.set_num_threads(1)

    def next_job_call() -> None:  # job 2's first call on that thread
        base.on_thread(2)
        seen["grad"], seen["threads"] = torch.is_grad_enabled(), torch.get_num_threads()

    def same_job_again() -> None:  # job 2 turning it off itself is its own business
        torch.set_grad_enabled(False)
        base.on_thread(2)
        seen["again"] = torch.is_grad_enabled()

    with ThreadPoolExecutor(1) as other:  # the actor's other thread, kept between calls
        for fn in (job_code, next_job_call, same_job_again):
            other.submit(fn).result()
    assert seen == {"grad": True, "threads": base.num_threads, "again": False}
