"""The flat settings a job file and ``fit(...)`` use, and how they map onto the sections.

Two forms are accepted, also mixed in one file, each setting given once:

    checkpoint_every: 50                 # flat: the name of every setting so far
    checkpoints: {every: 50}             # nested: a section and its field

``split`` turns either form into the keyword arguments of each section; an unknown key gets a
"did you mean", a setting given both ways is an error naming both. ``Setting`` is the
descriptor behind ``JobConfig.<flat name>``: it reads (and, on a ``JobConfig``, writes) one
field of one section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Generic, TypeVar, overload

from elastic.errors import ConfigError

from .checkpoints import Checkpoints
from .checks import unknown
from .sections import (
    Data,
    Evaluation,
    Failures,
    Output,
    Parallelism,
    Preemption,
    Scaling,
    Section,
    Training,
)

__all__ = ["SECTIONS", "FLAT", "RENAMED", "Setting", "split", "flatten", "merge"]

SECTIONS: dict[str, type[Section]] = {
    cls.NAME: cls
    for cls in (Training, Data, Evaluation, Scaling, Parallelism, Failures, Preemption, Checkpoints,
                Output)
}
# flat setting name -> (section, field)
FLAT: dict[str, tuple[str, str]] = {
    cls.flat_name(f): (name, f) for name, cls in SECTIONS.items() for f in cls.field_names()
}
# settings of earlier releases: name -> how to say it now
RENAMED = {
    "verify_switch": "use switch_check: pieces (verify_switch: true) or off (verify_switch: "
                     "false); rehash also gathers and hashes the state again",
}

T = TypeVar("T")


class Setting(Generic[T]):
    """``owner.<flat name>``: the field of section ``section`` whose flat name this is.

    Reading returns the section's value. Writing (``JobConfig`` only) replaces the section by a
    copy with the new value, which the section checks (``JobConfig._assign``).
    """

    def __init__(self, section: str) -> None:
        self.section = section
        self.name = ""
        self.field = ""

    def __set_name__(self, owner: type, name: str) -> None:
        section, field = FLAT[name]
        if section != self.section:
            raise TypeError(f"{owner.__name__}.{name} is a field of {section}, not {self.section}")
        self.name, self.field = name, field

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> Setting[T] | T:
        if obj is None:
            return self
        return getattr(getattr(obj, self.section), self.field)  # type: ignore[no-any-return]

    def __set__(self, obj: object, value: T) -> None:
        assign = getattr(obj, "_assign", None)
        if assign is None:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only")
        assign(self.name, value)


def _given(settings: Mapping[Any, Any]) -> tuple[dict[tuple[str, str], tuple[str, Any]],
                                                  dict[str, Section]]:
    """(section, field) -> (how it was written, value), and the sections given whole."""
    values: dict[tuple[str, str], tuple[str, Any]] = {}
    whole: dict[str, Section] = {}

    def put(where: tuple[str, str], how: str, value: Any) -> None:
        if where in values:
            first = values[where][0]
            raise ConfigError(first, f"is also given as {how}.",
                              f"give it once: either {first} or {how}, not both")
        values[where] = (how, value)

    for key, value in settings.items():
        if not isinstance(key, str):
            raise ConfigError(repr(key), "is not a setting name.", "use the names in the docs")
        if key in RENAMED:
            raise ConfigError(key, "was renamed.", RENAMED[key])
        if key in FLAT:
            put(FLAT[key], key, value)
            continue
        cls = SECTIONS.get(key)
        if cls is None:
            raise unknown(key, key, [*FLAT, *SECTIONS], "a job setting")
        if isinstance(value, cls):
            whole[key] = value
            for f in cls.field_names():
                put((key, f), key, getattr(value, f))
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping of its settings, got {value!r}.",
                              f"e.g. {key}: {{{cls.field_names()[0]}: ...}}, or the flat names")
        for k, v in value.items():
            if k not in cls.field_names():
                if FLAT.get(k, ("", ""))[0] == key:
                    raise ConfigError(f"{key}.{k}", f"is not a setting of {key}.",
                                      f"did you mean {FLAT[k][1]}? (the flat name is {k})")
                raise unknown(f"{key}.{k}", str(k), cls.field_names(),
                                     f"a setting of {key}")
            put((key, k), f"{key}.{k}", v)
    return values, whole


def split(settings: Mapping[Any, Any]) -> dict[str, Section | dict[str, Any]]:
    """Per section: the section given whole, or the keyword arguments for building it.
    Raises ``ConfigError`` for an unknown, renamed or twice-given setting and for a missing
    required one (named by its flat name)."""
    values, whole = _given(settings)
    out: dict[str, Section | dict[str, Any]] = {}
    for name, cls in SECTIONS.items():
        if name in whole:  # given whole: a flat key of it would have been a conflict
            out[name] = whole[name]
            continue
        own = {f: v for (s, f), (_, v) in values.items() if s == name}
        for f in cls.required():
            if f not in own:
                raise ConfigError(cls.flat_name(f), "is required.", "add it to the job file")
        out[name] = own
    return out


def flatten(settings: Mapping[Any, Any]) -> dict[str, Any]:
    """The same settings, each under its flat name (checked as ``split`` does, except for
    required ones)."""
    values, _ = _given(settings)
    return {SECTIONS[s].flat_name(f): v for (s, f), (_, v) in values.items()}


def merge(base: Mapping[Any, Any], overrides: Mapping[Any, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` (either form each) winning, as flat settings. An override
    may name a key inside a setting by a dotted name (``--set optimizer.lr=0.01``: only
    ``lr`` of ``optimizer`` changes) or a section's field (``checkpoints.every``)."""
    plain = {k: v for k, v in overrides.items() if not _dotted(k)}
    out = {**flatten(base), **flatten(plain)}
    for key, value in overrides.items():
        if _dotted(key):
            _set_inside(out, key, value)
    return out


def _dotted(key: Any) -> bool:
    return isinstance(key, str) and "." in key  # (no setting's name has a dot)


def _default(name: str) -> Any:
    """The default value of flat setting ``name`` (None when it has none)."""
    section, field = FLAT[name]
    f = next(f for f in dataclasses.fields(SECTIONS[section])  # type: ignore[arg-type]
             if f.name == field)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _set_inside(out: dict[str, Any], key: str, value: Any) -> None:
    """``out`` (flat settings) with ``key`` = ``setting.k1.k2...`` set to ``value`` inside
    the mapping the setting holds, or ``section.field`` set."""
    head, _, rest = key.partition(".")
    if head in SECTIONS:
        field, dot, sub = rest.partition(".")
        if not dot or field not in SECTIONS[head].field_names():
            out.update(flatten({head: {field: value}}))  # checked as the nested form is
            return
        head, rest = SECTIONS[head].flat_name(field), sub  # checkpoints.options.region
    if head not in FLAT:
        raise unknown(key, head, [*FLAT, *SECTIONS], "a job setting")
    path = rest.split(".")
    whole = out[head] if head in out else _default(head)  # ({CPU: 1} for resources_per_worker)
    if not isinstance(whole, Mapping):  # (values not echoed: one may hold a credential)
        what = "not given" if whole is None else f"a {type(whole).__name__}, not a mapping"
        raise ConfigError(key, f"sets a key inside {head}, which is {what}.",
                          f"give {head} whole, e.g. --set {head}={{...}}")
    top = inner = dict(whole)  # copies: the base's mappings are not changed
    for i, k in enumerate(path[:-1]):
        below = inner.get(k, {})
        if not isinstance(below, Mapping):
            at = ".".join([head, *path[:i + 1]])
            raise ConfigError(key, f"{at} is a {type(below).__name__}, not a mapping.",
                              f"give it whole, e.g. --set {at}={{...}}")
        inner[k] = dict(below)
        inner = inner[k]
    inner[path[-1]] = value
    out[head] = top
