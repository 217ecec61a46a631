"""Checks on the driver, before any worker starts, that need the user's code and data.

``check_sample`` runs the model's forward and the job's loss on the first samples of the
dataset, read exactly as a worker reads them (``elastic.data``: the same Parquet columns,
dtypes and shapes), so a mismatch (a Parquet column of the wrong dtype or width, a loss that
wants integer class indices) is one ``ConfigError`` naming the setting and the fix, seconds
after ``fit`` is called, instead of a worker traceback after the cluster is up.

A model that cannot run on the driver's CPU at all (a kernel only an accelerator has) can
skip it: ``check_sample: false``.

``check_switch_at`` lays out each ``switch_at`` target as the start strategy is checked, on the
starting workers, so that a switch that could not run is refused before the job starts.
"""

from __future__ import annotations

import contextlib
from typing import Any

from .config import JobConfig
from .errors import ConfigError

__all__ = ["check_sample", "check_layouts", "check_switch_at"]

_SKIP = "to skip this check (a model that runs only on an accelerator): check_sample: false"


def check_sample(cfg: JobConfig, model: Any, dataset: Any, field: str = "dataset"
                 ) -> list[str]:
    """Run ``model`` (in eval mode, without gradients, under the job's precision) and the
    job's loss on up to 3 samples of ``dataset`` (the object ``cfg.dataset_object()`` gave,
    or with ``field="eval_dataset"`` ``cfg.eval_dataset_object()``). The model's training
    mode is restored; its parameters are not changed.

    Raises ``ConfigError`` naming ``input_column``/``target_column`` (Parquet) or
    ``dataset`` when reading, the forward or the loss fails (``eval_dataset`` for the
    evaluation set, which is read with the training set's settings: its data is at fault),
    or ``loss`` when it does not return one number.

    Returns, for the training set with ``find_unused_parameters`` left out, the trainable
    parameters a training pass on the samples leaves without a gradient
    (``left_out_parameters``), and turns ``find_unused_parameters`` on where there are any;
    else []. A check not made (``check_sample: false``) returns []."""
    if not cfg.check_sample:
        return []
    import torch

    from .data import fetch_batch

    parquet = getattr(dataset, "by_columns", False)  # Parquet, Ray blocks: columns named
    n = min(3, len(dataset))  # 3, not 2: fewer widths broadcast against it by chance
    try:
        x, y = dataset.head(n) if parquet else fetch_batch(dataset, torch.arange(n))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's data: say what it did
        said = ConfigError("input_column" if parquet else "dataset",
                           f"reading {n} sample(s) failed: {_first_line(e)}.",
                           _read_fix(cfg, parquet))
        raise _named(field, parquet, said) from None
    cast: Any = (torch.autocast("cpu", dtype=torch.bfloat16) if cfg.precision == "bf16"
                 else contextlib.nullcontext())
    loss_fn = cfg.loss_fn()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), cast:
            try:
                out = model(x)
            except Exception as e:  # noqa: BLE001 - the user's model: say what it did
                raise _named(field, parquet, _forward_error(cfg, parquet, x, e, field)) from None
            if field == "dataset" and _chain_differs(model, x, out):
                from .planning import not_chained

                not_chained(model)  # (no pipeline is planned for it; one named is refused)
            try:
                loss = loss_fn(out, y)
            except ConfigError:  # (the built-in loss's own refusal names its fix)
                raise
            except Exception as e:  # noqa: BLE001 - the user's loss: say what it did
                raise _named(field, parquet, _loss_error(cfg, parquet, out, y, e)) from None
    finally:
        model.train(was_training)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError("loss", f"returned {_describe(loss)}, not one number.",
                          "return a scalar tensor (e.g. the mean over the batch)")
    with torch.no_grad(), cast:
        _check_mean(loss_fn, out, y, bf16=cfg.precision == "bf16")
    if field == "dataset" and cfg.find_unused_parameters is None:
        left = left_out_parameters(model, loss_fn, x, y, cast)
        if left:  # dp's DDP would otherwise fail (strategies/dp.py ``check_reduced``)
            cfg.find_unused_parameters = True
        return left
    return []


def _chain_differs(model: Any, x: Any, out: Any) -> bool:
    """Whether ``model``'s blocks (``pipeline_blocks``, an ``nn.Sequential``'s children)
    applied one after the other to ``x`` give other outputs than its forward did (``out``):
    a pipeline runs them so, and would train another function. False for a model without
    blocks, or blocks that cannot run alone on ``x``."""
    import torch

    from strategies.blocks import pipeline_blocks_or_none

    try:
        blocks = pipeline_blocks_or_none(model)
        if not blocks or not isinstance(out, torch.Tensor):
            return False
        h = x
        for _, block in blocks:
            h = block(h)
    except Exception:  # noqa: BLE001 - said by the pipeline's own checks where it runs
        return False
    return not (isinstance(h, torch.Tensor) and h.shape == out.shape
                and torch.allclose(h.float(), out.float(), rtol=1e-3, atol=1e-5))


PASS_MAX_BYTES = 4 * 2**30  # trainable bytes above which the training pass is not run


def left_out_parameters(model: Any, loss_fn: Any, x: Any, y: Any, cast: Any) -> list[str]:
    """The trainable parameters that one training pass (train mode, forward, loss, backward)
    on ``x`` leaves without a gradient: a head the loss never reads, a branch the forward
    skips. The model's parameters, gradients, buffers, training mode and the random stream
    are as before. A pass that raises (the checks without gradients passed): none said."""
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params or sum(p.numel() * p.element_size() for _, p in params) > PASS_MAX_BYTES:
        return []  # (its gradients would take the model's size again in the driver's memory)
    grads = [p.grad for _, p in params]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    was = model.training
    try:
        for _, p in params:
            p.grad = None
        model.train()
        with torch.random.fork_rng(devices=[]):
            with cast:
                loss = loss_fn(model(x), y)
            loss.backward()
        return [n for n, p in params if p.grad is None]
    except Exception:  # noqa: BLE001 - said by the workers, where it is the step's
        return []
    finally:
        for (_, p), g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        model.train(was)


def _check_mean(loss_fn: Any, out: Any, y: Any, bf16: bool) -> None:
    """A loss that sums over the batch (``reduction='sum'``) is refused: the layouts combine
    each rank's and micro-batch's loss weighted by its samples, so a sum's gradients would
    grow with the share (and change at each resize). Told by samples 0 and 1: together they
    score what they score apart added up, clearly above either (a mean lies between them; a
    loss over the batch's other samples, a contrastive one, scores neither way and passes).
    Scored under one fixed random state (a loss that draws noise scores alike each time).
    Skipped where the outputs or targets are not batch-first tensors, or a part of them
    cannot be scored alone."""
    import torch

    try:
        if not (isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor)
                and out.dim() >= 1 and y.dim() >= 1 and len(out) >= 2 and len(y) == len(out)):
            return
        scores = []
        for a, b in ((0, 2), (0, 1), (1, 2)):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                scores.append(float(loss_fn(out[a:b], y[a:b])))
    except Exception:  # noqa: BLE001 - a loss that needs more than one sample: not checked
        return
    both, one, two = scores
    rel = 1e-2 if bf16 else 1e-4
    if not all(map(torch.isfinite, torch.tensor(scores))) or min(one, two) <= 0:
        return
    summed = abs(both - (one + two)) <= rel * (one + two) + 1e-7
    if not (summed and both > max(one, two) * (1 + 10 * rel) + 1e-7):
        return
    raise ConfigError("loss", f"sums over the batch: samples 0 and 1 together score "
                      f"{both:.6g}, apart {one:.6g} and {two:.6g} (reduction='sum'?). Each "
                      "worker's loss is weighted by its share of the global batch, so a sum "
                      "would scale the gradients with the share.",
                      "return the mean over the batch (reduction='mean'); to weigh samples "
                      "otherwise, scale inside the mean (a loss this check misreads: "
                      "check_sample: false)")


def check_layouts(cfg: JobConfig, layouts: Any) -> None:
    """The start strategy on the ``num_workers`` starting workers (``ConfigError`` naming
    ``strategy``; ``auto`` is the planner's), then ``check_switch_at``."""
    if cfg.strategy != "auto":
        layouts.validate(layouts.make(cfg.strategy, cfg.num_workers), "strategy")
    check_switch_at(cfg, layouts)  # (was: refused at its step, mid-run)


def check_switch_at(cfg: JobConfig, layouts: Any) -> None:
    """Each ``switch_at`` target as ``layouts`` (the controller's ``Layouts``) would lay it
    out, checked against the job's model as the start strategy is, on the starting workers
    and, where it cannot run there, on every other size the job may have (``min_workers`` ..
    ``max_workers``: the world may have changed by its step). Raises ``ConfigError`` naming
    ``switch_at[<step>]`` for one that could run on none (was: refused at its step, hours
    in: "switch_failed; training goes on"). ``auto`` is the planner's choice then, on the
    workers there are: not checked here."""
    n = cfg.num_workers
    sizes = [n, *(w for w in range(cfg.min_world, min(cfg.max_world, n + 64) + 1) if w != n)]
    for step, target in sorted(cfg.switch_at.items()):
        if target == "auto":
            continue
        why = _refusal(layouts, target, n)
        if why is None or any(_refusal(layouts, target, w) is None for w in sizes[1:]):
            continue
        where = (f"the {n} starting workers" if len(sizes) == 1 else f"any size the job may "
                 f"have ({cfg.min_world}..{cfg.max_world} workers), on the {n} starting ones")
        raise ConfigError(f"switch_at[{step}]", f"{target} could not run on {where}: {why}",
                          f"change what it names, switch to another strategy at step "
                          f"{step}, or drop this switch")


def _refusal(layouts: Any, name: str, world: int) -> str | None:
    """Why ``layouts`` could not lay ``name`` out on ``world`` workers (None: it could)."""
    from strategies import StrategyError

    try:
        layouts.check(layouts.make(name, world))
    except StrategyError as e:
        return str(e)
    return None


def _named(field: str, parquet: bool, e: ConfigError) -> ConfigError:
    """``e`` said of ``field``: of ``eval_dataset`` the error names it, not the column and
    dtype settings (they read the training set too, which passed this check)."""
    if field == "dataset":
        return e
    how = (": it is read as the training set is, with the same input_column/target_column "
           "and input_dtype/target_dtype" if parquet else ", (input, target) pairs the model "
           "and the loss take")
    return ConfigError(field, e.problem, f"give {field} samples like the training set's"
                       f"{how}; {_SKIP}")


def _raised_at(e: BaseException) -> str | None:
    """``file:line`` where the user's own code raised (the innermost frame); None when a
    library raised: torch (a layer or a torch loss refusing its input), elastic's own models
    and losses, an installed package: the data's shape or dtype is then the likely cause."""
    import os
    import sysconfig

    tb = e.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = os.path.abspath(tb.tb_frame.f_code.co_filename)
    libraries = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    libraries.add(os.path.dirname(os.path.abspath(__file__)))  # elastic's models and losses
    if any(where.startswith(os.path.abspath(d) + os.sep) for d in libraries):
        return None
    return f"{where}:{tb.tb_lineno}"


def _own_error(what: str, got: str, e: Exception, at: str, data_fix: str) -> ConfigError:
    """``what`` ("loss", "model") raised in its own code: said of it, not of the data."""
    return ConfigError(what, f"raised in its own code ({at}) on {got} (one sample of the "
                       f"dataset): {_first_line(e)}.",
                       f"fix the {what} where it raised; if it refuses these inputs, "
                       f"{data_fix}; {_SKIP}")


def _forward_error(cfg: JobConfig, parquet: bool, x: Any, e: Exception,
                   field: str = "dataset") -> ConfigError:
    got = f"inputs {_describe(x)}"
    if (at := _raised_at(e)) is not None:  # (was: said of the dataset, whatever raised)
        return _own_error("model", got, e, at, f"make {field}'s inputs what the model takes")
    if parquet:
        col = cfg.input_column
        given = cfg.dataset if field == "dataset" else cfg.eval_dataset
        return ConfigError(
            "input_column",
            f"the model's forward failed on a sample of {field} {cfg.redact(str(given))}"
            f": {_first_line(e)}. It received {got} (column {col!r}, read as {cfg.input_dtype}).",
            f"make column {col!r} hold what the model takes per sample, point input_column at "
            "the column that does, or set input_dtype to the dtype the model expects (int64 "
            f"for token ids); {_SKIP}")
    return ConfigError(
        "dataset",
        f"the model's forward failed on a sample of the dataset: {_first_line(e)}. It received "
        f"{got}.",
        f"make the dataset's inputs what the model takes (shape per sample, dtype); {_SKIP}")


def _loss_error(cfg: JobConfig, parquet: bool, out: Any, y: Any, e: Exception) -> ConfigError:
    got = f"the model's output {_describe(out)} and targets {_describe(y)}"
    if (at := _raised_at(e)) is not None:
        return _own_error("loss", got, e, at, "make the dataset's targets what it takes")
    if parquet:
        col = cfg.target_column
        return ConfigError(
            "target_column",
            f"the loss failed on {got} (column {col!r}, read as {cfg.target_dtype}): "
            f"{_first_line(e)}.",
            f"make column {col!r} hold what the loss takes with that output, or set "
            "target_dtype (int64 for class indices with cross_entropy; float32 for mse); "
            f"{_SKIP}")
    return ConfigError(
        "dataset",
        f"the loss failed on {got}: {_first_line(e)}.",
        "make the dataset's targets what the loss takes with the model's output (class "
        f"indices as int64 for cross_entropy, the output's shape for mse); {_SKIP}")


def _read_fix(cfg: JobConfig, parquet: bool) -> str:
    if parquet:
        return (f"columns {cfg.input_column!r} and {cfg.target_column!r} must hold numbers or "
                f"fixed-length lists of numbers readable as {cfg.input_dtype}/"
                f"{cfg.target_dtype}; set input_column/target_column and input_dtype/"
                "target_dtype")
    return "the dataset's items must be (input, target) pairs of tensors or numbers"


def _describe(t: Any) -> str:
    import torch

    if isinstance(t, torch.Tensor):
        return f"of shape {tuple(t.shape)}, {str(t.dtype).replace('torch.', '')}"
    return f"a {type(t).__name__}"


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
