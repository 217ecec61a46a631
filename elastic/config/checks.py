"""Checks of single values, shared by the config sections. Each returns the value (normalised
where said) or raises one ``ConfigError`` naming the setting and the fix.

A value read from YAML may be text where a number was meant: PyYAML reads an exponent as a number
only with a decimal point and a signed exponent (``1.0e-3``, ``1.0e+3``), so ``1e-3`` and ``1e3``
are strings. The number checks say so, and the value meant, instead of a bare "not a number".
And unquoted ``on``/``off``/``yes``/``no`` are booleans in YAML: ``one_of`` takes them for the
choices "on"/"off" where those are choices.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from elastic.errors import ConfigError

__all__ = [
    "did_you_mean",
    "unknown",
    "integer",
    "optional_integer",
    "number",
    "one_of",
    "flag",
    "optional_flag",
    "text",
    "mapping",
]


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to ``name`` (difflib), or None when none is close."""
    near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.6)
    return near[0] if near else None


def unknown(field: str, name: str, known: Iterable[str], what: str) -> ConfigError:
    """The error for an unknown key ``name`` at ``field``: a "did you mean", else the list."""
    known = sorted(known)
    near = did_you_mean(name, known)
    fix = f"did you mean {near}?" if near else f"use one of: {', '.join(known)}"
    return ConfigError(field, f"is not {what}.", fix)


def _text_number(value: Any, whole: bool = False) -> tuple[str, str | None]:
    """For text that reads as a number: why it is text, and the value meant written so that
    YAML reads it as one (None when there is none: not a whole number for an integer
    setting). ``("", None)`` for anything else. PyYAML itself says which: what it reads as
    a number was quoted; what it does not is an exponent it does not take (``1e3``)."""
    import yaml

    if not isinstance(value, str):
        return "", None
    text = value.strip()
    try:
        f = float(text)
    except ValueError:
        return "", None
    if not math.isfinite(f):
        return "", None
    quoted = isinstance(yaml.safe_load(text), int | float)
    hint = (" (text: a number in quotes is a string)" if quoted else
            " (text: PyYAML reads an exponent as a number only with a decimal point and a "
            "signed exponent, as in 1.0e+3" + (", and an integer setting takes no exponent)"
                                              if whole else ")"))
    if whole:
        return hint, str(int(f)) if f.is_integer() else None
    return hint, text if quoted else yaml.safe_dump(f).split("\n")[0]


def _yaml_text(value: Any) -> str:
    """The hint of ``_text_number`` with the value meant (for a number setting)."""
    hint, meant = _text_number(value)
    return hint[:-1] + f"; write {meant})" if meant else hint


def integer(value: Any, key: str, low: int = 1, fix: str | None = None) -> int:
    """An int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        hint, meant = _text_number(value, whole=True)
        if meant is not None and int(meant) >= low:  # the fix is the value meant
            fix = f"write {key}: {meant}"
        raise ConfigError(key, f"must be {what}, got {value!r}{hint}.",
                          fix or f"set {key}: {max(low, 1)} or more")
    return value


def optional_integer(value: Any, key: str, low: int = 1, fix: str | None = None) -> int | None:
    """None, or ``integer(value, key, low)``."""
    return None if value is None else integer(value, key, low, fix)


def number(value: Any, key: str, low: float = 0.0, *, above: bool = False,
           fix: str | None = None) -> float:
    """A finite int or float (not a bool), >= ``low`` (> ``low`` when ``above``); returned
    as given (an int stays an int)."""
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and (value > low if above else value >= low))
    if not ok:
        bound = f"> {low:g}" if above else f">= {low:g}"
        hint, meant = _text_number(value)
        if meant is not None and (float(meant) > low if above else float(meant) >= low):
            fix = f"write {key}: {meant}"  # the value meant
        raise ConfigError(key, f"must be a finite number {bound}, got {value!r}{hint}.",
                          fix or f"e.g. {key}: {max(low, 1.0):g}")
    return value  # type: ignore[no-any-return]


def on_off(value: Any, key: str, choices: Iterable[str]) -> str:
    """``one_of`` for settings whose choices include "on"/"off": YAML's booleans (unquoted
    ``off``/``no``/``false``, ``on``/``yes``/``true``) are those words. The caller stores
    the value returned."""
    choices = tuple(choices)
    if isinstance(value, bool) and ("on" if value else "off") in choices:
        return "on" if value else "off"
    return one_of(value, key, choices)


def one_of(value: Any, key: str, choices: Iterable[str], fix: str | None = None) -> str:
    """One of ``choices`` (strings); a boolean is refused saying YAML read it so."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        near = did_you_mean(str(value), choices) if isinstance(value, str) else None
        hint = f"did you mean {near}? " if near else ""
        said = (" (YAML reads unquoted on, yes and true as true, off, no and false as false)"
                if isinstance(value, bool) else "")
        raise ConfigError(key, f"unknown value {value!r}{said}.",
                          fix or f"{hint}use one of: {', '.join(choices)}")
    return value


def flag(value: Any, key: str) -> bool:
    """A bool (YAML true/false)."""
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {value!r}.", f"set {key}: true or false")
    return value


def optional_flag(value: Any, key: str, none_means: str) -> bool | None:
    """None or a bool."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(key, f"must be true, false or left out, got {value!r}.",
                          f"leave it out for {none_means}")
    return value


def text(value: Any, key: str, *, optional: bool = True, fix: str | None = None) -> str | None:
    """A non-empty string (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"must be a non-empty string, got {value!r}.",
                          fix or (f"give {key} as text" + (", or leave it out" if optional else "")))
    return value


def mapping(value: Any, key: str, fix: str) -> dict[str, Any]:
    """A mapping with string keys, copied into a plain dict."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key, f"must be a mapping of names to values, got {value!r}.", fix)
    return dict(value)
