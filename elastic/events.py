"""Events and the run directory's logs (JSONL), written by the controller only."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Event", "RunLog", "strict"]


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, inf) replaced by None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict(v) for v in obj]
    return obj


@dataclass
class Event:
    """Something that happened to a job: kind, human message, step, wall time, details."""

    kind: str
    message: str
    step: int | None = None
    time: float = field(default_factory=time.time)
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunLog:
    """Appends metrics, events and the data log of a run as JSON lines under ``run_dir``.

    Files: ``metrics.jsonl`` (one line per completed step), ``events.jsonl``,
    ``data_log.jsonl`` (which rank trained which sample range of which step),
    ``config.json``. Owned by one controller; not thread-safe.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._files = {
            name: open(os.path.join(run_dir, f"{name}.jsonl"), "a", buffering=1)
            for name in ("metrics", "events", "data_log")
        }

    def write_config(self, config: dict[str, Any]) -> None:
        with open(os.path.join(self.run_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2, default=str)

    def metric(self, entry: dict[str, Any]) -> None:
        self._write("metrics", entry)

    def event(self, ev: Event) -> None:
        self._write("events", ev.to_dict())

    def data(self, entry: dict[str, Any]) -> None:
        self._write("data_log", entry)

    def _write(self, name: str, obj: dict[str, Any]) -> None:
        """One strict JSON line: NaN and inf become null (``json.loads`` in any language
        reads the files)."""
        self._files[name].write(json.dumps(strict(obj), default=str, allow_nan=False) + "\n")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
