"""Small models, datasets and factories shared by the tests (top level, so Ray can pickle them)."""

from __future__ import annotations

import torch
from torch import nn


class RegressionData:
    """n samples of (x in R^8, y in R^2), deterministic."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        w = torch.randn(8, 2, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


class TiedMlp(nn.Module):
    """``mlp``'s shape with its middle layer's weight shared by a fourth (as a language
    model's output head shares its embedding): one parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.again = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.again.weight = self.mid.weight
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.again(x)))


class CountingMlp(nn.Module):
    """``mlp``'s shape whose output grows with the training forwards it has run: a
    non-persistent buffer (in no state dict) counts them (a step counter, a warm-up)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 2)
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += 1
        return self.out(torch.tanh(self.inp(x))) * (1 + 0.05 * self.seen)


def wide_mlp() -> nn.Module:
    """``mlp``'s shape at width 256: enough compute per sample that a slower rank shows."""
    return nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                         nn.Linear(256, 2))


class _NeedsAutocast(nn.Tanh):
    """A Tanh that fails unless it runs under bf16 autocast (proves a job's precision
    reaches the workers' forward passes in every layout)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_autocast_enabled(x.device.type) or x.dtype != torch.bfloat16:
            raise RuntimeError(f"forward not under bf16 autocast (input {x.dtype})")
        return super().forward(x)


def bf16_mlp() -> nn.Module:
    """``mlp`` (same parameter names and initialization) that runs only under bf16 autocast."""
    return nn.Sequential(nn.Linear(8, 16), _NeedsAutocast(), nn.Linear(16, 16), _NeedsAutocast(),
                         nn.Linear(16, 2))


class EvalRowCap(nn.Module):
    """Passes its input through; in eval mode it refuses a forward of more than ``cap`` rows
    (an evaluation that would need more memory than training's micro-batches)."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and len(x) > self.cap:
            raise RuntimeError(f"an eval forward of {len(x)} rows, over {self.cap}")
        return x


def eval_capped_mlp() -> nn.Module:
    """``mlp`` behind an ``EvalRowCap`` of 3 rows (the rows of the preflight's sample)."""
    return nn.Sequential(EvalRowCap(3), *mlp())


def bn_mlp() -> nn.Module:
    """``mlp`` with a batch norm: a forward in training mode needs 2 samples or more."""
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2))


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def failing_model() -> nn.Module:
    raise RuntimeError("the factory is broken on purpose")


class ExplodingLoss:
    """A loss that raises on rank 1's call after ``after`` good ones (default: its first):
    user code failing on a worker. ``in_eval``: only its calls without gradients count and
    raise (an evaluation's)."""

    def __init__(self, after: int = 0, in_eval: bool = False) -> None:
        self.after = after
        self.in_eval = in_eval

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.in_eval and torch.is_grad_enabled():
            return nn.functional.mse_loss(out, y)
        if dist.is_initialized() and dist.get_rank() == 1:
            if self.after <= 0:
                raise ValueError("bad loss on purpose")
            self.after -= 1
        return nn.functional.mse_loss(out, y)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def mlp_act(activation: str = "tanh") -> nn.Module:
    """``mlp`` with a chosen activation, looked up by name (a sweep searches it)."""
    acts = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}
    return nn.Sequential(nn.Linear(8, 16), acts[activation](), nn.Linear(16, 2))


def worker_only_model(width: int = 16) -> nn.Module:
    """A factory that needs a file only the workers have (it cannot build on the driver)."""
    raise FileNotFoundError("/data/on-the-workers/weights.pt")


def slow_mlp(seconds_per_sample: float = 0.01) -> nn.Module:
    """``mlp`` with a compute cost per sample (``elastic.models.PerSampleCost``); same
    parameters."""
    from elastic.models import PerSampleCost

    return nn.Sequential(PerSampleCost(seconds_per_sample), *mlp())
