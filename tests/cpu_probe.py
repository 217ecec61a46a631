"""Where the suite's time goes: a pytest plugin, off unless asked for
(``pytest -p tests.cpu_probe``).

For each test (setup, call and teardown) it records the wall time and the CPU time the whole
machine spent meanwhile (``/proc/stat``: user, system, irq; not idle, I/O wait or steal), so a
test's *idle* time, wall minus CPU over the cores, is time spent waiting rather than working.
Ray's processes are not pytest's children, so per-process accounting would miss them. Other
load on the machine counts as the test's: read it on a quiet host, and as a comparison
between runs, not an absolute. At the end it prints the tests with the most idle time and,
with ``ELASTIC_CPU_PROBE_OUT=file.json``, writes every row ``[test id, wall s, cpu s]``.
Session 13 read it to find the waits in the slowest tests (two of them were the product's).
It needs one stream of tests (the default): under ``pytest -n 2`` the machine's CPU is both
streams'."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

_ROWS: list[tuple[str, float, float]] = []


def _busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = v[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    cpu, wall = _busy_s(), time.monotonic()
    yield
    _ROWS.append((item.nodeid, time.monotonic() - wall, _busy_s() - cpu))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if getattr(terminalreporter.config.option, "numprocesses", None):
        terminalreporter.write_line("cpu probe: off with pytest -n N (both streams share the "
                                    "CPU); run pytest -p tests.cpu_probe")
        return
    if not _ROWS:
        return
    cores = os.cpu_count() or 1
    wall = sum(r[1] for r in _ROWS)
    cpu = sum(r[2] for r in _ROWS)
    tr = terminalreporter
    tr.section("cpu probe")
    tr.write_line(f"{wall:.0f} s of tests, {cpu:.0f} s of CPU on {cores} cores: "
                  f"{cpu / max(wall * cores, 1e-9):.0%} busy")
    tr.write_line("most idle (wall - cpu/cores), wall, test:")
    for name, w, c in sorted(_ROWS, key=lambda r: -(r[1] - r[2] / cores))[:15]:
        tr.write_line(f"{w - c / cores:7.1f} {w:7.1f}  {name}")
    out = os.environ.get("ELASTIC_CPU_PROBE_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(_ROWS, f)
