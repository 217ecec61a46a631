"""The built-in demo: a small GPT-style character model trained on public-domain text that
ships in the package, on a local Ray cluster, with the live view. Ends with a generated sample."""

from __future__ import annotations

from typing import Any

from .config import JobConfig

__all__ = ["demo_config", "run_demo", "run_chaos_demo"]


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


def run_demo(chaos: bool = False, **overrides: Any) -> int:
    from .api import fit

    if chaos:
        return run_chaos_demo(**overrides)
    cfg = demo_config(**overrides)
    result = fit(cfg)
    return _report(cfg, result)


def _report(cfg: JobConfig, result: Any) -> int:
    first, last = result.history[0]["loss"], result.history[-1]["loss"]
    print(f"\nloss {first:.3f} -> {last:.3f} over {len(result.history)} steps "
          f"(run directory {result.run_dir})")
    evals = [(h["step"] + 1, h["eval_loss"]) for h in result.history if "eval_loss" in h]
    if evals:
        print("held-out loss: " + ", ".join(f"{v:.3f} (step {s})" for s, v in evals))
    for e in result.events:
        if e.kind in ("switch", "checkpoint", "recovered", "scaled", "evacuated"):
            print(f"  {e.kind} at step {e.step}: {e.message}")
    if cfg.sample_prompt:
        print("\nsample:\n" + sample_text(cfg, result.state_dict(), cfg.sample_prompt))
    return 0


def run_chaos_demo(**overrides: Any) -> int:
    """The demo on 3 local Ray nodes (separate raylets on this machine), with the two things
    that happen to spot servers: at 60 % of the run one node is *announced* to go (a drain
    through Ray's own path, as a cloud's preemption notice arrives, 15 s ahead): the job moves
    that node's state onto the other two at the next step boundary and goes on, and the node
    is taken away at its deadline; at 80 % another node goes *without notice*: the job
    restores the lost shard from the copy its buddy kept in memory. Prints what happened and
    what it cost."""
    import time

    from .api import submit
    from .ray_connect import LocalNodes

    overrides = {"num_workers": 3, "min_workers": 1, "max_workers": 3,
                 "peer_copies_every": 10, **{k: v for k, v in overrides.items() if v}}
    cfg = demo_config(**overrides)
    steps = cfg.max_steps
    print(f"starting 3 local Ray nodes (one worker each); a preemption notice at step "
          f"{int(steps * 0.6)}, a node lost without notice at step {int(steps * 0.8)}",
          flush=True)
    nodes = LocalNodes(3)
    try:
        handle = submit(cfg)
        drained, deadline, lost = "", 0.0, False
        while not handle.done():
            step = handle.status()["step"]
            workers = handle.controller.workers
            if not deadline and step >= steps * 0.6 and len(workers) == 3:
                drained, deadline = str(workers[-1].info["node_id"]), time.time() + 15.0
                nodes.drain(drained, 15.0, "spot instance reclaimed (elastic demo)")
            if drained and time.time() >= deadline:
                nodes.remove(drained)  # the cloud takes it at its deadline
                drained = ""
            if not lost and step >= steps * 0.8 and 2 <= len(workers) < 3:
                nodes.remove(str(workers[-1].info["node_id"]))
                lost = True
            time.sleep(0.05)
        result = handle.result()
        code = _report(cfg, result)
        print("\nwhat happened:\n" + "\n".join(_chaos_lines(result.events)))
        return code
    finally:
        nodes.shutdown()


def _chaos_lines(events: list[Any]) -> list[str]:
    out = []
    for e in events:
        d = e.data
        if e.kind == "preemption_notice":
            left = d.get("left_s")
            out.append(f"  step {e.step}: node {str(d['node'])[:8]} (rank(s) {d['ranks']}) "
                       f"announced its end, {'no deadline' if left is None else f'{left:.1f}s ahead'}")
        elif e.kind == "evacuated":
            how = ("moved onto the other workers" if d.get("path") == "move" else d.get("path"))
            out.append(f"  step {d.get('step')}: evacuated ({how}): training paused "
                       f"{d.get('pause_s', 0):.2f}s, {d.get('steps_lost', 0)} step(s) lost, "
                       "no checkpoint read, nobody restarted" if d.get("path") == "move" else
                       f"  step {d.get('step')}: evacuated ({how}), state from {d.get('source')}")
        elif e.kind == "failure" and d.get("dead_ranks"):
            out.append(f"  step {e.step}: rank(s) {d['dead_ranks']} lost without notice "
                       f"(noticed by {d.get('noticed_by') or 'the group'} in "
                       f"{d.get('detect_s', 0):.2f}s)")
        elif e.kind == "recovered":
            n = d.get("world_size")
            out.append(f"  step {e.step}: recovered from {d.get('source')} in "
                       f"{d.get('seconds', 0):.2f}s, {d.get('steps_lost', 0)} step(s) run again,"
                       f" going on with {n} worker{'' if n == 1 else 's'}")
    return out or ["  nothing (the run ended first)"]
