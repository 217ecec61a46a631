"""The job's data on this rank: the training set, its step sampler and the evaluation set."""

from __future__ import annotations

from typing import Any

import torch

from ..config import JobConfig, WorkerConfig
from ..data import RowsChangedError, StepSampler, fetch_batch
from ..errors import ConfigError

__all__ = ["JobData"]


class JobData:
    """Loads the job's datasets once, on first use, and hands out batches by step.

    The samples of step ``s`` depend only on (seed, s, G) (``elastic.data``); a rank takes
    the ``[lo, hi)`` part of them that its share says. Not thread-safe (the step loop's).
    """

    def __init__(self, config: JobConfig | WorkerConfig) -> None:
        self._config = config
        self._dataset: Any = None
        self._sampler: StepSampler | None = None
        self._eval: Any = None

    def load(self) -> None:
        """Read the training set (its length sets the sampler), and count the evaluation set
        where the driver counted it; a no-op once loaded. A set of another length than the
        driver read is refused (``ConfigError``), before any step or evaluation."""
        if self._dataset is None:
            dataset = self._config.dataset_object()
            n = len(dataset)
            _same_length("dataset", n, getattr(self._config, "dataset_length", None),
                         "the sample order is a permutation of the length, so this worker's "
                         "samples would not be the ones its step stands for")
            self._dataset = dataset
            self._sampler = StepSampler(n, self._config.global_batch_size, self._config.seed)
        if getattr(self._config, "eval_dataset_length", None) is not None:
            _ = self.eval_dataset  # refused now, not inside an evaluation's collectives

    @property
    def dataset(self) -> Any:
        self.load()
        return self._dataset

    @property
    def sampler(self) -> StepSampler:
        self.load()
        assert self._sampler is not None
        return self._sampler

    def batch(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``lo..hi-1`` of step ``step``'s global batch, as (inputs, targets)."""
        return _fetch("dataset", self.dataset, self.sampler.indices(step)[lo:hi])

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` samples of step 0's batch (what the profiler times)."""
        return self.batch(0, 0, n)

    @property
    def eval_dataset(self) -> Any:
        """``eval_dataset``, read on first use (None when the job has none). Every rank scores
        all of it, in order, batch by batch together: one of another length than the driver
        read is refused (its ranks would pair other batches' collectives, or mix splits)."""
        if self._eval is None:
            ds = self._config.eval_dataset_object()
            if ds is not None:
                _same_length("eval_dataset", len(ds),
                             getattr(self._config, "eval_dataset_length", None),
                             "every rank scores the whole evaluation set, batch by batch "
                             "together, so this worker's batches would not be its peers'")
            self._eval = ds
        return self._eval

    def eval_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``indices`` of the evaluation set, as (inputs, targets)."""
        return _fetch("eval_dataset", self.eval_dataset, indices)


_FIX = ("give the job a dataset that stays the same while it runs (a fixed set of files, not "
        "a prefix or a table that grows), and start it again")


def _same_length(field: str, n: int, want: int | None, why: str) -> None:
    """``ConfigError`` naming ``field`` when this worker read ``n`` samples of it, where the
    job read ``want`` when it started (None: not known, not checked)."""
    if want is not None and n != want:
        raise ConfigError(field, f"this worker reads {n} samples, where the job read {want} "
                          f"when it started: {why}.", _FIX)


def _fetch(field: str, dataset: Any, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fetch_batch``; a Parquet dataset whose files changed between its count and its read
    is a ``ConfigError`` naming ``field``."""
    try:
        return fetch_batch(dataset, indices)
    except RowsChangedError as e:
        raise ConfigError(field, f"{e}.", _FIX) from None
