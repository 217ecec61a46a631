"""The search space: one ``Param`` per searched job field, and how a value lands in the job.

A parameter's name is a job field, dotted for nested settings (``optimizer.lr``,
``model.width``); ``set_path`` writes a sampled value there without changing the base job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import optuna

__all__ = ["Param", "PARAM_KEYS", "set_path", "read_number"]

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
            if not math.isfinite(x):  # (nan, inf: Optuna's error in the first trial)
                raise ConfigError(f"{where}.{key}", f"{v!r} is not a finite number.",
                                  "write a number, e.g. 1.0e-4")
            if kind == "int" and x != int(x):
                raise ConfigError(f"{where}.{key}", f"{v!r} is not an integer.",
                                  "use whole numbers, or type: float")
            vals[key] = int(x) if kind == "int" else x
        if vals.get("step", 1) <= 0:  # (was: Optuna's ValueError in the first trial, after
            # Ray started; an int's 0 became step 1)
            raise ConfigError(f"{where}.step", f"must be > 0, got {spec['step']!r}.",
                              "give a positive step, or drop it")
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

    def check_value(self, value: Any, where: str) -> Any:
        """``value`` (an ``enqueue`` point's) as the trial will get it, if it is in this
        dimension's space; a number written as a string (YAML's ``1e-3``) is read as one.
        ``ConfigError`` naming ``where`` otherwise (Optuna refuses a choice outside the list
        in the trial, and runs a number outside the range as it is)."""
        if self.type == "categorical":
            if value not in self.choices:
                raise ConfigError(where, f"{value!r} is not one of the choices of params."
                                  f"{self.name}.", f"use one of: {', '.join(map(str, self.choices))}")
            return value
        x = read_number(value)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ConfigError(where, f"{value!r} is not a number; params.{self.name} is a "
                              f"{self.type} parameter.", f"give a number in [{self.low}, "
                              f"{self.high}]")
        if self.type == "int" and x != int(x):
            raise ConfigError(where, f"{value!r} is not an integer; params.{self.name} is an "
                              "int parameter.", "give a whole number")
        x = int(x) if self.type == "int" else float(x)
        off = (x - self.low) / self.step if self.step else 0.0  # (Optuna's own tolerance)
        if not self.low <= x <= self.high or abs(off - round(off)) > 1e-8:
            grid = f" on the grid of step {self.step} from {self.low}" if self.step else ""
            raise ConfigError(where, f"{value!r} is outside params.{self.name}: "
                              f"[{self.low}, {self.high}]{grid}.",
                              "give a value in the searched space, or widen the space")
        return x

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


def read_number(value: Any) -> Any:
    """``value``, or the float a string spells (YAML reads ``1e-3``, without a dot, as one)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


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
