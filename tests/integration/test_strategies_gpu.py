"""The non-pipeline strategies on CUDA (one GPU, NCCL, world size 1) against the CPU reference.

Skipped without a GPU. One GPU allows one NCCL rank only (NCCL refuses two ranks on one
device), so this checks device placement (model, optimizer state, canonical state on the CPU,
loading a CPU state onto the GPU), not multi-rank reductions; those run on CPU/gloo in
``test_strategies.py``. GPU float32 kernels sum in another order than the CPU ones, hence a
looser tolerance than the CPU tests' 1e-5 (measured diffs are far below it).
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_strategies import _train, max_param_diff, reference
from tests.mp_harness import ProcessPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_ATOL = 1e-4


@pytest.fixture(scope="module")
def gpu_pool():
    p = ProcessPool(1, backend="nccl")
    yield p
    p.close()


@pytest.mark.parametrize("name", ["dp", "zero1", "zero2", "zero3"])
def test_gpu_matches_reference(gpu_pool: ProcessPool, name: str) -> None:
    (r,) = gpu_pool.run(_train, name, dict(shares=(8,)), 6, 0, None, "cuda")
    ref, losses = reference(8, 6)
    diff = max_param_diff(r["state"], ref)
    print(f"{name} on cuda: max param diff {diff:.2e}")
    assert diff < GPU_ATOL
    assert r["losses"] == pytest.approx(losses, abs=GPU_ATOL)
    assert all(t.device.type == "cpu" for t in r["state"].values())
    # Continue from that state on the GPU in another layout: still the reference.
    (r2,) = gpu_pool.run(_train, "zero3", dict(shares=(8,)), 3, 6, r["state"], "cuda")
    assert max_param_diff(r2["state"], reference(8, 9)[0]) < GPU_ATOL
