"""torchrun entry point of bench/overhead.py: plain torch DDP over gloo, one thread per rank.

    torchrun --standalone --nproc_per_node 2 bench/_overhead_ddp.py OUT.json STEPS GLOBAL_BATCH
"""

from __future__ import annotations

import os
import sys
import time

# bench/ holds other scripts (e.g. bench/strategies.py) that would shadow the project's packages
# if it came first on sys.path: put the repository root first and bench/ last.
_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [os.path.dirname(_BENCH)] + [
    p for p in sys.path if os.path.abspath(p or ".") != _BENCH] + [_BENCH]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _overhead_common import ddp_loop, write_json  # noqa: E402

torch.set_num_threads(1)


def main() -> None:
    out, steps, g = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t_start = time.time()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = ddp_loop(rank, world, g, steps)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        write_json(out, {"system": "ddp", "t_proc_start": t_start, **res, "pid": os.getpid()})


if __name__ == "__main__":
    main()
