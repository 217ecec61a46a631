"""``elastic scheduler start|stop|status`` and ``elastic queue submit|list|watch|cancel``: thin
commands over ``elastic.scheduler`` (which holds the Ray calls)."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any

from .queue_view import shown_state

__all__ = ["add_parsers", "format_queue"]


def _fmt_s(s: Any) -> str:
    if s is None or not isinstance(s, (int, float)) or not math.isfinite(s):
        return "-"
    return f"{s:.0f}s" if s < 600 else f"{s / 60:.0f}min"


def format_queue(rows: list[dict[str, Any]]) -> str:
    """One line per job: state, workers (min..max; * while a resize is under way), steps,
    predicted time left, and why."""
    if not rows:
        return "the queue is empty"
    n = max(16, *(len(str(r["job"])) + 2 for r in rows))  # the names fit their column
    hdr = f"{'job':<{n}}{'state':<11}{'workers':>9}{'steps':>14}{'left':>8}  why"
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        w = f"{r['workers']}{'*' if r.get('resizing') else ''} ({r['min_workers']}..{r['max_workers']})"
        steps = f"{r['step']}/{r['max_steps']}"
        left = _fmt_s(r["remaining_s"]) if r["state"] == "running" else "-"
        why = r.get("error") or r["reason"]
        out.append(f"{r['job']:<{n}}{shown_state(r):<11}{w:>9}{steps:>14}{left:>8}  {why}")
    return "\n".join(out)


_HOOKS: dict[str, Callable[..., Any]] = {}  # the CLI's attach and --set parser


def _cmd(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(a: argparse.Namespace) -> int:
        _check_flags(a)  # before the cluster is reached, or any actor started
        _HOOKS["attach"](a.address)
        return fn(a)

    return run


def _check_flags(a: argparse.Namespace) -> None:
    """``scheduler start``'s and ``queue watch``'s numbers and queue file; ``ConfigError``
    naming the flag (exit code 2). Was: a traceback from the actor or the redraw loop."""
    from .errors import ConfigError

    def number(flag: str, v: Any, *, above: bool, fix: str) -> None:
        if v is not None and not (math.isfinite(v) and (v > 0 if above else v >= 0)):
            raise ConfigError(flag, f"must be {'>' if above else '>='} 0, got {v}.", fix)

    if a.action == "watch":  # (the two commands' actions differ)
        number("--interval", a.interval, above=True, fix="e.g. --interval 1 (seconds)")
    if a.action != "start":
        return
    from .sched_core import check_start

    check_start(a.workers, a.round_s, a.resize_s, a.max_wait_s, a.warm, cli=True)
    for flag in ("cpus", "gpus"):  # (what --workers counts, by another name)
        v = getattr(a, flag)
        if v is not None and v < 1:
            raise ConfigError(f"--{flag}", f"must be 1 or more, got {v}.",
                              f"give the number of workers the scheduler owns, e.g. --{flag} 4")
    if a.db not in (None, "none"):
        path = os.path.abspath(os.path.expanduser(a.db))
        if os.path.isdir(path) or not os.path.isdir(os.path.dirname(path)):
            what = "is a directory" if os.path.isdir(path) else \
                f"is in {os.path.dirname(path)}, which does not exist"
            raise ConfigError("--db", f"{a.db} {what}.", "give a SQLite file (made if missing) in "
                              "an existing directory, or none for a queue in memory")


def _start(a: argparse.Namespace) -> int:
    from . import scheduler

    given = {f"--{k}": v for k, v in (("workers", a.workers), ("cpus", a.cpus),
                                      ("gpus", a.gpus)) if v is not None}
    if len(set(given.values())) > 1:  # (was: --workers won and the others were ignored)
        raise SystemExit(f"elastic scheduler start: {', '.join(f'{k} {v}' for k, v in given.items())}"
                         " disagree; they are one count (the workers it owns, one device "
                         "each): give one of them")
    workers = a.workers or a.gpus or a.cpus
    if not workers:
        raise SystemExit("elastic scheduler start needs --workers, --cpus or --gpus (how many "
                         "workers the scheduler owns)")
    db = None if a.db in (None, "none") else os.path.expanduser(a.db)
    if a.db is None:
        os.makedirs(os.path.expanduser("~/.elastic"), exist_ok=True)
        db = os.path.expanduser(f"~/.elastic/scheduler-{a.name}.sqlite")
    scheduler.start(a.name, workers=int(workers), policy=a.policy, round_s=a.round_s,
                    resize_s=a.resize_s, max_wait_s=a.max_wait_s, db=db, warm=a.warm)
    print(f"[elastic] scheduler {a.name!r} started: {workers} workers, policy {a.policy}, "
          f"queue in {db or 'memory'}" + (f", {a.warm} warm workers" if a.warm else ""))
    return 0


def _stop(a: argparse.Namespace) -> int:
    from . import scheduler

    scheduler.shutdown(a.name)
    print(f"[elastic] scheduler {a.name!r} stopped")
    return 0


def _status(a: argparse.Namespace) -> int:
    from . import scheduler

    print(json.dumps(scheduler.info(a.name), indent=2, default=str))
    return 0


def _submit(a: argparse.Namespace) -> int:
    from . import scheduler
    from .config import JobConfig

    cfg = scheduler.placed(JobConfig.from_yaml(a.job, _HOOKS["parse_sets"](a.set or [])))
    job = scheduler.submit_to(a.name, cfg)
    print(f"[elastic] queued {job.job!r} in scheduler {a.name!r} (run directory "
          f"{cfg.run_path})")
    return 0


def _list(a: argparse.Namespace) -> int:
    from . import scheduler

    rows = scheduler.rows(a.name)
    print(json.dumps(rows, indent=2, default=str) if a.json else format_queue(rows))
    return 0


def _watch(a: argparse.Namespace) -> int:
    from . import scheduler
    from .queue_view import watch

    watch(lambda: (scheduler.rows(a.name), scheduler.info(a.name)), interval_s=a.interval)
    return 0


def _cancel(a: argparse.Namespace) -> int:
    from . import scheduler

    before = scheduler.ScheduledJob(a.name, a.job).cancel()
    if before == "queued":
        print(f"[elastic] cancelled {a.job!r} (it was queued)")
    elif before == "running":
        print(f"[elastic] cancelling {a.job!r}: it stops at its next step boundary, with a "
              "final checkpoint (`elastic queue list` shows it cancelled then)")
    else:  # (was: "cancelled 'qa' (was finished)", rc 0, the job left as it was)
        print(f"[elastic] {a.job!r} had already ended ({before}): nothing to cancel")
        return 1
    return 0


def add_parsers(sub: Any, attach: Callable[[str | None], None],
                parse_sets: Callable[[list[str]], dict[str, Any]]) -> None:
    """Add ``scheduler`` and ``queue`` to the ``elastic`` command's sub-parsers; ``attach``
    connects to the cluster, ``parse_sets`` reads ``--set key=value``."""
    _HOOKS.update(attach=attach, parse_sets=parse_sets)
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--name", default="default", help="the scheduler's name")
        p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or auto)")

    s = sub.add_parser("scheduler", help="start, stop or show a scheduler that shares a "
                       "cluster among many elastic jobs")
    s.add_argument("action", choices=["start", "stop", "status"])
    common(s)
    s.add_argument("--workers", type=int, help="start: workers the scheduler owns")
    s.add_argument("--cpus", type=int, help="start: CPUs it owns (one worker each)")
    s.add_argument("--gpus", type=int, help="start: GPUs it owns (one worker each)")
    s.add_argument("--policy", default="srpt", help="start: fifo-static, srpt or goodput")
    s.add_argument("--round-s", type=float, default=2.0, help="start: seconds between decisions")
    s.add_argument("--resize-s", type=float, default=10.0,
                   help="start: what a resize costs a job (hysteresis)")
    s.add_argument("--max-wait-s", type=float, default=1800.0,
                   help="start: a queued job waiting longer goes first (starvation guard)")
    s.add_argument("--warm", type=int, default=0,
                   help="start: worker processes kept warm between jobs (a pool; 0: none)")
    s.add_argument("--db", help="start: the SQLite file holding the queue (default "
                   "~/.elastic/scheduler-NAME.sqlite; 'none': memory only)")
    s.set_defaults(fn=lambda a: _cmd({"start": _start, "stop": _stop,
                                      "status": _status}[a.action])(a))

    q = sub.add_parser("queue", help="submit a job to a scheduler, list, watch or cancel its "
                       "jobs")
    q.add_argument("action", choices=["submit", "list", "watch", "cancel"])
    q.add_argument("job", nargs="?", help="submit: the job YAML; cancel: the job's name")
    q.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a job setting")
    q.add_argument("--json", action="store_true", help="list: machine-readable output")
    q.add_argument("--interval", type=float, default=1.0, help="watch: seconds between redraws")
    common(q)

    def queue(a: argparse.Namespace) -> int:
        if a.action not in ("list", "watch") and not a.job:
            raise SystemExit(f"elastic queue {a.action} needs a job "
                             f"({'YAML file' if a.action == 'submit' else 'name'})")
        return _cmd({"submit": _submit, "list": _list, "watch": _watch,
                     "cancel": _cancel}[a.action])(a)

    q.set_defaults(fn=queue)
