"""The built-in demo: a small GPT-style character model trained on public-domain text that
ships in the package, on a local Ray cluster, with the live view. Ends with a generated sample."""

from __future__ import annotations

from typing import Any

from .config import JobConfig

__all__ = ["demo_config", "run_demo"]


def demo_config(**overrides: Any) -> JobConfig:
    fields: dict[str, Any] = {
        "name": "demo",
        "model": {"target": "elastic.models:gpt", "block_size": 64, "n_layer": 2, "n_embd": 96,
                  "n_head": 4},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.0},
        "loss": "elastic.models:gpt_loss",
        "dataset": {"target": "elastic.models:demo_dataset", "block_size": 64, "split": "train"},
        # held-out loss on the corpus's last 10 % every 50 steps, and the usual GPT recipe:
        # warm-up then cosine decay, gradients clipped to norm 1
        "eval_dataset": {"target": "elastic.models:demo_dataset", "block_size": 64,
                         "split": "eval"},
        "eval_every": 50,
        "eval_batch_size": 256,
        "lr_schedule": {"name": "cosine", "warmup_steps": 20, "min_ratio": 0.1},
        "max_grad_norm": 1.0,
        "global_batch_size": 32,
        "max_steps": 200,
        "num_workers": 2,
        "strategy": "dp",
        "switch_at": {100: "zero2"},  # a live switch half-way: same trajectory, sharded state
        "checkpoint_every": 50,  # asynchronous sharded checkpoints under <run dir>/checkpoints
        "log_every": 20,
        "sample_prompt": "Shall I compare thee",
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields["max_steps"] <= 100 or fields["strategy"] != "dp":
        fields["switch_at"] = {}
    return JobConfig.from_dict(fields)


def sample_text(cfg: JobConfig, state_dict: dict[str, Any], prompt: str, n: int = 200) -> str:
    """Generate ``n`` characters from a trained model's state dict (on the CPU)."""
    from .models import generate
    from .reference import build_model

    model = build_model(cfg.model_factory(), cfg.seed)
    model.load_state_dict(state_dict)
    return generate(model, cfg.dataset_object(), prompt, max_new_tokens=n)


def run_demo(**overrides: Any) -> int:
    from .api import fit

    cfg = demo_config(**overrides)
    result = fit(cfg)
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"\nloss {first:.3f} -> {last:.3f} over {len(result.history)} steps "
          f"(run directory {result.run_dir})")
    evals = [(h["step"] + 1, h["eval_loss"]) for h in result.history if "eval_loss" in h]
    if evals:
        print("held-out loss: " + ", ".join(f"{v:.3f} (step {s})" for s, v in evals))
    for e in result.events:
        if e.kind in ("switch", "checkpoint", "recovered", "scaled"):
            print(f"  {e.kind} at step {e.step}: {e.message}")
    if cfg.sample_prompt:
        print("\nsample:\n" + sample_text(cfg, result.state_dict(), cfg.sample_prompt))
    return 0
