"""``WorkerConfig``: the part of a job's config a worker reads, built by
``JobConfig.for_worker()`` on the driver and sent to each worker instead of the whole config.

It holds three checked sections (training, data, evaluation), the switch settings, and the
checkpoint settings with the location already parsed, so a worker neither checks nor parses
anything again. Its attribute and method names are the ones ``elastic/worker.py`` reads of a
``JobConfig`` (``tests/unit/test_config.py`` holds it to that), so the worker can take either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic.checkpoint.location import StorageLocation

from .flat import Setting
from .sections import Data, Evaluation, Training

__all__ = ["JobCode", "WorkerConfig"]


class JobCode:
    """The job's code and data, built from its checked sections; shared by ``JobConfig`` (the
    driver) and ``WorkerConfig`` (a worker), which both hold ``training``, ``data`` and
    ``evaluation``."""

    if TYPE_CHECKING:  # a field of WorkerConfig, a property of JobConfig
        @property
        def training(self) -> Training: ...

        @property
        def data(self) -> Data: ...

        @property
        def evaluation(self) -> Evaluation: ...

    def model_factory(self) -> Callable[[], Any]:
        return self.training.model_factory()

    def optimizer_factory(self) -> Callable[[Any], Any]:
        return self.training.optimizer_factory()

    def loss_fn(self) -> Callable[[Any, Any], Any]:
        return self.training.loss_fn()

    def lr_schedule_fn(self) -> Callable[[int], float] | None:
        """``step -> multiplier`` of the optimizer's lr, or None (elastic.schedules)."""
        return self.training.lr_schedule_fn(self.data.max_steps)

    def strategy_options(self) -> dict[str, Any]:
        """Job settings that every layout applies itself (``StrategySpec.options``)."""
        return self.training.strategy_options()

    def dataset_object(self) -> Any:
        return self.data.dataset_object()

    def eval_dataset_object(self) -> Any:
        """The evaluation dataset, or None."""
        return self.evaluation.dataset_object(self.data)


@dataclass(frozen=True)
class WorkerConfig(JobCode):
    """What a worker reads of its job's config. Immutable; picklable."""

    training: Training
    data: Data
    evaluation: Evaluation
    switch_check: str
    switch_move: str
    checkpoint_every: int
    checkpoint_wait_s: float
    checkpoint_location: StorageLocation | None  # None: the job writes no checkpoints
    run_path: str = ""  # the job's run directory, resolved on the driver
    faults: tuple[dict[str, Any], ...] | None = None  # test aid (elastic/worker/faults.py)
    on_nonfinite: str = "skip"  # what a step with a NaN/inf loss or gradient does
    max_nonfinite_skips: int = 5
    peer_copies_every: int = 0  # every N steps a buddy keeps a copy of what only I hold
    peer_copies_memory_gb: float | None = None  # host memory those copies may use per worker
    dataset_length: int | None = None  # the training set's length as the driver read it
    eval_dataset_length: int | None = None  # ... and the evaluation set's

    precision = Setting[str]("training")
    seed = Setting[int]("training")
    global_batch_size = Setting[int]("data")
    max_steps = Setting[int]("data")
    eval_dataset = Setting[Any]("evaluation")
    eval_every = Setting[int]("evaluation")
    eval_batch_size = Setting[int | None]("evaluation")

    @property
    def checkpoint_uri(self) -> str | None:
        """Where checkpoints go, safe to print, or None when the job writes none."""
        loc = self.checkpoint_location
        return loc.shown if loc is not None else None
