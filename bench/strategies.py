"""Strategy benchmark: steady-state throughput, memory per worker and live-switch latency of
every strategy, on one long-running elastic job with a ~50 MB model.

Workload (``bench/_strat_common.py``): 12 blocks of ``Linear(1024, 1024) + Tanh`` (12.6M fp32
parameters, 50.4 MB of weights; with Adam's two moments the canonical state is 151 MB), MSE
on a seeded synthetic regression set, global batch 32, 1 CPU thread per worker, gloo.

For each world size (``--workers 2 3``) the script starts a private local Ray instance and one
job with ``elastic.submit`` (strategy dp, ``micro_batches=4``), then

1. **throughput and memory** (``--rounds`` passes over the layouts dp, zero1, zero2, zero3,
   pipeline-gpipe, pipeline-1f1b): switch to the layout with ``handle.switch``, skip
   ``--warmup`` steps, measure ``--steps`` steps: samples/s over the window (global batch x
   steps / wall time between rank 0's step ends) and the median step time; then
   ``handle.controller_memory()`` (elements each rank holds, x 4 bytes) and, sampled every
   0.2 s during the window, each worker process's RSS (/proc/PID/status);
2. **switch latency** (``--pair-rounds`` passes): a closed walk that takes every ordered pair
   of the 6 layouts once (30 switches), one or more steps between switches. Per switch: the
   "switch" event's ``data["seconds"]`` (the controller's layout call: every worker's
   ``_build``), whether the state hash was unchanged, the wall time of ``handle.switch``
   (adds waiting for the step boundary) and the first step time in the new layout.

The pipeline schedule is a job setting (``JobConfig.schedule``), not part of a switch request;
to switch between gpipe and 1f1b in one job the script sets ``handle.controller.cfg.schedule``
just before asking for the switch (a benchmark-only shortcut; the controller builds the spec
from it at the step boundary).

With ``--profile`` it then runs ``bench/_strat_profile.py`` (outside Ray): the worker's
``_build`` phase by phase, as-is and with fixes applied to copies in that file.

    python bench/strategies.py --workers 2 3 --json /tmp/strategies.json

A benchmark, not a test: it never fails on a goal. Ray processes started here are shut down
(and stray ones killed) at the end, also on errors.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    _bench = os.path.dirname(os.path.abspath(__file__))
    if _bench not in sys.path:
        sys.path.insert(0, _bench)
    from _strat_main import main

    sys.exit(main())
else:
    # This file shares its name with the project's ``strategies`` package, and a script run
    # from bench/ has bench/ first on sys.path, so ``import strategies`` (which elastic
    # itself does) finds this file. Hand the import over to the real package: it replaces
    # this module in sys.modules, and the import system returns whatever is there once the
    # module has run.
    import importlib.util

    _pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "strategies")
    _spec = importlib.util.spec_from_file_location(
        __name__, os.path.join(_pkg, "__init__.py"), submodule_search_locations=[_pkg])
    assert _spec is not None and _spec.loader is not None
    _real = importlib.util.module_from_spec(_spec)
    sys.modules[__name__] = _real
    _spec.loader.exec_module(_real)
