"""Workloads of bench/planner.py: model families a new user might bring, none tuned to the
cost model, each with a seeded synthetic dataset and a loss.

Every model is an ``nn.Sequential`` of blocks (so pipelines, per-block profiling and zero3's
FSDP units apply) and computes on the CPU for real (no waits): an MLP, a small conv net, a
small GPT, an MLP-Mixer and a DLRM-style recommendation model (embedding tables, a bottom
MLP, pairwise interactions, a top MLP).

``HELD_OUT`` are families added after the planner's tuning (session 33), run to check that
what was tuned on the five above holds: a ResNet (BatchNorm buffers, residual blocks), an
LSTM language model (recurrent, cuDNN-style flat weights) and a bag-of-words text classifier
(a 2.6 M-parameter embedding and little compute: communication-bound).

``HELD_OUT_2`` were added in session 35, after the tuning of sessions 33-34, and first run
then: a ViT (torch's own ``TransformerEncoderLayer`` blocks, pre-norm), a convolutional
autoencoder (transposed convolutions, a regression loss on the image) and a wide MLP (9.6 M
parameters and little compute per parameter: the optimizer and the messages weigh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ALL", "FAMILIES", "HELD_OUT", "HELD_OUT_2", "Family"]


class _Data:
    """A seeded synthetic dataset: inputs of ``shape`` (float, or ints below ``vocab``), class
    targets below ``classes`` (or ``target_shape`` floats / ints)."""

    def __init__(self, n: int, shape: tuple[int, ...], *, vocab: int | None = None,
                 classes: int | None = None, target_shape: tuple[int, ...] = (),
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        if vocab is None:
            self.x = torch.randn(n, *shape, generator=gen)
        else:
            self.x = torch.randint(0, vocab, (n, *shape), generator=gen)
        if classes is not None:
            self.y = torch.randint(0, classes, (n, *target_shape), generator=gen)
        else:
            self.y = torch.randn(n, *target_shape, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[idx], self.y[idx]


# ------------------------------------------------------------------------------------ MLP


def mlp(width: int = 512, depth: int = 6, d_in: int = 256, classes: int = 10) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(d_in, width), nn.GELU())]
    layers += [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth - 2)]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------------ conv net


class _ConvBlock(nn.Sequential):
    def __init__(self, cin: int, cout: int, pool: bool) -> None:
        mods: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout),
                                 nn.ReLU()]
        if pool:
            mods.append(nn.MaxPool2d(2))
        super().__init__(*mods)


class _Head(nn.Sequential):
    def __init__(self, c: int, classes: int) -> None:
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


def convnet(classes: int = 10) -> nn.Sequential:
    return nn.Sequential(_ConvBlock(3, 32, False), _ConvBlock(32, 32, True),
                         _ConvBlock(32, 64, False), _ConvBlock(64, 64, True),
                         _ConvBlock(64, 128, True), _Head(128, classes))


# ------------------------------------------------------------------------------------ mixer


class _Patches(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2).contiguous()  # (B, tokens, dim)


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(tokens, token_hidden), nn.GELU(),
                                 nn.Linear(token_hidden, tokens))
        self.ch = nn.Sequential(nn.Linear(dim, channel_hidden), nn.GELU(),
                                nn.Linear(channel_hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class _MixerHead(nn.Module):
    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(1))


def mixer(image: int = 32, patch: int = 4, dim: int = 96, depth: int = 6,
          classes: int = 10) -> nn.Sequential:
    tokens = (image // patch) ** 2
    return nn.Sequential(_Patches(patch, dim),
                         *[_MixerBlock(tokens, dim, 2 * tokens, 2 * dim) for _ in range(depth)],
                         _MixerHead(dim, classes))


# ------------------------------------------------------------------------------------ DLRM


class _Embed(nn.Module):
    """Sparse features (one id per table) and dense features in one int tensor: the first
    ``tables`` columns are ids, the rest are dense values x 1000 (kept integral)."""

    def __init__(self, tables: int, rows: int, dim: int, dense: int) -> None:
        super().__init__()
        self.tables = tables
        self.emb = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, dense = x[:, :self.tables], x[:, self.tables:].float() / 1000.0
        vecs = [e(ids[:, i]) for i, e in enumerate(self.emb)] + [self.bottom(dense)]
        return torch.stack(vecs, 1)  # (B, tables + 1, dim)


class _Interact(nn.Module):
    def forward(self, v: torch.Tensor) -> torch.Tensor:
        z = v @ v.transpose(1, 2)
        i, j = torch.triu_indices(v.shape[1], v.shape[1], 1)
        return torch.cat([v[:, -1], z[:, i, j]], 1)


def dlrm(tables: int = 8, rows: int = 4000, dim: int = 32, dense: int = 13) -> nn.Sequential:
    f = tables + 1
    inter = dim + f * (f - 1) // 2
    return nn.Sequential(_Embed(tables, rows, dim, dense), _Interact(),
                         nn.Sequential(nn.Linear(inter, 256), nn.ReLU()),
                         nn.Sequential(nn.Linear(256, 128), nn.ReLU()), nn.Linear(128, 1))


class _DlrmData(_Data):
    def __init__(self, n: int = 4096, tables: int = 8, rows: int = 4000, dense: int = 13,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, rows, (n, tables), generator=gen)
        vals = (torch.rand(n, dense, generator=gen) * 1000).long()
        self.x = torch.cat([ids, vals], 1)
        self.y = torch.randint(0, 2, (n, 1), generator=gen).float()


def _bce(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(pred, y)


def _ce(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), y.reshape(-1))


def _gpt() -> nn.Module:
    from elastic.models import gpt

    return gpt(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128)


# ------------------------------------------------------------------- held-out families


class _ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet(classes: int = 10) -> nn.Sequential:
    stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
    return nn.Sequential(stem, _ResBlock(32, 32, 1), _ResBlock(32, 64, 2), _ResBlock(64, 64, 1),
                         _ResBlock(64, 128, 2), _Head(128, classes))


class _Lstm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(dim, dim, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def lstm(vocab: int = 96, dim: int = 192, layers: int = 2) -> nn.Sequential:
    return nn.Sequential(nn.Embedding(vocab, dim), *[_Lstm(dim) for _ in range(layers)],
                         nn.Linear(dim, vocab))


class _Bag(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, dim, mode="mean")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.emb(x)


def bow(vocab: int = 20_000, dim: int = 128, classes: int = 4) -> nn.Sequential:
    return nn.Sequential(_Bag(vocab, dim), nn.Sequential(nn.Linear(dim, 256), nn.ReLU()),
                         nn.Linear(256, classes))


# ------------------------------------------------------------- second held-out set


class _VitPatches(nn.Module):
    def __init__(self, patch: int, dim: int, tokens: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, tokens, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos


def vit(image: int = 32, patch: int = 4, dim: int = 128, depth: int = 4, heads: int = 4,
        classes: int = 10) -> nn.Sequential:
    tokens = (image // patch) ** 2
    return nn.Sequential(
        _VitPatches(patch, dim, tokens),
        *[nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True,
                                     norm_first=True) for _ in range(depth)],
        _MixerHead(dim, classes))


def autoenc() -> nn.Sequential:
    def up(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1), nn.GroupNorm(8, cout),
                             nn.ReLU())
    return nn.Sequential(_ConvBlock(3, 32, True), _ConvBlock(32, 64, True),
                         _ConvBlock(64, 128, True), up(128, 64), up(64, 32),
                         nn.ConvTranspose2d(32, 3, 4, 2, 1))


def _mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred, y)


class _ImageTargets(_Data):
    """Images whose targets are the images themselves (an autoencoder's)."""

    def __init__(self, n: int) -> None:
        super().__init__(n, (3, 32, 32), target_shape=(1,))
        self.y = self.x


def wide(d_in: int = 512, width: int = 2048, classes: int = 100) -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Linear(d_in, width), nn.ReLU()),
                         nn.Sequential(nn.Linear(width, width), nn.ReLU()),
                         nn.Linear(width, width), nn.Sequential(nn.ReLU(),
                                                                nn.Linear(width, classes)))


@dataclass(frozen=True)
class Family:
    """A model family: its factory, dataset factory, loss and global batch."""

    name: str
    model: Callable[[], nn.Module]
    dataset: Callable[[], Any]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    global_batch: int


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("mlp", functools.partial(mlp),
           functools.partial(_Data, 4096, (256,), classes=10), _ce, 128),
    Family("convnet", functools.partial(convnet),
           functools.partial(_Data, 2048, (3, 32, 32), classes=10), _ce, 64),
    Family("gpt", _gpt,
           functools.partial(_Data, 2048, (64,), vocab=96, classes=96, target_shape=(64,)),
           _ce, 32),
    Family("mixer", functools.partial(mixer),
           functools.partial(_Data, 2048, (3, 32, 32), classes=10), _ce, 64),
    Family("dlrm", functools.partial(dlrm), functools.partial(_DlrmData), _bce, 256),
)}

HELD_OUT: dict[str, Family] = {f.name: f for f in (
    Family("resnet", functools.partial(resnet),
           functools.partial(_Data, 2048, (3, 32, 32), classes=10), _ce, 64),
    Family("lstm", functools.partial(lstm),
           functools.partial(_Data, 2048, (48,), vocab=96, classes=96, target_shape=(48,)),
           _ce, 32),
    Family("bow", functools.partial(bow),
           functools.partial(_Data, 4096, (64,), vocab=20_000, classes=4), _ce, 128),
)}

HELD_OUT_2: dict[str, Family] = {f.name: f for f in (
    Family("vit", functools.partial(vit),
           functools.partial(_Data, 2048, (3, 32, 32), classes=10), _ce, 64),
    Family("autoenc", autoenc, functools.partial(_ImageTargets, 2048), _mse, 64),
    Family("wide", functools.partial(wide),
           functools.partial(_Data, 4096, (512,), classes=100), _ce, 128),
)}

ALL: dict[str, Family] = {**FAMILIES, **HELD_OUT, **HELD_OUT_2}
