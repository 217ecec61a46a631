"""The suite's clean-up of what a killed test cluster left behind
(``tests/ray_fixtures.py::_end_orphans``), on a real orphan: a process adopted by init."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest


def _orphan(path: str) -> int:
    """Start a process that opens ``path``, is adopted by init (its parent exits at once)
    and sleeps; returns its pid."""
    code = ("import os, sys, time\n"
            "if os.fork(): os._exit(0)\n"
            f"f = open({path!r}, 'w'); print(os.getpid(), flush=True)\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    assert p.stdout is not None
    pid = int(p.stdout.readline())  # (the orphan keeps the pipe open: no EOF to wait for)
    p.stdout.close()
    p.wait(timeout=30)
    return pid


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_orphan_holding_a_file_of_the_session_is_ended_and_no_other(tmp_path):
    """Known by an open file in the cluster's session directory (a runtime-env agent's
    environment and command line read empty once Ray's setproctitle wrote over them); an
    orphan holding a file elsewhere is left alone."""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs Linux's /proc")
    from tests.ray_fixtures import _end_orphans

    session = tmp_path / "session_1"
    session.mkdir()
    ours = _orphan(str(session / "agent.log"))
    other = _orphan(str(tmp_path / "elsewhere.log"))
    try:
        if _ppid(ours) != 1:
            pytest.skip("orphans are adopted by a subreaper here, not by init")
        _end_orphans(set(), set(), str(session))
        deadline = time.monotonic() + 5
        while _alive(ours) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(ours)
        assert _alive(other)
        _end_orphans(set(), set(), str(tmp_path / "session"))  # a prefix is not the folder
        assert _alive(other)
    finally:
        for pid in (ours, other):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
