"""The search space: one ``Param`` per searched job field, and how a value lands in the job.

A parameter's name is a job field, dotted for nested settings (``optimizer.lr``,
``model.width``); ``set_path`` writes a sampled value there without changing the base job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import optuna

__all__ = ["Param", "PARAM_KEYS", "set_path"]

PARAM_KEYS = {"float": ("low", "high", "log", "step"), "int": ("low", "high", "log", "step"),
              "categorical": ("choices",)}


@dataclass(frozen=True)
class Param:
    """One search dimension. ``name`` is a job field, dotted for nested settings
    (``optimizer.lr``, ``model.width``)."""

    name: str
    type: str
    low: float = 0.0  # float and int
    high: float = 0.0
    log: bool = False
    step: float | None = None
    choices: tuple[Any, ...] = ()

    @classmethod
    def parse(cls, name: str, spec: Any) -> Param:
        """A Param from its sweep-file mapping; ``ConfigError`` naming ``params.<name>...``
        for anything Optuna would not take."""
        where = f"params.{name}"
        if not isinstance(spec, dict) or "type" not in spec:
            raise ConfigError(where, f"must be a mapping with a type, got {spec!r}.",
                              "e.g. {type: float, low: 1.0e-4, high: 0.1, log: true}")
        kind = spec["type"]
        if kind not in PARAM_KEYS:
            raise ConfigError(f"{where}.type", f"unknown parameter type {kind!r}.",
                              f"use one of: {', '.join(PARAM_KEYS)}")
        unknown = sorted(set(spec) - {"type", *PARAM_KEYS[kind]})
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}", f"is not a setting of a {kind} parameter.",
                              f"use: {', '.join(PARAM_KEYS[kind])}")
        if kind == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise ConfigError(f"{where}.choices", "must be a non-empty list.",
                                  "e.g. choices: [dp, zero1]")
            bad = [c for c in choices if not isinstance(c, (str, int, float, bool, type(None)))]
            if bad:
                raise ConfigError(f"{where}.choices", f"{bad[0]!r} is not a scalar; Optuna "
                                  "stores only None, bool, int, float and str choices.",
                                  "search a scalar (e.g. optimizer.name) instead of a mapping")
            return cls(name, kind, choices=tuple(choices))
        vals: dict[str, Any] = {}
        for key in ("low", "high", "step"):
            v = spec.get(key)
            if v is None:
                if key != "step":
                    raise ConfigError(f"{where}.{key}", "is required.", f"add {key}: <number>")
                continue
            try:  # YAML reads 1e-4 (no dot) as a string: accept it
                x = float(v)
            except (TypeError, ValueError):
                raise ConfigError(f"{where}.{key}", f"{v!r} is not a number.",
                                  "write a number, e.g. 1.0e-4") from None
            if kind == "int" and x != int(x):
                raise ConfigError(f"{where}.{key}", f"{v!r} is not an integer.",
                                  "use whole numbers, or type: float")
            vals[key] = int(x) if kind == "int" else x
        if vals["low"] > vals["high"]:
            raise ConfigError(where, f"low {vals['low']} is above high {vals['high']}.",
                              "swap them")
        log = bool(spec.get("log", False))
        if log and vals["low"] <= 0:
            raise ConfigError(f"{where}.low", "must be > 0 with log: true.", "use a positive low")
        if log and "step" in vals:
            raise ConfigError(f"{where}.step", "cannot be combined with log: true.",
                              "drop step or log")
        return cls(name, kind, vals["low"], vals["high"], log, vals.get("step"))

    def suggest(self, trial: optuna.Trial) -> Any:
        """Ask ``trial`` for this dimension's value."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high),
                                     step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def probes(self) -> list[Any]:
        """Values that stand for the whole range when the base job is validated up front:
        every choice, or both ends of a range."""
        return list(self.choices) if self.type == "categorical" else [self.low, self.high]

    def grid(self) -> list[Any]:
        """Every value, for the grid sampler; ``ConfigError`` for a continuous range."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int" and not self.log:
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        if self.type == "float" and self.step and not self.log:
            n = int(round((self.high - self.low) / self.step))
            return [self.low + i * self.step for i in range(n + 1)]
        raise ConfigError(f"params.{self.name}", "the grid sampler needs a finite set of values.",
                          "make it categorical, a non-log int, or a float with a step; or use "
                          "sampler: tpe/random")


def set_path(fields: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a job-field dict, copying each mapping it changes. A string at
    ``optimizer`` becomes {name: ...}; an import string elsewhere becomes {target: ...}, so
    its factory gets the keyword."""
    parts = dotted.split(".")
    node = fields
    for depth, key in enumerate(parts[:-1]):
        cur = node.get(key)
        if cur is None:
            cur = {}
        elif isinstance(cur, str):
            cur = {"name": cur} if depth == 0 and key == "optimizer" and ":" not in cur else {
                "target": cur}
        elif not isinstance(cur, dict):
            raise ConfigError(f"params.{dotted}", f"{'.'.join(parts[:depth + 1])} holds a "
                              f"{type(cur).__name__}, whose settings cannot be searched.",
                              "give it as {target: 'module:factory', ...} in base")
        else:
            cur = dict(cur)
        node[key] = cur
        node = cur
    node[parts[-1]] = value
