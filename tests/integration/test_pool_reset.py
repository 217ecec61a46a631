"""A pooled worker's ``reset`` when the job ended with a segment still running on the actor's
other thread (the controller gave up on a failure without winding the segment down). Runs a
pooled ``Worker`` in a process of its own (a reset unloads modules and restores the
environment of the process it runs in), without Ray."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from elastic.worker import Worker
    from tests.mp_harness import free_port
    from tests.unit.test_worker_components import _cfg, _spec

    w = Worker(None, 0, False, 1)
    w.assign(_cfg(__import__("pathlib").Path(sys.argv[1])).for_worker(), 0, None)
    w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
    w.restart_fresh(_spec("dp"), None, 0)
    strategy = w.layout.strategy
    train_step, in_step = strategy.train_step, threading.Event()

    def slow_step(x, y):  # a step that outlasts the reset's waits (a hung collective's)
        in_step.set()
        time.sleep(8.0)
        return train_step(x, y)

    strategy.train_step = slow_step
    out = {}
    t = threading.Thread(target=lambda: out.update(run=repr(w.run(0, 10_000))), daemon=True)
    t.start()
    assert in_step.wait(30)
    got = w.reset()
    t.join(30)
    print(json.dumps({"segment_ran": got["segment_ran"], "ended": not t.is_alive()}))
""")


def test_a_reset_while_a_segment_runs_retires_the_worker(tmp_path):
    """The segment still running when the job ended, and still after the reset asked it to
    stop and ended its group: the reset says so (``segment_ran``: the pool's policy retires
    the process). Was: ``ok`` true, the worker kept warm while its other thread still ran the
    old job's step (its later error then blamed on the next job, or one of the actor's two
    threads held). A segment that ends when asked (a peer's failure ended it) is no reason:
    `tests/integration/test_pool.py::test_user_error_or_leaked_thread_retires_the_worker`."""
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=str(__import__("pathlib").Path(
                           __file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["segment_ran"] is True, got
    assert got["ended"], got


_LEFT = textwrap.dedent("""
    import json, sys
    import elastic.worker.actor as actor
    from elastic.worker import Worker
    from tests.unit.test_worker_components import _cfg

    real = actor.reset_process
    def left(base, **kw):  # as a GPU job that kept 3 GiB alive would leave it
        out = real(base, **kw)
        return {**out, "cuda_bytes": base.cuda_bytes + 3 * 2**30}
    actor.reset_process = left
    w = Worker(None, 0, False, 1)
    w.assign(_cfg(__import__("pathlib").Path(sys.argv[1])).for_worker(), 0, None)
    got = w.reset()
    print(json.dumps({"cuda_left": got["cuda_left"], "ok": got["ok"]}))
""")


def test_a_reset_reports_the_gpu_memory_a_job_left(tmp_path):
    """A reset reports the GPU memory a job left past the process's own at its start (the
    pool's policy retires it beyond 64 MiB: ``test_pool_policy.py``)."""
    p = subprocess.run([sys.executable, "-c", _LEFT, str(tmp_path)], capture_output=True,
                       text=True, timeout=120, cwd=str(__import__("pathlib").Path(
                           __file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"cuda_left": 3 * 2**30, "ok": True}, got
