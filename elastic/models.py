"""Built-in models, losses and datasets for tests and the demo.

Everything here is a plain top-level factory, class or function, so a job config can name it
by import string (``"elastic.models:gpt"``), wrap it in ``functools.partial`` and ship it to
workers by pickle.

Models are *pipeline-ready*: each is an ``nn.Sequential`` whose children take one tensor and
return one tensor, so any run of consecutive children is a valid pipeline stage, and a slice
``model[a:b]`` keeps the parameter names (``"<index>.<name>"``) of the full model. No
parameter is shared between children (the GPT head is not tied to the token embedding).

- ``tiny_mlp`` + ``mlp_loss`` + ``SyntheticRegression``: a small regression problem for tests.
- ``gpt`` (a ``TinyGPT``) + ``gpt_loss`` + ``CharDataset`` / ``demo_dataset``: a character
  language model trained on the public-domain text shipped in ``elastic/demo_data``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "tiny_mlp",
    "mlp_loss",
    "SyntheticRegression",
    "GPTConfig",
    "Embedding",
    "CausalSelfAttention",
    "TransformerBlock",
    "LMHead",
    "TinyGPT",
    "gpt",
    "gpt_loss",
    "CharDataset",
    "demo_text",
    "demo_dataset",
    "generate",
]


# --------------------------------------------------------------------------------------------
# MLP regression (tests)
# --------------------------------------------------------------------------------------------


def tiny_mlp(
    in_features: int = 16, hidden: int = 32, out_features: int = 4, depth: int = 3
) -> nn.Sequential:
    """A ``depth``-layer tanh MLP as an ``nn.Sequential`` of ``depth`` children.

    Children ``0 .. depth-2`` are ``Sequential(Linear, Tanh)``, the last is a ``Linear``, so
    every child holds parameters and the model splits into up to ``depth`` pipeline stages.
    Deterministic given ``torch.manual_seed``.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    widths = [in_features] + [hidden] * (depth - 1) + [out_features]
    layers: list[nn.Module] = []
    for i in range(depth):
        lin = nn.Linear(widths[i], widths[i + 1])
        layers.append(lin if i == depth - 1 else nn.Sequential(lin, nn.Tanh()))
    return nn.Sequential(*layers)


def mlp_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all elements."""
    return F.mse_loss(pred, target)


class SyntheticRegression:
    """A fixed, seeded regression dataset: ``y = sin(x @ A) @ B / sqrt(k) + 0.05 * noise``.

    Map-style: ``len(ds) == n``, ``ds[i] -> (x_i, y_i)`` (float32 vectors of ``in_features``
    and ``out_features``), ``ds.get_batch(indices) -> (X, Y)`` vectorised. The data depend
    only on the constructor arguments, never on the global RNG.
    """

    def __init__(
        self, n: int = 1024, in_features: int = 16, out_features: int = 4, seed: int = 0,
        sample_seed: int | None = None,
    ) -> None:
        self.n = n
        self.in_features = in_features
        self.out_features = out_features
        self.seed = seed
        self.sample_seed = sample_seed
        gen = torch.Generator().manual_seed(seed)
        k = 2 * in_features
        a = torch.randn(in_features, k, generator=gen) / math.sqrt(in_features)
        b = torch.randn(k, out_features, generator=gen) / math.sqrt(k)
        if sample_seed is not None:  # other samples of the same function: a held-out set
            gen = torch.Generator().manual_seed(10_000 + sample_seed)
        self.x = torch.randn(n, in_features, generator=gen)
        noise = torch.randn(n, out_features, generator=gen)
        self.y = torch.sin(self.x @ a) @ b + 0.05 * noise

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.n <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        return self.x[i], self.y[i]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``indices`` (a 1-D LongTensor) of X and Y."""
        return self.x[indices], self.y[indices]


# --------------------------------------------------------------------------------------------
# TinyGPT
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """Hyper-parameters of a ``TinyGPT``."""

    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 96
    dropout: float = 0.0


class Embedding(nn.Module):
    """First pipeline block: token ids ``(B, T)`` int64 -> ``(B, T, C)`` token + position."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention via ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class TransformerBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LMHead(nn.Module):
    """Last pipeline block: final LayerNorm and a linear head to ``(B, T, vocab_size)`` logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))


class TinyGPT(nn.Sequential):
    """A small GPT-style character LM laid out as ``nn.Sequential`` blocks.

    Children: ``0`` an ``Embedding``, ``1 .. n_layer`` ``TransformerBlock``s, ``n_layer + 1``
    an ``LMHead``; ``len(model) == n_layer + 2``. Input ``(B, T)`` int64 token ids with
    ``T <= block_size``, output ``(B, T, vocab_size)`` logits. A slice ``model[a:b]`` is a
    plain ``nn.Sequential`` of the same block objects, with the full model's names.

    Weights are initialised GPT-2 style (normal(0, 0.02), residual projections scaled by
    ``1/sqrt(2 * n_layer)``), deterministically given ``torch.manual_seed``.
    """

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 96,
        dropout: float = 0.0,
    ) -> None:
        cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout)
        super().__init__(
            Embedding(cfg), *(TransformerBlock(cfg) for _ in range(n_layer)), LMHead(cfg)
        )
        self.config = cfg
        self._init_weights()

    def _init_weights(self) -> None:
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                std = resid_std if name.endswith(("attn.proj", "mlp.2")) else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def __getitem__(self, idx: slice | int) -> nn.Module:  # type: ignore[override]
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gpt(
    vocab_size: int | None = None,
    block_size: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 96,
    dropout: float = 0.0,
) -> TinyGPT:
    """Factory for a ``TinyGPT``; ``vocab_size=None`` means the vocabulary of the demo corpus.

    The defaults (4 layers, 4 heads, ``n_embd=96``, 0.47M parameters with the 75-character
    demo vocabulary) train one Adam step of 16 x 64 tokens in roughly 55 ms on one CPU thread;
    ``n_embd=128`` (0.82M) takes roughly 85 ms.
    """
    if vocab_size is None:
        vocab_size = len(_demo_vocab())
    return TinyGPT(vocab_size, block_size, n_layer, n_head, n_embd, dropout)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over all tokens: logits ``(B, T, V)``, targets ``(B, T)`` int64."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------
# Character data
# --------------------------------------------------------------------------------------------


class CharDataset:
    """Character-level next-token dataset over ``text``.

    Item ``i`` is ``(tokens[i : i+T], tokens[i+1 : i+T+1])`` as int64 tensors of length
    ``T = block_size``; ``len(ds) == len(text) - block_size``. ``vocab`` is the sorted tuple
    of distinct characters (or the ``vocab`` given, which must cover ``text``). Pickles as
    its text; tokens are re-encoded on load.
    """

    def __init__(self, text: str, block_size: int = 64, vocab: Iterable[str] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if len(text) <= block_size:
            raise ValueError(f"text of {len(text)} chars is too short for block_size {block_size}")
        self.text = text
        self.block_size = block_size
        self.vocab: tuple[str, ...] = tuple(sorted(set(text) if vocab is None else set(vocab)))
        self._setup()

    def _setup(self) -> None:
        self.stoi = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = self.encode(self.text)
        self._window = torch.arange(self.block_size + 1)

    def __getstate__(self) -> dict[str, Any]:
        return {"text": self.text, "block_size": self.block_size, "vocab": self.vocab}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, s: str) -> torch.Tensor:
        """``s`` as a 1-D int64 tensor of token ids; raises ``ValueError`` on unknown chars."""
        try:
            return torch.tensor([self.stoi[ch] for ch in s], dtype=torch.long)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | Iterable[int]) -> str:
        """Token ids (a tensor or any iterable of ints) back to a string."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.vocab[i] for i in ids)

    def __len__(self) -> int:
        return len(self.tokens) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        i %= n
        chunk = self.tokens[i : i + self.block_size + 1]
        return chunk[:-1].clone(), chunk[1:].clone()

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(X, Y)``, each ``(len(indices), block_size)`` int64, for non-negative indices."""
        chunks = self.tokens[indices.reshape(-1, 1) + self._window]
        return chunks[:, :-1].contiguous(), chunks[:, 1:].contiguous()


@lru_cache(maxsize=1)
def demo_text() -> str:
    """The shipped demo corpus: every ``elastic/demo_data/*.txt``, by name, blank-line joined."""
    root = resources.files("elastic").joinpath("demo_data")
    files = sorted((f for f in root.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    if not files:
        raise FileNotFoundError("no elastic/demo_data/*.txt found in the installed package")
    return "\n\n".join(f.read_text(encoding="utf-8").strip("\n") for f in files) + "\n"


@lru_cache(maxsize=1)
def _demo_vocab() -> tuple[str, ...]:
    return tuple(sorted(set(demo_text())))


DEMO_EVAL_FRACTION = 0.1


def demo_dataset(block_size: int = 64, split: str = "all") -> CharDataset:
    """A ``CharDataset`` over the shipped public-domain corpus (see demo_data/README.md):
    ``split="train"`` its first 90 %, ``"eval"`` the last 10 % (held out), ``"all"`` both."""
    text = demo_text()
    cut = int(len(text) * (1 - DEMO_EVAL_FRACTION))
    parts = {"all": text, "train": text[:cut], "eval": text[cut:]}
    if split not in parts:
        raise ValueError(f"split must be one of {', '.join(parts)}, got {split!r}")
    return CharDataset(parts[split], block_size, vocab=_demo_vocab())


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


def _block_size_of(model: nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, Embedding):
            return m.block_size
    raise ValueError("model has no elastic.models.Embedding block; cannot tell its block_size")


@torch.no_grad()
def generate(
    model: nn.Module,
    dataset: CharDataset,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """Continue ``prompt`` by ``max_new_tokens`` characters; return prompt + continuation.

    ``model`` is a full (unsplit) model mapping ``(1, T)`` ids to ``(1, T, V)`` logits; the
    context is cropped to its ``block_size``. ``temperature <= 0`` is greedy decoding;
    otherwise sampling uses a private generator seeded with ``seed`` (the global RNG is
    untouched). The model's training mode is restored afterwards.
    """
    if not prompt:
        raise ValueError("prompt must contain at least one character")
    block_size = _block_size_of(model)
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = dataset.encode(prompt).to(device).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -block_size:])[0, -1].float().cpu()
            if temperature <= 0:
                nxt = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    finally:
        model.train(was_training)
    return dataset.decode(idx[0])


class PerSampleCost(nn.Module):
    """The identity, sleeping ``seconds`` per sample of its input inside a process group (a
    worker) and never outside (the single-process reference): a job whose step time divides
    among its workers, as a compute-bound job's does (the scheduler's tests and bench)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            time.sleep(self.seconds * x.shape[0])
        return x
