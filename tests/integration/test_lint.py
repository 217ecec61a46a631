"""Lint and types as tests, so that CI (README's test command) runs them: ruff over the
repository (rules in pyproject.toml) and mypy over the three packages.

mypy takes about 35 s of one core on the 2-core CI machine, while the unit layer, which runs
first, keeps about one core busy. So when this test is selected, ``tests/conftest.py`` starts
mypy as soon as collection ends, at a low priority, and the test collects its result: the
suite is that much shorter (measured: 36.6 s of mypy, 16.6 s of it with a core idle)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STARTED: dict[str, subprocess.Popen[str]] = {}


def _start(*args: str, nice: int = 0) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if nice:
        try:  # (mypy's own start-up runs at the normal priority for a few ms)
            os.setpriority(os.PRIO_PROCESS, p.pid, nice)
        except (OSError, AttributeError):  # not permitted, or not POSIX: run as it is
            pass
    return p


def start_early() -> None:
    """Start mypy now (``pytest_collection_finish``), niced, for ``test_clean`` to collect."""
    if "mypy" not in _STARTED:
        _STARTED["mypy"] = _start("mypy", nice=10)


def stop_early() -> None:
    """End a mypy started early that no test collected (an interrupted or filtered run)."""
    for p in _STARTED.values():
        if p.poll() is None:
            p.kill()
        p.communicate()
    _STARTED.clear()


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_clean(tool: str) -> None:
    p = _STARTED.pop(tool, None) or _start(*(("ruff", "check", ".") if tool == "ruff"
                                             else ("mypy",)))
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, f"{tool} found problems:\n{out[-4000:]}{err[-2000:]}"
