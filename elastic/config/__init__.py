"""Job configuration: sections that check themselves, read by flat names or by section.

In YAML (or ``fit(...)`` keywords), every setting has a flat name, and may also be given
inside its section::

    model: {target: elastic.models:gpt, n_layer: 2}
    optimizer: {name: adamw, lr: 3.0e-4}
    loss: cross_entropy
    dataset: {target: elastic.models:demo_dataset, block_size: 64}
    global_batch_size: 32
    max_steps: 500
    checkpoints: {uri: s3://bucket/run, every: 50}     # = checkpoint_uri, checkpoint_every

Code is named by import strings (``"package.module:attr"``); a mapping with a ``target`` key
calls that target with the remaining keys as keyword arguments.

Modules: ``job`` (``JobConfig``), ``sections`` and ``checkpoints`` (the sections), ``flat``
(flat names and the two forms), ``code`` (settings that name code), ``datasets``, ``checks``
(single-value checks), ``worker_config`` (``WorkerConfig``).
"""

from .checkpoints import Checkpoints
from .code import loss_function, optimizer_factory, resolve_callable
from .job import JobConfig
from .sections import (
    SWITCH_CHECKS,
    SWITCH_MOVES,
    Data,
    Evaluation,
    Failures,
    Output,
    Parallelism,
    Preemption,
    Scaling,
    Training,
)
from .worker_config import WorkerConfig

__all__ = [
    "JobConfig",
    "WorkerConfig",
    "Training",
    "Data",
    "Evaluation",
    "Scaling",
    "Parallelism",
    "Failures",
    "Preemption",
    "Checkpoints",
    "Output",
    "SWITCH_CHECKS",
    "SWITCH_MOVES",
    "resolve_callable",
    "optimizer_factory",
    "loss_function",
]
