"""elastic driver of bench/overhead.py: ``elastic.fit`` with DP on 2 CPU workers.

    python bench/_overhead_elastic.py OUT.json STEPS GLOBAL_BATCH RUN_DIR

``fit`` starts its own local Ray cluster (RAY_TMPDIR must be private) and shuts it down.
"""

from __future__ import annotations

import json
import os
import sys
import time

# bench/ holds other scripts (e.g. bench/strategies.py) that would shadow the project's packages
# if it came first on sys.path: put the repository root first and bench/ last.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH)] + [
    p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]


def main() -> None:
    out, steps, g, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import _overhead_common as common

    import elastic

    t_api = time.time()
    res = elastic.fit(
        model=common.model_factory, optimizer=dict(common.OPTIM), loss=common.loss_fn,
        dataset=common.dataset_factory, global_batch_size=g, max_steps=steps, num_workers=2,
        seed=common.SEED, strategy="dp", view="none", run_dir=run_dir,
    )
    t_end = time.time()
    h = res.history
    with open(out, "w") as f:
        json.dump({"system": "elastic", "t_api": t_api, "t_end": t_end,
                   "times": [e["time"] for e in h], "losses": [e["loss"] for e in h],
                   "step_time": [e["step_time"] for e in h],
                   "steps": [e["step"] for e in h]}, f)


if __name__ == "__main__":
    main()
