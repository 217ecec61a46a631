"""Each searched factory, built once before any trial: a bad choice costs a second, not a trial.

A categorical choice that breaks its factory (``model.activation: [tanh, relu, sigmoidd]``
where the model factory looks the name up) would otherwise fail a whole trial, on a cluster,
every time the sampler picks it. ``check_factories`` builds, for every value of the search
space's probes (each choice, each end of a range) of a searched factory field:

* the model: on PyTorch's ``meta`` device (no memory, no initialisation cost), or on the CPU
  when the factory cannot build there (it loads weights, say); it must return an
  ``nn.Module``;
* the optimizer: over one small parameter, so its keyword arguments are checked;
* the loss: resolved (it runs on tensors a trial makes).

Each distinct factory setting is built once. A failure is a ``ConfigError`` naming the
parameter and the value (``params.model.activation``; see ``check_factories`` for how the
value to blame is found). A factory nobody searches is the same in every trial and is only
resolved, as before: building it on the sweep's machine could need what only the workers have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..config import JobConfig
from ..errors import ConfigError
from .sweep_file import SweepConfig

__all__ = ["check_factories", "FACTORY_FIELDS"]

log = logging.getLogger("elastic.sweep")

FACTORY_FIELDS = ("model", "optimizer", "loss")


def _build_model(cfg: JobConfig) -> None:
    import torch

    factory = cfg.model_factory()
    try:
        with torch.device("meta"):
            model = factory()
    except Exception:  # noqa: BLE001 - some factories only build on a real device
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the factory returned a {type(model).__name__}, not a torch.nn.Module")


def _build_optimizer(cfg: JobConfig) -> None:
    import torch

    cfg.optimizer_factory()([torch.nn.Parameter(torch.zeros(2))])


_BUILDERS: dict[str, Callable[[JobConfig], Any]] = {
    "model": _build_model,
    "optimizer": _build_optimizer,
    "loss": lambda cfg: cfg.loss_fn(),
}


def _build(top: str, fields: dict[str, Any]) -> Exception | None:
    """Build ``top`` of the job ``fields``; the error it raises, or None."""
    try:
        _BUILDERS[top](JobConfig.from_dict({**fields, "view": "none"}))
    except Exception as e:  # noqa: BLE001 - the user's factory may raise anything
        return e
    return None


def _fail(where: str, what: str, top: str, e: Exception) -> ConfigError:
    if isinstance(e, ConfigError):
        return ConfigError(where, f"{what}: {e.problem}", e.fix)
    first = (str(e).strip().splitlines() or [""])[0][:300]
    fix = ("correct or drop that value (each trial that sampled it would fail the same way)"
           if where.startswith("params") else f"fix the {top} factory")
    return ConfigError(where, f"{what}: building the {top} failed: {type(e).__name__}: {first}",
                       fix)


def _culprit(cfg: SweepConfig, top: str, names: list[str], first: dict[str, Any]) -> str | None:
    """Of the parameters under ``top``, the one whose first value breaks the factory: the
    one whose removal (its base value instead) makes the all-first job build."""
    for n in names:
        rest = {k: v for k, v in first.items() if k != n}
        if _build(top, cfg.job_fields(rest)) is None:
            return n
    return None


def check_factories(cfg: SweepConfig) -> None:
    """Build each searched factory once per value (see the module docstring); ``ConfigError``
    naming the parameter and value whose factory fails.

    For each searched factory field, the job with every parameter at its first probe is
    built first, then each other probe value of each parameter with the rest at their first:
    a failure there is that value's. When the first job already fails, the parameter whose
    first value is the cause is found by building without it. When none is (the factory
    cannot build on this machine at all: weights or a device only the workers have), the
    field is not checked here (a warning says so) and the trials tell, as without the check.
    """
    first = {n: p.probes()[0] for n, p in cfg.params.items()}
    for top in FACTORY_FIELDS:
        names = [n for n in cfg.params if n.split(".")[0] == top]
        if not names:
            continue  # not searched: the same in every trial, resolved by SweepConfig.validate
        err = _build(top, cfg.job_fields(first))
        if err is not None:
            n = _culprit(cfg, top, names, first)
            if n is not None:
                raise _fail(f"params.{n}", f"value {first[n]!r}", top, err) from None
            log.warning("sweep: the %s cannot be built on this machine (%s: %s); its searched "
                        "values are not checked before the trials", top, type(err).__name__,
                        (str(err).strip().splitlines() or [""])[0][:200])
            continue
        seen = {repr(cfg.job_fields(first).get(top))}
        for n in names:
            for value in cfg.params[n].probes():
                fields = cfg.job_fields({**first, n: value})
                key = repr(fields.get(top))
                if key in seen:
                    continue
                seen.add(key)
                err = _build(top, fields)
                if err is not None:
                    raise _fail(f"params.{n}", f"value {value!r}", top, err) from None
