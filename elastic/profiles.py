"""A small on-disk cache of measured worker speeds, keyed by (device, emulation, model, batch).

Location: ``$ELASTIC_CACHE_DIR/profiles.json`` (default ``~/.cache/elastic``). Written by the
controller only; a corrupt or unreadable file is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from torch import nn

__all__ = ["ProfileCache"]


class ProfileCache:
    def __init__(self, directory: str | None = None) -> None:
        self.dir = directory or os.environ.get("ELASTIC_CACHE_DIR") or os.path.join(
            os.path.expanduser("~"), ".cache", "elastic")
        self.path = os.path.join(self.dir, "profiles.json")
        try:
            with open(self.path) as f:
                self.data: dict[str, float] = dict(json.load(f))
        except (OSError, ValueError, TypeError):
            self.data = {}

    @staticmethod
    def key(info: dict[str, Any], model: nn.Module, batch: int) -> str:
        emu = info.get("emulation") or {}
        params = sum(p.numel() for p in model.parameters())
        shapes = ",".join(str(tuple(p.shape)) for p in model.parameters())
        digest = hashlib.sha1(shapes.encode()).hexdigest()[:10]
        return (f"{info.get('device_name')}|x{emu.get('slowdown', 1)}|{type(model).__name__}:"
                f"{params}:{digest}|b{batch}|t{info.get('threads')}")

    def get(self, key: str) -> float | None:
        v = self.data.get(key)
        return float(v) if isinstance(v, (int, float)) and v > 0 else None

    def put(self, key: str, samples_per_s: float) -> None:
        self.data[key] = samples_per_s
        try:
            os.makedirs(self.dir, exist_ok=True)
            tmp = self.path + f".{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache, never a reason to fail a job
