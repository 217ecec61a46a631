"""The job's data on this rank: the training set, its step sampler and the evaluation set."""

from __future__ import annotations

from typing import Any

import torch

from ..config import JobConfig, WorkerConfig
from ..data import StepSampler, fetch_batch
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
        """Read the training set (its length sets the sampler); a no-op once loaded."""
        if self._dataset is None:
            dataset = self._config.dataset_object()
            n, want = len(dataset), getattr(self._config, "dataset_length", None)
            if want is not None and n != want:
                raise ConfigError(
                    "dataset", f"this worker reads {n} samples, where the job read {want} "
                    "when it started: the sample order is a permutation of the length, so "
                    "this worker's samples would not be the ones its step stands for.",
                    "give the job a dataset that stays the same while it runs (a fixed set of "
                    "files, not a prefix or a table that grows), and start it again")
            self._dataset = dataset
            self._sampler = StepSampler(n, self._config.global_batch_size, self._config.seed)

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
        return fetch_batch(self.dataset, self.sampler.indices(step)[lo:hi])

    def first(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` samples of step 0's batch (what the profiler times)."""
        return self.batch(0, 0, n)

    @property
    def eval_dataset(self) -> Any:
        """``eval_dataset``, read on first use (None when the job has none)."""
        if self._eval is None:
            self._eval = self._config.eval_dataset_object()
        return self._eval
