"""Ray Train driver of bench/overhead.py: TorchTrainer, 2 CPU workers, the same DDP loop.

    python bench/_overhead_raytrain.py OUT.json STEPS GLOBAL_BATCH STORAGE_DIR REPORT_EVERY

Starts its own local Ray cluster (RAY_TMPDIR must be private). Metrics are reported with
``ray.train.report`` once after the last step (outside the timed steps) and, if REPORT_EVERY
is N > 0, also after every N-th step inside the loop.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# bench/ holds other scripts (e.g. bench/strategies.py) that would shadow the project's packages
# if it came first on sys.path: put the repository root first and bench/ last.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH)] + [
    p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]


def train_loop(cfg: dict[str, Any]) -> None:
    import torch

    torch.set_num_threads(1)
    import _overhead_common as common
    import ray.train
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    res = common.ddp_loop(
        rank, world, cfg["global_batch"], cfg["steps"], report_every=int(cfg["report_every"]),
        report=lambda step, loss: ray.train.report({"step": step, "loss": loss}),
    )
    ray.train.report({"step": cfg["steps"] - 1, "loss": res["losses"][-1]})
    if rank == 0:
        common.write_json(cfg["out"], {"system": "raytrain", **res})


def main() -> None:
    out, steps, g, storage, every = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                     sys.argv[4], int(sys.argv[5]))
    t_api = time.time()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"out": out, "steps": steps, "global_batch": g,
                               "report_every": every},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name="overhead"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    with open(out) as f:
        res = json.load(f)
    res.update(t_api=t_api, t_end=time.time())
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
