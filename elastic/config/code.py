"""Settings that name code: the model factory, optimizer, loss, schedule and dataset factories.

In YAML, code is named by import strings (``"package.module:attr"``); a mapping with a
``target`` key calls that target with the remaining keys as keyword arguments. Built-in names
exist for optimizers (``{name: adamw, lr: 3.0e-4}``) and losses (``cross_entropy``, ``mse``).

The ``check_*`` functions run when a config section is built, once: they import code named by
an import string (so "cannot import" is said then) and check a ``{target: ...}`` mapping's
keyword arguments, and a built-in optimizer's, against the target's signature, with a "did
you mean" for a misspelling. ``resolve_callable`` and the factories, used later on the driver
and on every worker, only import and build; they check nothing again.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from elastic.errors import ConfigError

from .checks import did_you_mean

__all__ = [
    "OPTIMIZERS",
    "LOSSES",
    "check_code",
    "check_model",
    "check_optimizer",
    "check_loss",
    "check_keywords",
    "resolve_callable",
    "model_factory",
    "optimizer_factory",
    "loss_function",
    "describe",
]

OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop",
              "adagrad": "Adagrad"}
LOSSES = ("cross_entropy", "mse")
_FORMS = "pass a callable, 'package.module:name', or {target: 'package.module:name', ...}"


def check_code(spec: Any, field: str, *, complete: bool = False) -> None:
    """``spec`` is a callable, an import string ``module:attr`` that imports, or
    ``{target: ..., **kw}`` whose keywords the target takes (``check_keywords``; ``complete``:
    the result is called with no other argument, so every required parameter is given)."""
    if callable(spec):
        return
    if isinstance(spec, str) and ":" in spec:
        resolve_callable(spec, field)
        return
    if isinstance(spec, Mapping) and "target" in spec:
        target = resolve_callable(spec["target"], field)
        check_keywords(field, target, {k: v for k, v in spec.items() if k != "target"},
                       complete=complete)
        return
    raise ConfigError(field, f"{spec!r} is neither a callable nor an import string "
                      "'module:name'.", _FORMS)


def check_model(spec: Any) -> None:
    """A model setting is a factory (function or class), not a built model."""
    import torch

    if isinstance(spec, torch.nn.Module):
        raise ConfigError("model", f"is a built model ({type(spec).__name__}), not a factory; "
                          "each worker builds its own copy.",
                          "pass what builds it: model=MyNet, or "
                          "model=functools.partial(MyNet, width=64)")
    check_code(spec, "model", complete=True)


def check_optimizer(spec: Any) -> None:
    """A built-in name (``adam``) or ``{name: ..., **kwargs}`` whose arguments
    ``torch.optim``'s signature takes, with values of the right type; or code."""
    if isinstance(spec, str) and spec.lower() in OPTIMIZERS:
        return
    if isinstance(spec, Mapping) and "name" in spec and "target" not in spec:
        name = str(spec["name"]).lower()
        if name not in OPTIMIZERS:
            near = did_you_mean(name, OPTIMIZERS)
            raise ConfigError("optimizer", f"unknown optimizer {spec['name']!r}.",
                              (f"did you mean {near}? " if near else "")
                              + f"use one of {', '.join(OPTIMIZERS)} or an import string")
        import torch

        cls = getattr(torch.optim, OPTIMIZERS[name])
        check_keywords("optimizer", cls, {k: v for k, v in spec.items() if k != "name"},
                       given=("params",), values=True, who=f"torch.optim.{cls.__name__}")
        return
    if isinstance(spec, str) and ":" not in spec:
        near = did_you_mean(spec.lower(), OPTIMIZERS)
        raise ConfigError("optimizer", f"unknown optimizer {spec!r}.",
                          (f"did you mean {near}? " if near else "")
                          + f"use one of {', '.join(OPTIMIZERS)}, or an import string")
    check_code(spec, "optimizer")


def check_loss(spec: Any) -> None:
    """A built-in loss name or code."""
    if isinstance(spec, str) and ":" not in spec:
        if spec not in LOSSES:
            near = did_you_mean(spec, LOSSES)
            raise ConfigError("loss", f"unknown loss {spec!r}.",
                              (f"did you mean {near}? " if near else "")
                              + f"use {' or '.join(LOSSES)}, or an import string")
        return
    check_code(spec, "loss")


def check_keywords(field: str, target: Any, kwargs: Mapping[str, Any], *,
                   given: tuple[str, ...] = (), complete: bool = False,
                   values: bool = False, who: str | None = None) -> None:
    """Check ``kwargs`` against ``target``'s signature: each must be a parameter it takes
    ("did you mean" otherwise), none of ``given`` (elastic passes those). ``complete``: the
    target is then called with no other argument, so every parameter without a default must
    be in ``kwargs``. ``values``: a value must have the type of the parameter's default
    (number, true/false, a list of numbers). ``who`` names the target in messages. Targets
    without a signature are not checked."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    who = who or describe(target)
    named = {n: p for n, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for k, v in kwargs.items():
        if k in given:
            raise ConfigError(f"{field}.{k}", "is passed by elastic.", f"remove {k} from {field}")
        if k not in named:
            if open_ended:
                continue
            near = did_you_mean(k, [n for n in named if n not in given])
            raise ConfigError(f"{field}.{k}", f"is not an argument of {who}.",
                              f"did you mean {near}?" if near else
                              f"{who} takes: {', '.join(n for n in named if n not in given)}")
        if values:
            _check_value(f"{field}.{k}", v, named[k].default, who)
    if complete:
        for n, p in named.items():
            if p.default is p.empty and n not in kwargs and n not in given:
                raise ConfigError(field, f"{who} needs the argument {n!r}.",
                                  f"add {n}: <value> next to target")


def _check_value(key: str, value: Any, default: Any, who: str) -> None:
    name = key.rsplit(".", 1)[1]
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}.",
                              f"e.g. {name}: {str(default).lower()} (the default of {who})")
    elif isinstance(default, (int, float)):
        if not _is_number(value):
            from .checks import _yaml_text

            raise ConfigError(key, f"must be a number, got {value!r}{_yaml_text(value)}.",
                              f"e.g. {name}: {default!r} (the default of {who})")
    elif isinstance(default, tuple) and all(_is_number(d) for d in default):
        if not (isinstance(value, (list, tuple)) and len(value) == len(default)
                and all(_is_number(x) for x in value)):
            raise ConfigError(key, f"must be a list of {len(default)} numbers, got {value!r}.",
                              f"e.g. {name}: {list(default)} (the default of {who})")


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    import torch

    return isinstance(value, torch.Tensor) and value.numel() == 1


def resolve_callable(spec: Any, field_name: str) -> Any:
    """Turn an import string or a ``{target: ..., **kwargs}`` mapping into a callable (a
    ``functools.partial`` for a mapping). Raises ``ConfigError`` naming ``field_name`` if the
    code cannot be imported or ``spec`` is not code."""
    if callable(spec):
        return spec
    if isinstance(spec, Mapping) and "target" in spec:
        target = resolve_callable(spec["target"], field_name)
        kwargs = {k: v for k, v in spec.items() if k != "target"}
        return functools.partial(target, **kwargs)
    if isinstance(spec, str) and ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            obj: Any = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                field_name, f"cannot import {spec!r} ({e}).",
                "use 'package.module:name' of an importable callable",
            ) from None
        return obj
    raise ConfigError(field_name, f"{spec!r} is neither a callable nor an import string "
                      "'module:name'.", _FORMS)


def model_factory(spec: Any) -> Callable[[], Any]:
    """The model factory; what it builds is checked to be an ``nn.Module``."""
    return functools.partial(_checked_model, resolve_callable(spec, "model"))


def _checked_model(factory: Callable[[], Any]) -> Any:
    import torch

    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", f"the factory returned a {type(model).__name__}, not a "
                          "torch.nn.Module.", "return the model itself (an nn.Module) from "
                          "the factory, e.g. def make(): return MyNet()")
    return model


def optimizer_factory(spec: Any) -> Callable[[Any], Any]:
    """``{name: adam, lr: 1e-3}``, ``"adam"``, an import string or a ``params -> Optimizer``
    (its arguments were checked when the config was built: ``check_optimizer``)."""
    if isinstance(spec, str) and spec.lower() in OPTIMIZERS:
        spec = {"name": spec}
    if isinstance(spec, Mapping) and "name" in spec and "target" not in spec:
        cls_name = OPTIMIZERS.get(str(spec["name"]).lower())
        if cls_name is None:  # a config checked it already; a direct caller may not have
            check_optimizer(spec)
            raise AssertionError("check_optimizer raises for an unknown name")
        kwargs = {k: v for k, v in spec.items() if k != "name"}
        return functools.partial(_make_optimizer, cls_name, kwargs)
    return resolve_callable(spec, "optimizer")  # type: ignore[no-any-return]


def _make_optimizer(cls_name: str, kwargs: dict[str, Any], params: Any) -> Any:
    import torch

    return getattr(torch.optim, cls_name)(params, **kwargs)


def loss_function(spec: Any) -> Callable[[Any, Any], Any]:
    """A built-in loss (``cross_entropy``, ``mse``) or the user's ``(outputs, targets) ->
    loss``."""
    if isinstance(spec, str) and spec in LOSSES:
        return _cross_entropy if spec == "cross_entropy" else _mse
    return resolve_callable(spec, "loss")  # type: ignore[no-any-return]


def _cross_entropy(outputs: Any, targets: Any) -> Any:
    """``F.cross_entropy``'s mean, over the targets that are not ignored (-100); 0 when none
    is (a rank's share or a micro-batch of padding only: was NaN, the step counted
    non-finite while its update, of zero gradients there, was applied). Class indices of a
    language model's shape (outputs ``(..., vocab)``, targets their shape less the last
    dim) are scored per position; any other shape as ``F.cross_entropy`` takes it: the
    class dim is 1 (``(N, C)``, a segmentation's ``(N, C, H, W)`` against ``(N, H, W)``,
    and class probabilities of the outputs' shape). Shapes that fit both readings (a
    sequence as long as the vocabulary) are refused, naming the fix (was: read as a
    language model's, silently)."""
    import torch.nn.functional as F

    if targets.is_floating_point():  # class probabilities: nothing is ignored
        return F.cross_entropy(outputs, targets)
    if outputs.dim() > 2 and targets.shape == outputs.shape[:-1]:
        if targets.shape == outputs.shape[:1] + outputs.shape[2:]:  # classes last or at 1
            raise _ambiguous(outputs.shape, targets.shape)
        outputs, targets = outputs.reshape(-1, outputs.size(-1)), targets.reshape(-1)
    total = F.cross_entropy(outputs, targets, reduction="sum")  # (no device sync)
    return total / (targets != -100).sum().clamp(min=1)


def _ambiguous(out: Any, y: Any) -> ConfigError:
    return ConfigError(
        "loss", f"cross_entropy cannot tell where the classes are: outputs {tuple(out)} "
        f"against class indices {tuple(y)} read either with the classes last (a language "
        f"model's, {out[-1]} classes) or at dim 1 (a segmentation's, {out[1]} classes), and "
        "the two score differently",
        "give a loss of your own that says which (`F.cross_entropy(out.flatten(0, -2), "
        "y.flatten())` for classes last, `F.cross_entropy(out, y)` for classes at dim 1), or "
        "make the sizes differ")


def _kept_targets(targets: Any) -> Any:
    """The items ``_cross_entropy`` averages over: the targets not ignored (-100), or the
    positions of class probabilities (all but the class dim, 1) (``strategies.items``:
    every layout then weights a part's mean by its items over the global batch's, as one
    process's mean over it does)."""
    if targets.is_floating_point():
        return targets.numel() // max(1, targets.size(1)) if targets.dim() > 1 else len(targets)
    return (targets != -100).sum()


_cross_entropy.count_items = _kept_targets  # type: ignore[attr-defined]


def _mse(outputs: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    return F.mse_loss(outputs, targets)


def describe(obj: Any) -> str:
    """``module:qualname`` of code (``partial(...)`` around a partial), else its type name."""
    if isinstance(obj, functools.partial):
        return f"partial({describe(obj.func)})"
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None)
    if mod and qual:
        return f"{mod}:{qual}"
    return type(obj).__name__
