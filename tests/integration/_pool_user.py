"""A job's own code for the warm pool's isolation tests (tests/integration/test_pool.py): it
records, in each worker, what it sees of a previous job in the same process: when it is
imported (the previous job's environment variable, process group, tensors of this model's
marked shape) and when it builds its model (how many times this copy of the module has)."""

from __future__ import annotations

import gc
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

MARK_SHAPE = (7, 13)  # the middle layer's weight: no other model in the tests has it


def _marked_tensors() -> int:
    """Tensors of the marked shape anywhere in the process. A pooled worker's reset freezes
    what survives a job (``gc.freeze``), and ``gc.get_objects`` does not list frozen
    objects: without the unfreeze a tensor leaked from the previous job could never be
    seen (the next reset collects all generations, as after a large job's)."""
    gc.unfreeze()
    return sum(1 for o in gc.get_objects()
               if type(o) in (torch.Tensor, nn.Parameter) and tuple(o.shape) == MARK_SHAPE)


SEEN_AT_IMPORT = {"env": os.environ.get("ELASTIC_POOL_MARK"), "group": dist.is_initialized(),
                  "marked_tensors": _marked_tensors()}
BUILDS = 0  # in this copy of the module


def model(out_dir: str, mark: str, leak_thread: bool = False) -> nn.Module:
    """The model (mlp-like, a 13/7 middle); inside a worker's group it also writes
    ``<out_dir>/<mark>-<pid>-<n>.json`` with what it saw, then sets an environment variable
    (and, with ``leak_thread``, starts a thread that outlives the job)."""
    global BUILDS
    BUILDS += 1
    if dist.is_initialized():
        rec = {"pid": os.getpid(), "mark": mark, "builds": BUILDS, "import": SEEN_AT_IMPORT}
        with open(os.path.join(out_dir, f"{mark}-{os.getpid()}-{BUILDS}.json"), "w") as f:
            json.dump(rec, f)
        os.environ["ELASTIC_POOL_MARK"] = mark
        if leak_thread:
            threading.Thread(target=time.sleep, args=(3600,), daemon=True,
                             name="user-leak").start()
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                         nn.Linear(7, 2))
