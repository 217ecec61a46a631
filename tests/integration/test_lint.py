"""Lint and types as tests, so that CI (README's test command) runs them: ruff over the
repository (rules in pyproject.toml) and mypy over the three packages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("tool", ["ruff", "mypy"])
def test_clean(tool: str) -> None:
    out = _run("ruff", "check", ".") if tool == "ruff" else _run("mypy")
    assert out.returncode == 0, f"{tool} found problems:\n{out.stdout[-4000:]}{out.stderr[-2000:]}"
