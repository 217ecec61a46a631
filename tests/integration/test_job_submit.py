"""`ray job submit ... -- elastic run job.yaml` end to end, on a real head with the dashboard and
Ray's token authentication on (see docs/ray-jobs.md).

The head is started with `ray start --head` in its own session, with a private RAY_TMPDIR, its
own ports and a random token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN, nothing written to
~/.ray). It is not stopped with `ray stop` (that kills every Ray process of the user on the
machine): the teardown kills exactly the processes of this head (its session, anything whose
command line names its temp dir, and their descendants: workers, job supervisors, drivers).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from tests.mp_harness import free_port

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")
ELASTIC = os.path.join(BIN, "elastic")

JOB = """\
model: elastic.models:tiny_mlp
optimizer: {name: adam, lr: 0.01}
loss: elastic.models:mlp_loss
dataset: elastic.models:SyntheticRegression
global_batch_size: 16
max_steps: 5
num_workers: 2
view: plain
"""


# ---------------------------------------------------------------------------- processes


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, session id, command line) of every process we can read."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(d)] = (int(fields[1]), int(fields[3]), cmd)
    return out


def _ours(sid: int, marker: str) -> set[int]:
    """The head's processes: its session, anything naming its temp dir, and all descendants
    (job drivers run in sessions of their own, under the job supervisor actor)."""
    procs = _procs()
    mine = {p for p, (_, s, cmd) in procs.items() if s == sid or marker in cmd}
    mine.discard(os.getpid())
    grew = True
    while grew:
        kids = {p for p, (pp, _, _) in procs.items() if pp in mine and p != os.getpid()}
        grew = not kids <= mine
        mine |= kids
    return mine


def _kill_head(sid: int, marker: str) -> list[int]:
    """SIGTERM the head's processes, then SIGKILL what is left after 3 s; returns survivors."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        pids = _ours(sid, marker)
        for p in pids:
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(_ours(sid, marker)):
            time.sleep(0.2)
    return sorted(_alive(_ours(sid, marker)))


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":  # zombies are gone already
                    out.add(p)
        except OSError:
            pass
    return out


# ---------------------------------------------------------------------------- the head


class Head:
    def __init__(self, tmp: str, env: dict[str, str], gcs_port: int, dash_port: int) -> None:
        self.tmp, self.env = tmp, env
        self.gcs = f"127.0.0.1:{gcs_port}"
        self.api = f"http://127.0.0.1:{dash_port}"
        self.sid = 0
        self.last_answer = ""

    def run(self, *args: str, timeout: float = 180, env: dict[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=env or self.env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)

    def ray_job(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return self.run(RAY, "job", args[0], "--address", self.api, *args[1:], timeout=timeout)

    def rest(self, path: str, timeout: float = 30) -> Any:
        """GET the Jobs REST API at ``path`` with the token as a bearer header."""
        import requests

        return requests.get(f"{self.api}/api/jobs/{path}", timeout=timeout,
                            headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})

    def job_status(self, job_id: str) -> str:
        """The job's status (`ray job status` words terminal states differently)."""
        r = self.rest(job_id)
        r.raise_for_status()
        return str(r.json()["status"])

    def jobs_api_up(self) -> bool:
        """Whether the Jobs API lists jobs (what `ray job list` asks, without a process);
        ``self.last_answer`` says what it answered last."""
        import requests

        try:
            r = self.rest("", timeout=10)
        except requests.RequestException as e:
            self.last_answer = repr(e)
            return False
        self.last_answer = f"{r.status_code} {r.text[:500]}"
        return r.status_code == 200

    def job_logs(self, job_id: str) -> str:
        r = self.rest(f"{job_id}/logs")
        r.raise_for_status()
        return str(r.json()["logs"])

    def wait_terminal(self, job_id: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.job_status(job_id)
            if st in ("SUCCEEDED", "FAILED", "STOPPED"):
                return st
            time.sleep(0.25)
        raise AssertionError(f"job {job_id} did not end within {timeout}s (last: {st})")


@pytest.fixture(scope="module")
def ray_head():
    from ray._private.utils import get_dashboard_dependency_error

    if get_dashboard_dependency_error() is not None:
        pytest.skip(f"the Jobs API needs the dashboard: pip install 'ray[default]' "
                    f"({get_dashboard_dependency_error()})")
    tmp = tempfile.mkdtemp(prefix="rj-", dir="/tmp")  # short: Ray's socket paths live in it
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_API_SERVER_ADDRESS")}
    # RAY_JOB_STOP_WAIT_TIME_S: how long `ray job stop` lets a driver end after SIGTERM
    # before SIGKILL (Ray's default, 3 s, is short of a final checkpoint: docs/ray-jobs.md)
    env.update(RAY_TMPDIR=tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_JOB_STOP_WAIT_TIME_S="60",
               PATH=BIN + os.pathsep + env.get("PATH", ""), PYTHONUNBUFFERED="1")
    gcs, dash, client, agent = (free_port() for _ in range(4))  # below the ephemeral range
    head = Head(tmp, env, gcs, dash)
    start = subprocess.Popen(
        [RAY, "start", "--head", f"--port={gcs}", "--num-cpus=3", "--include-dashboard=true",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
         "--node-ip-address=127.0.0.1", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--temp-dir={tmp}"],
        env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # every process of the head shares this session id
    )
    head.sid = start.pid
    try:
        out, _ = start.communicate(timeout=120)
        assert start.returncode == 0, out
        # the Jobs API answers once the dashboard and the head's agent are up
        deadline = time.monotonic() + 90
        while not head.jobs_api_up():
            assert time.monotonic() < deadline, f"no Jobs API in 90 s: {head.last_answer}"
            time.sleep(0.25)
        yield head
    finally:
        _end_head(start, head.sid, tmp, "the test's Ray head")


def _end_head(starter: subprocess.Popen, sid: int, tmp: str, what: str) -> None:
    """End a head the test started (``starter``'s session ``sid``, temp dir ``tmp``): its
    processes, then its temp dir; fails naming ``what`` if any process survived."""
    if starter.poll() is None:
        starter.kill()
    left = _kill_head(sid, tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    assert not left, f"processes of {what} survived: {left}"


def _workdir(tmp_path, name: str, extra: str = "") -> str:
    """A working directory with ``JOB`` as its job file, the settings of ``extra`` in place
    of its own (a key given twice is refused)."""
    wd = tmp_path / name
    wd.mkdir()
    given = {line.split(":")[0] for line in extra.splitlines()}
    base = "".join(f"{line}\n" for line in JOB.splitlines() if line.split(":")[0] not in given)
    (wd / "job.yaml").write_text(base + extra)
    return str(wd)


def _submitted_id(text: str) -> str:
    m = re.search(r"Job '([^']+)' submitted successfully", text)
    assert m, text
    return m.group(1)


# ---------------------------------------------------------------------------- tests


def test_the_cluster_refuses_a_wrong_token(ray_head):
    bad = dict(ray_head.env, RAY_AUTH_TOKEN="0" * 64)
    out = ray_head.run(RAY, "job", "list", "--address", ray_head.api, env=bad, timeout=60)
    assert out.returncode != 0
    assert "Invalid authentication token" in out.stdout + out.stderr


def test_ray_job_submit_runs_elastic_to_the_end(ray_head, tmp_path):
    run_dir = tmp_path / "runs" / "js-ok"
    wd = _workdir(tmp_path, "ok", f"name: js-ok\nrun_dir: {run_dir}\n")
    out = ray_head.run(RAY, "job", "submit", "--address", ray_head.api, "--working-dir", wd,
                       "--", "elastic", "run", "job.yaml", cwd=str(tmp_path))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    job_id = _submitted_id(text)
    assert "[elastic] step 5/5 loss" in text and "succeeded" in text
    logs = ray_head.ray_job("logs", job_id, timeout=60)
    assert logs.returncode == 0, logs.stderr
    for line in ("[elastic] job js-ok: 5 steps", "[elastic] placed at step 0: 2 workers",
                 "[elastic] step 1/5 loss", "[elastic] step 5/5 loss",
                 "[elastic] finished at step 5", "[elastic] done: 5 steps"):
        assert line in logs.stdout, (line, logs.stdout)
    assert ray_head.job_status(job_id) == "SUCCEEDED"
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5


def _wait_logged(head: Head, job_id: str, line: str, timeout: float = 120) -> None:
    """Until the job's driver has logged ``line`` (training, not starting)."""
    deadline = time.monotonic() + timeout
    while line not in head.job_logs(job_id):
        assert head.job_status(job_id) in ("PENDING", "RUNNING"), head.job_logs(job_id)
        assert time.monotonic() < deadline, head.job_logs(job_id)
        time.sleep(0.25)


def test_no_wait_job_is_reached_by_elastic_status_and_stopped(ray_head, tmp_path):
    wd = _workdir(tmp_path, "long", f"run_dir: {tmp_path / 'runs' / 'js-long'}\n")
    out = ray_head.run(RAY, "job", "submit", "--address", ray_head.api, "--no-wait",
                       "--working-dir", wd, "--", "elastic", "run", "job.yaml",
                       "--set", "name=js-long", "--set", "max_steps=1000000",
                       "--set", "log_every=100")
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = _submitted_id(out.stdout + out.stderr)
    _wait_logged(ray_head, job_id, "[elastic] step 100/")
    st = ray_head.run(ELASTIC, "status", "js-long", "--address", ray_head.gcs, timeout=60)
    assert st.returncode == 0, st.stdout + st.stderr
    assert '"state": "running"' in st.stdout and '"max_steps": 1000000' in st.stdout
    assert int(re.search(r'"step": (\d+)', st.stdout).group(1)) >= 100
    stop = ray_head.run(ELASTIC, "stop", "js-long", "--address", ray_head.gcs, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert '"result": "stopped"' in stop.stdout
    # a job stopped through elastic ends cleanly: the driver exits 0, Ray says SUCCEEDED
    assert ray_head.wait_terminal(job_id) == "SUCCEEDED"
    logs = ray_head.job_logs(job_id)
    assert re.search(r"\[elastic\] stopped at step \d+: stopped on request", logs), logs
    assert "[elastic] done:" in logs


def test_ray_job_stop_ends_the_job_at_a_boundary_with_a_final_checkpoint(ray_head, tmp_path):
    """`ray job stop` sends SIGTERM: the driver stops the job at the next step boundary, takes
    a final checkpoint, writes an `interrupted` event and exits 143 (128 + SIGTERM)."""
    from elastic.checkpoint import CheckpointStore, committed_steps

    run_dir = tmp_path / "runs" / "js-term"
    wd = _workdir(tmp_path, "term", f"run_dir: {run_dir}\nname: js-term\n"
                  "max_steps: 1000000\nlog_every: 100\ncheckpoint_every: 1000000\n")
    out = ray_head.run(RAY, "job", "submit", "--address", ray_head.api, "--no-wait",
                       "--working-dir", wd, "--", "elastic", "run", "job.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = _submitted_id(out.stdout + out.stderr)
    _wait_logged(ray_head, job_id, "[elastic] step 100/")
    stop = ray_head.ray_job("stop", job_id, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert ray_head.wait_terminal(job_id) == "STOPPED"
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert "interrupted" in kinds and "SIGTERM" in events[kinds.index("interrupted")]["message"]
    stopped_at = max(json.loads(x)["step"] for x in
                     (run_dir / "metrics.jsonl").read_text().splitlines()) + 1
    steps = committed_steps(CheckpointStore(str(run_dir / "checkpoints")))
    assert steps == [stopped_at], (steps, stopped_at, kinds)
    logs = ray_head.job_logs(job_id)
    assert "interrupted by SIGTERM" in logs, logs


def test_a_bad_job_file_fails_the_ray_job_with_the_clear_error(ray_head, tmp_path):
    wd = _workdir(tmp_path, "bad", "bogus_field: 1\n")
    out = ray_head.run(RAY, "job", "submit", "--address", ray_head.api, "--working-dir", wd,
                       "--", "elastic", "run", "job.yaml")
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    job_id = _submitted_id(text)
    assert ray_head.job_status(job_id) == "FAILED"
    logs = ray_head.job_logs(job_id)
    assert "elastic: error: bogus_field: is not a job setting. Fix: use one of:" in logs, logs
    assert "Traceback" not in logs


def test_a_driver_without_the_token_is_told_so_at_once(ray_head):
    """`elastic status` against a token-protected cluster without the token, or with a wrong
    one: one clear error naming the fix within seconds (Ray itself retries ~20 s and then says
    only that it could not connect)."""
    no_token = {k: v for k, v in ray_head.env.items()
                if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    t0 = time.monotonic()
    out = ray_head.run(ELASTIC, "status", "--address", ray_head.gcs, env=no_token, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode != 0 and "RAY_AUTH_MODE=token" in out.stderr, out.stderr
    assert "refused this driver" in out.stderr and took < 15, (took, out.stderr)
    wrong = dict(ray_head.env, RAY_AUTH_TOKEN="0" * 64)
    t0 = time.monotonic()
    out = ray_head.run(ELASTIC, "status", "--address", ray_head.gcs, env=wrong, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode != 0 and "rejected this driver's token" in out.stderr, out.stderr
    assert "set RAY_AUTH_TOKEN to the cluster's token" in out.stderr and took < 15, took
    ok = ray_head.run(ELASTIC, "status", "--address", ray_head.gcs, timeout=120)
    assert ok.returncode == 0 and "no elastic job is running" in ok.stdout, ok.stderr
