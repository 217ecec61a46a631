"""What ``elastic plan`` counts of a job's model (``elastic.planning.model_profile`` with a
sample): each block's FLOPs, the activations it keeps for its backward and what it hands on,
from a forward on the meta device, and the optimizer's state bytes from one step of the job's
own optimizer. Was (found by a new user, session 47): no activations at all (a 1.4 B GPT was
planned at 13.6 GB per device without accumulation; it needs 56 GB), an embedding table
charged as a matmul over its ids (a recommendation model ~1000x too slow), SGD with momentum
at 0 bytes, and the model built with real weights in host memory (a 7 B model would not fit).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clusters import load_cluster, plan
from elastic.models import gpt
from elastic.planning import model_profile, optimizer_bytes, sample_costs


def test_optimizer_bytes_come_from_a_step_of_the_jobs_optimizer():
    assert optimizer_bytes({"name": "adam", "lr": 1e-3}, 0) == 8
    assert optimizer_bytes({"name": "sgd", "lr": 0.1}, 8) == 0
    assert optimizer_bytes({"name": "sgd", "lr": 0.1, "momentum": 0.9}, 0) == 4
    assert optimizer_bytes(lambda ps: torch.optim.Adagrad(ps, lr=0.1), 0) == 4
    assert optimizer_bytes("no.such:optimizer", 7) == 7  # (cannot be built: the name's)


class Rec(nn.Module):
    """A recommendation-style model: 26 sparse ids per sample looked up in one table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100_000, 16)
        self.top = nn.Sequential(nn.Linear(26 * 16, 64), nn.ReLU(), nn.Linear(64, 1))

    def pipeline_blocks(self):
        return [("emb", self.emb), ("top", self.top)]

    def forward(self, x):
        return self.top(self.emb(x).flatten(1))


def test_sample_costs_count_matmuls_not_lookups_and_the_activations_kept():
    with torch.device("meta"):
        model = Rec()
    x = torch.randint(0, 100_000, (2, 26), device="meta")
    flops, kept, sent = sample_costs([model.emb, nn.Sequential(nn.Flatten(), model.top)], x)
    assert flops[0] == 0  # a lookup (was: 6 x 1.6 M parameters x 26 "tokens")
    assert flops[1] == 3 * 2 * (26 * 16 * 64 + 64 * 1)  # forward x 3, per sample
    assert sent == (26 * 16 * 4, 4)  # each block's output, fp32 bytes per sample
    assert kept[1] >= 26 * 16 * 4 + 64 * 4  # the top's inputs and its hidden layer
    with torch.device("meta"):  # data-dependent control flow cannot run on meta: None
        branchy = nn.Linear(4, 4)
    branchy.forward = lambda h: h if bool(h.sum() > 0) else h  # type: ignore[method-assign]
    assert sample_costs([branchy], torch.zeros(2, 4, device="meta")) is None


def test_a_language_models_plan_counts_its_activations():
    """A GPT whose activations dwarf its weights on a small GPU: with the sample counted, the
    plan holds the activations (accumulation where they do not fit) and says a peak above
    the model states."""
    with torch.device("meta"):
        model = gpt(vocab_size=256, block_size=512, n_layer=4, n_head=4, n_embd=256)
    x = torch.zeros(2, 512, dtype=torch.long, device="meta")
    bare = model_profile(model, {"name": "adamw"})
    counted = model_profile(model, {"name": "adamw"}, sample=x)
    assert bare.activation_bytes is None and counted.activation_bytes is not None
    per_sample = sum(counted.activation_bytes)
    assert per_sample > 20 * 4 * 256 * 512  # (several tensors of B x T x C per block)
    assert counted.boundary_bytes[0] == 512 * 256 * 4  # the embedding's output
    cluster = load_cluster({"name": "t", "pools": [{"name": "t4", "device": "T4", "nodes": 1,
                                                     "devices_per_node": 2}]})
    g = 1024
    chosen = plan(cluster, counted, g).choice
    assert chosen is not None
    peak = max(chosen.estimate.memory, key=lambda m: m.total)
    assert peak.activations > peak.model_states  # was 0: states only
    assert chosen.plan.micro_batches > 1  # 1024 x 512 tokens do not fit two T4s in one pass
    bare_choice = plan(cluster, bare, g).choice  # (what it was: weights only, 28 MB)
    assert bare_choice is not None and bare_choice.estimate.peak_memory < 1e9


def test_frozen_weights_are_held_without_gradients_or_optimizer_state():
    """A frozen backbone's weights take memory on every device (a 1/n shard under zero3),
    with no gradient or optimizer state. Was: not counted at all (a 2 GB backbone planned at
    70 MB per device)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 8))
    for layer in list(model)[:2]:
        layer.requires_grad_(False)
    prof = model_profile(model, {"name": "adam"})
    frozen = 2 * (4096 * 4096 + 4096)
    assert prof.frozen() == frozen and prof.n_params == 4096 * 8 + 8
    cluster = load_cluster({"name": "t", "pools": [{"name": "a", "device": "A100-80GB",
                                                     "nodes": 1, "devices_per_node": 4}]})
    by = {c.plan.strategy: c for c in plan(cluster, prof, 64).ranked if not c.plan.is_pipeline}
    assert by["dp"].estimate.memory[0].params >= frozen * 4
    assert by["dp"].estimate.memory[0].grads < 1e6 and by["dp"].estimate.memory[0].optimizer < 1e6
    assert by["zero3"].estimate.memory[0].params == pytest.approx(
        (frozen + prof.n_params) * 4 / 4, rel=1e-6)
