"""The worker: a thin Ray actor (``actor.Worker``) over components that own their state.

=================  ==========================================================================
``membership``     the process group of the current generation, and the control group
``layout``         the live strategy and spec, building and switching layouts, lr schedule
``held_state``     snapshots, state parked at leave, roll-forward, restore from peers
``loop``           the step loop, the control all-reduce, metrics, stop flag, evaluation
``checkpointing``  which rank writes what, the background writer, restores from a checkpoint
``profiling``      speed and collective measurements, the emulated slowdown
``faults``         fault injection at a chosen (rank, step): a test aid
``inputs``         the job's datasets and step sampler on this rank
``boundary``       the error boundary: typed errors out of every call
=================  ==========================================================================

Only ``actor`` imports Ray; every component runs without it (tests/unit/test_worker_components.py).
"""

from .actor import Worker

__all__ = ["Worker"]
