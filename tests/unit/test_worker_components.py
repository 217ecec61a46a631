"""The worker's components without Ray: the error boundary, fault injection, held state and
the step loop, in one process over a gloo group of world size 1 (formed on a free localhost
port by ``Membership.join`` and left after each test)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastic.config import JobConfig
from elastic.errors import CheckpointCorruptError, ConfigError, GroupError, WorkerError
from elastic.reference import reference_train
from elastic.worker.boundary import guarded
from elastic.worker.checkpointing import Checkpointing
from elastic.worker.faults import FaultInjected, Faults
from elastic.worker.held_state import HeldState
from elastic.worker.inputs import JobData
from elastic.worker.layout import Layout
from elastic.worker.loop import StepLoop
from elastic.worker.membership import Membership
from elastic.worker.profiling import Profiler
from strategies import StrategySpec, health
from tests.helpers import RegressionData, adam, mlp, mse
from tests.mp_harness import free_port

G = 8
TOL = 1e-6


def _cfg(tmp_path: Any, **kw: Any) -> JobConfig:
    base: dict[str, Any] = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                                global_batch_size=G, max_steps=100, num_workers=1, max_workers=4,
                                run_dir=str(tmp_path / "run"))
    base.update(kw)
    cfg = JobConfig(**base)
    cfg.validate()
    return cfg


@pytest.fixture
def group():
    """This process as rank 0 of a world of 1 (gloo on localhost), left after the test."""
    health.record("left over from an earlier group")  # join must forget it
    m = Membership("gloo", torch.device("cpu"))
    m.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
    assert health.failed() is None
    yield m
    m.leave()
    health.reset()


def _parts(cfg: JobConfig, m: Membership, **faults: Any) -> SimpleNamespace:
    """The components as the actor wires them, without the actor."""
    data, held = JobData(cfg), HeldState()
    model_factory, loss_fn = cfg.model_factory(), cfg.loss_fn()
    profiler = Profiler(cfg, m.device, data, model_factory, loss_fn)
    layout = Layout(cfg, m, held, data, model_factory, loss_fn, on_built=profiler.install)
    checkpoints = Checkpointing(cfg, m, layout)
    loop = StepLoop(cfg, m, layout, data, checkpoints, profiler, Faults(cfg, **faults))
    return SimpleNamespace(data=data, held=held, layout=layout, loop=loop)


def _spec(name: str = "dp") -> StrategySpec:
    return StrategySpec(name, 1, (G,))


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model/"):]: v for k, v in state.items() if k.startswith("model/")}


def _diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    got = _params(state)
    assert got.keys() == ref.keys()
    return max(float((got[k] - v).abs().max()) for k, v in ref.items())


# ----------------------------------------------------------------------- the error boundary

def _user_code() -> None:
    raise ValueError("bad on purpose")


def test_a_user_exception_is_a_worker_error_with_its_traceback():
    with pytest.raises(WorkerError) as ei:
        guarded(3, _user_code)
    err = ei.value
    assert err.rank == 3 and "ValueError: bad on purpose" in str(err)
    assert "_user_code" in err.traceback_text and "test_worker_components.py" in err.traceback_text
    # raised outside the handler: nothing holds the failed call's frames
    assert err.__context__ is None and err.__cause__ is None


def test_an_exception_raised_inside_torch_distributed_is_a_group_error(group):
    with pytest.raises(GroupError, match="rank 0: the process group failed") as ei:
        guarded(0, dist.broadcast, torch.zeros(1), 1)  # no rank 1 in a world of 1
    assert ei.value.__context__ is None


def test_a_recorded_collective_failure_makes_any_error_a_group_error(group):
    health.record("dp gradient all-reduce: RuntimeError")
    with pytest.raises(GroupError, match="dp gradient all-reduce"):
        guarded(0, _user_code)
    # a new group starts healthy: the same error is the user's again
    group.leave()
    group.join("127.0.0.1", free_port(), 0, 1, 2, 30.0)
    with pytest.raises(WorkerError):
        guarded(0, _user_code)


def test_elastic_errors_pass_the_boundary_unchanged(group):
    health.record("a collective failed")
    corrupt = CheckpointCorruptError("shard-00000.bin: checksum mismatch")

    def read() -> None:
        raise corrupt

    with pytest.raises(CheckpointCorruptError) as ei:
        guarded(0, read)
    assert ei.value is corrupt


# ----------------------------------------------------------------------- fault injection

def test_faults_are_validated_naming_the_entry(tmp_path):
    ok = {"rank": 0, "step": 1, "action": "pause"}
    for bad, words in [({"rank": 0, "step": 1, "action": "explode"}, "unknown action"),
                       ({"rank": "0", "step": 1, "action": "exit"}, "rank must be an integer"),
                       ({"rank": 0, "step": True, "action": "exit"}, "step must be an integer"),
                       ({"rank": 0, "step": -1, "action": "exit"}, "step must be an integer"),
                       ({"rank": 0, "action": "exit"}, "is not a fault"),
                       ({"rank": 0, "step": 1, "action": "exit", "when": 3}, "is not a fault"),
                       ({"rank": 0, "step": 1, "action": "slow"}, "they need it"),
                       ({"rank": 0, "step": 1, "action": "slow_upload"}, "they need it"),
                       ({"rank": 0, "step": 1, "action": "exit", "seconds": 1}, "goes with"),
                       ({"rank": 0, "step": 1, "action": "slow", "seconds": 0}, "seconds"),
                       # a misspelt action is said so, not "factor goes with slowdown"
                       ({"rank": 0, "step": 1, "action": "slow_down", "factor": 6},
                        "unknown action 'slow_down'"),
                       # a rank the job never has (up to max_workers 4): it would never fire
                       ({"rank": 4, "step": 1, "action": "exit"}, "would never fire")]:
        with pytest.raises(ConfigError) as ei:
            _cfg(tmp_path, faults=[ok, bad])
        assert ei.value.field.startswith("faults[1]") and words in str(ei.value), str(ei.value)
    with pytest.raises(ConfigError) as ei:
        _cfg(tmp_path, faults=ok)
    assert ei.value.field == "faults"


def test_a_fault_fires_once_per_job(tmp_path):
    cfg = _cfg(tmp_path, faults=[{"rank": 1, "step": 2, "action": "raise"}])
    faults = Faults(cfg)
    assert not faults.at_step(0, 2, 1) and not faults.at_step(1, 1, 1)
    with pytest.raises(FaultInjected, match="rank 1, step 2"):
        faults.at_step(1, 2, 1)
    assert os.path.exists(tmp_path / "run" / "faults" / "fired-rank1-step2")
    assert not faults.at_step(1, 2, 1)
    # a recovered job replays the step, on a new worker or a new generation: no second fire
    assert not Faults(cfg).at_step(1, 2, 2)


def test_exit_pause_and_hang_act_through_their_hooks(tmp_path):
    where = str(tmp_path / "chaos")
    cfg = _cfg(tmp_path, faults=[{"rank": 0, "step": 3, "action": "pause", "dir": where},
                                 {"rank": 0, "step": 4, "action": "exit", "dir": where},
                                 {"rank": 2, "step": 4, "action": "hang", "dir": where}])
    done: list[str] = []
    faults = Faults(cfg, node_id=lambda: "node-a", block=lambda: done.append("blocked"),
                    exit=lambda code: done.append(f"exit {code}"))
    faults.at_step(0, 3, 7)
    with open(os.path.join(where, "paused-rank0-step3.json")) as f:
        paused = json.load(f)
    assert paused == {"node_id": "node-a", "pid": os.getpid(), "rank": 0, "step": 3,
                      "generation": 7}
    faults.at_step(0, 4, 7)
    faults.at_step(2, 4, 7)
    assert done == ["blocked", "exit 1", "blocked"]
    assert sorted(os.listdir(where)) == ["fired-rank0-step3", "fired-rank0-step4",
                                         "fired-rank2-step4", "paused-rank0-step3.json"]


def test_a_slowdown_fault_makes_the_rank_compute_slower_from_its_step(tmp_path):
    """The ``slowdown`` fault (a straggler that appears mid-run): from its step the rank's
    profiler emulates a device ``factor`` times slower, so its own compute figure shows it;
    the fault's settings are checked (``factor`` goes with it, at least 1)."""
    from elastic.worker.profiling import Profiler

    cfg = _cfg(tmp_path, faults=[{"rank": 1, "step": 5, "action": "slowdown", "factor": 3}])
    prof = Profiler(cfg, torch.device("cpu"), None, None, None)
    prof.set_emulation({"memory_gb": 4})
    faults = Faults(cfg, slowdown=prof.slow_down)
    faults.at_step(0, 5, 1)
    faults.at_step(1, 4, 1)
    assert prof.slowdown == 1.0
    faults.at_step(1, 5, 1)
    assert prof.slowdown == 3.0 and prof.emulation == {"memory_gb": 4, "slowdown": 3.0}
    from elastic.worker import Worker  # and a worker's own faults reach its own profiler

    w = Worker(_cfg(tmp_path, faults=[{"rank": 0, "step": 2, "action": "slowdown",
                                       "factor": 4, "dir": str(tmp_path / "w")}]), 0, False, 1)
    w.faults.at_step(0, 2, 1)
    assert w.profiler.slowdown == 4.0
    for bad in ({"rank": 0, "step": 1, "action": "slowdown"},
                {"rank": 0, "step": 1, "action": "slowdown", "factor": 0.5},
                {"rank": 0, "step": 1, "action": "slow", "factor": 2, "seconds": 1}):
        with pytest.raises(ConfigError, match=r"faults\[0\]"):
            _cfg(tmp_path, faults=[bad])


def test_hang_restore_blocks_in_the_restore_not_at_the_step(tmp_path):
    where = str(tmp_path / "chaos")
    cfg = _cfg(tmp_path, faults=[{"rank": 1, "step": 4, "action": "hang_restore", "dir": where}])
    done: list[str] = []
    faults = Faults(cfg, block=lambda: done.append("blocked"))
    assert not faults.at_step(1, 4, 1) and done == []  # training step 4: nothing
    faults.in_restore(0, 4)
    faults.in_restore(1, 3)
    assert done == []
    faults.in_restore(1, 4)
    faults.in_restore(1, 4)  # once per job
    assert done == ["blocked"] and os.listdir(where) == ["fired-rank1-step4"]


def test_a_silent_pause_mutes_the_node_watch_before_it_blocks(tmp_path):
    where = str(tmp_path / "chaos")
    cfg = _cfg(tmp_path, faults=[{"rank": 1, "step": 2, "action": "pause_silent", "dir": where}])
    done: list[str] = []
    faults = Faults(cfg, node_id=lambda: "node-b", block=lambda: done.append("blocked"),
                    mute=lambda: done.append("muted"))
    faults.at_step(1, 2, 3)
    assert done == ["muted", "blocked"]
    with open(os.path.join(where, "paused-rank1-step2.json")) as f:
        assert json.load(f)["node_id"] == "node-b"


def test_a_slow_fault_makes_that_step_wait(tmp_path):
    cfg = _cfg(tmp_path, faults=[{"rank": 1, "step": 2, "action": "slow", "seconds": 0.3}])
    faults = Faults(cfg)
    t0 = time.monotonic()
    assert not faults.at_step(1, 2, 1)
    assert time.monotonic() - t0 >= 0.3
    t0 = time.monotonic()
    faults.at_step(1, 2, 1)  # once per job
    assert time.monotonic() - t0 < 0.1


def test_a_raise_fault_is_a_user_error_and_the_replayed_step_runs(tmp_path, group):
    cfg = _cfg(tmp_path, faults=[{"rank": 0, "step": 2, "action": "raise"}])
    p = _parts(cfg, group)
    p.layout.build(_spec())
    with pytest.raises(WorkerError, match="fault injected at rank 0, step 2"):
        guarded(0, p.loop.run, 0, 4)
    assert p.layout.next_step == 2
    assert p.loop.run(2, 4) == {"status": "done", "next_step": 4}


def test_a_nan_fault_makes_that_step_non_finite_and_it_is_skipped(tmp_path, group):
    """The step's loss is NaN; the layout skips its update (its gradient norm is NaN), the
    loop records the step as skipped (on_nonfinite: skip, the default), and the parameters
    are those of the step before, bit for bit."""
    cfg = _cfg(tmp_path, faults=[{"rank": 0, "step": 1, "action": "nan"}])
    p = _parts(cfg, group)
    p.layout.build(_spec())
    p.loop.run(0, 1)
    before = _params(p.layout.strategy.full_state())
    p.loop.run(1, 2)
    metrics = p.loop.drain()
    assert math.isfinite(metrics[0]["loss"]) and math.isnan(metrics[1]["loss"])
    assert p.layout.strategy.skipped and metrics[1]["skipped"] and "skipped" not in metrics[0]
    after = _params(p.layout.strategy.full_state())
    assert all(torch.equal(after[k], v) for k, v in before.items())


# ----------------------------------------------------------------------- held state

class _PendingLayout:
    """A layout whose step's final all-reduce failed after its gradients were complete."""

    def __init__(self) -> None:
        self.w = torch.zeros(3)
        self.pending_update = True

    def held_state(self) -> dict[str, torch.Tensor]:
        return {"model/w": self.w.clone()}

    def finish_pending_step(self) -> bool:
        self.w += 1.0
        self.pending_update = False
        return True


def test_parking_a_pending_update_keeps_both_states_and_rolls_forward_once():
    held, layout = HeldState(), _PendingLayout()
    assert held.pending(layout)
    with held.lock:
        held.park(layout)
    assert held.pending(None) and held.has_state()
    assert held.snapshot is not None and held.snapshot["model/w"].eq(0).all()
    assert held.roll_forward(lambda: None)
    assert held.snapshot["model/w"].eq(1).all() and not held.pending(None)
    assert not held.roll_forward(lambda: None)
    assert held.keys(None) == {"model/w": ((3,), "float32")}


def test_a_kept_snapshot_is_not_replaced_at_park():
    held, layout = HeldState(), _PendingLayout()
    held.park(layout)
    layout.w += 5.0
    held.park(layout)  # a snapshot is kept already (a planned change took it)
    assert held.snapshot is not None and held.snapshot["model/w"].eq(0).all()


def test_parked_state_comes_back_from_peers_into_another_layout(tmp_path, group):
    """Train, park as at leave, restore from the (one) peer into zero1 and train on: the
    result is the reference's, and the new layout replaced the parked state."""
    cfg = _cfg(tmp_path)
    p = _parts(cfg, group)
    p.layout.build(_spec())
    p.loop.run(0, 3)
    with p.held.lock:  # what Worker.leave does before the group goes
        p.held.park(p.layout.strategy)
        p.layout.drop()
    assert p.layout.strategy is None and not p.held.pending(None)
    keys = p.held.keys(None)
    plan = [(k, 0, shape, dtype) for k, (shape, dtype) in sorted(keys.items())]
    state, nbytes = p.held.from_peers(plan, None, 0, group.device)
    assert nbytes > 0 and state.keys() == keys.keys()
    p.layout.restart(_spec("zero1"), state, 3)
    assert not p.held.has_state()
    assert p.loop.run(3, 6)["next_step"] == 6
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 6, seed=0)
    assert _diff(p.layout.strategy.full_state(), ref) < TOL


def test_a_full_snapshot_is_held_until_the_next_layout(tmp_path, group):
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    nbytes = p.held.snapshot_full(p.layout.strategy)
    assert nbytes == sum(t.numel() * t.element_size() for t in p.held.snapshot.values())
    held, snap = p.held.held(p.layout.strategy), p.held.snapshot
    assert snap is not None and held.keys() == snap.keys()
    assert all(held[k] is snap[k] for k in snap)  # the snapshot's own tensors, not new copies
    p.layout.build(_spec("zero1"))  # a live switch: the new layout holds the state now
    assert not p.held.has_state()


def test_a_snapshot_for_a_change_that_did_not_happen_is_dropped_when_training_goes_on(
        tmp_path, group):
    """A resize took a full snapshot, then gave up (its spare failed to start) and training
    went on: at the next leave (a node lost) the rank parks its live state, not the stale
    snapshot. Was: ``park`` kept the snapshot, and the recovery restored it "from peers, no
    step lost" at the later step: the updates between the two were dropped silently."""
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.held.snapshot_full(p.layout.strategy)
    assert p.loop.run(0, 3)["next_step"] == 3
    live = {k: v.clone() for k, v in p.layout.strategy.full_state().items()}
    with p.held.lock:
        p.held.park(p.layout.strategy)
    assert p.held.snapshot is not None and _diff(p.held.snapshot, _params(live)) == 0
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 3, seed=0)
    assert _diff(p.held.snapshot, ref) < TOL


def test_a_build_that_fails_keeps_the_held_state_for_the_next_recovery(tmp_path, group,
                                                                      monkeypatch):
    """A restore from peers whose new layout fails to build (a peer lost in its collectives)
    leaves the parked state held: the next recovery still finds it. Was: cleared before the
    build, on every survivor alike (the state then came from a checkpoint, or step 0)."""
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.loop.run(0, 3)
    with p.held.lock:
        p.held.park(p.layout.strategy)
        p.layout.drop()
    parked = dict(p.held.snapshot)
    state, _ = p.held.from_peers([(k, 0, sh, dt) for k, (sh, dt) in sorted(
        p.held.keys(None).items())], None, 0, group.device)

    def broken(spec, for_load):
        raise GroupError("rank 1 left during the new layout's subgroups")

    monkeypatch.setattr(p.layout, "_new_strategy", broken)
    with pytest.raises(GroupError):
        p.layout.restart(_spec("zero1"), state, 3)
    assert p.held.has_state() and p.held.snapshot.keys() == parked.keys()
    assert all(torch.equal(p.held.snapshot[k], v) for k, v in parked.items())


def test_a_switch_whose_way_back_fails_too_holds_the_state(tmp_path, group, monkeypatch):
    """A live switch through a gather fails, and so does the way back to the old layout (the
    group broke): the gathered state is held, so a recovery restores it from this rank.
    Was: dropped (no layout, nothing held)."""
    p = _parts(_cfg(tmp_path, switch_move="gather"), group)
    p.layout.build(_spec())
    p.loop.run(0, 3)
    before = {k: v.clone() for k, v in p.layout.strategy.full_state().items()}

    def broken(spec, for_load):
        raise GroupError("a peer left the group")

    monkeypatch.setattr(p.layout, "_new_strategy", broken)
    with pytest.raises(GroupError):
        p.layout.build(_spec("zero1"))
    assert p.layout.strategy is None and p.held.has_state()
    assert p.held.snapshot.keys() == before.keys()
    assert all(torch.equal(p.held.snapshot[k], v) for k, v in before.items())


def test_a_profile_mid_run_leaves_the_jobs_random_state_as_it_was(tmp_path, group):
    """A profile mid-run (a re-balance, a re-plan under auto) builds seeded models and runs
    them in training mode: the job's random stream (dropout's) is left as it was. Was:
    reseeded at the job's seed and advanced by a number of forwards that depended on time."""
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.loop.run(0, 2)
    torch.rand(5)  # the stream a dropout layer would have moved on (this MLP has none)
    before = torch.get_rng_state()
    p.loop._profiler.profile(4, detail=True)
    p.loop._profiler.profile_terms([G], 0, 1, lambda: None, rounds=1)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_process_new_to_the_job_that_restores_draws_a_stream_of_its_own(tmp_path, group):
    """A spare or a replacement builds its first layout to be loaded (peers', a checkpoint's
    state): its generators are seeded for its rank and the group's generation, not left at
    the process's (a fresh Ray process: torch's default seed, the same on every joiner; a
    pooled one: reset to 0). A process that built before keeps its stream through later
    builds (a switch). Was: every joiner drew the same dropout masks (found by review,
    session 44)."""
    from elastic.reference import seed_rank

    p = _parts(_cfg(tmp_path), group)
    torch.manual_seed(12345)  # whatever the process held
    p.layout._new_strategy(_spec(), for_load=True)  # noqa: SLF001
    got = torch.rand(3)
    seed_rank(0, group.rank, group.generation)
    assert torch.equal(got, torch.rand(3))
    before = torch.get_rng_state()
    p.layout._new_strategy(_spec(), for_load=True)  # noqa: SLF001
    assert torch.equal(torch.get_rng_state(), before)


def test_a_worker_that_reads_another_dataset_length_than_the_job_refuses_to_train(tmp_path):
    """The driver read 256 samples when the job started (preflight); a worker that joins
    later reads 300 (a Parquet prefix that gained a file, a factory reading "latest" data):
    its sample order would be another permutation. It refuses, naming the dataset and the
    fix. Was: trained on, silently (each step mixing slices of two orders)."""
    from elastic.worker.inputs import JobData

    cfg = _cfg(tmp_path)
    cfg.dataset_length = 256
    assert len(JobData(cfg.for_worker()).sampler.indices(0)) == G  # the length it read
    grown = _cfg(tmp_path, dataset=RegressionData(300))
    grown.dataset_length = 256
    with pytest.raises(ConfigError, match=r"dataset: this worker reads 300 samples, where the "
                                          r"job read 256"):
        JobData(grown.for_worker()).load()


# ----------------------------------------------------------------------- the step loop

def test_the_step_loop_trains_like_the_reference(tmp_path, group):
    steps = 6
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    assert p.loop.run(0, steps) == {"status": "done", "next_step": steps}
    ref, ref_losses = reference_train(mlp, adam, mse, RegressionData(), G, steps, seed=0)
    assert _diff(p.layout.strategy.full_state(), ref) < TOL
    metrics = p.loop.drain()
    assert [m["step"] for m in metrics] == list(range(steps))
    assert all(m["global_samples"] == G and m["range"] == [0, G] for m in metrics)
    assert max(abs(m["loss"] - r) for m, r in zip(metrics, ref_losses, strict=True)) < TOL
    assert p.loop.drain() == []


def test_a_stop_request_ends_the_segment_at_a_step_boundary(tmp_path, group):
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.loop.request_stop()  # asked before the segment: run clears it
    assert p.loop.run(0, 3)["status"] == "done"
    seen: list[int] = []

    def ask_after_step_1(mod: Any, args: Any) -> None:
        seen.append(1)
        if len(seen) == 2:
            p.loop.request_stop()

    p.layout.strategy.local_model().register_forward_pre_hook(ask_after_step_1)
    out = p.loop.run(3, 10)
    # asked during step 4: a group of one reads it with step 4's values at once and stops at
    # step 4's end (in a larger group every rank reads it after step 5's compute: the
    # control all-reduce overlaps the next step, and next_step would be 6)
    assert out == {"status": "stopped", "next_step": 5}


def test_a_pruners_gate_stops_the_loop_at_its_decision_step(tmp_path, group):
    """A sweep pruner's gate (``clusters.sweep_policy.PruneGate``): the loop applies it to the
    loss agreed at its step and stops there when it prunes (the step's metric says so); a
    gate that does not prune, or whose earlier losses this rank does not hold, does not."""
    from clusters.sweep_policy import PruneGate

    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.loop.set_gate(PruneGate(4, 1e9, None, -1, False, 1))  # every loss is better: go on
    assert p.loop.run(0, 6) == {"status": "done", "next_step": 6}
    first = p.loop.drain()
    assert len(first) == 6 and all("gate" not in m for m in first)
    losses = {m["step"]: m["loss"] for m in first}
    # steps 6..8 not run yet; the gate at 8 takes steps 6..8 from the loop (the driver has
    # up to 5): the best of them is worse than a threshold below every loss so far
    p.loop.set_gate(PruneGate(8, min(losses.values()) / 100, min(losses.values()), 5,
                              False, 2))
    assert p.loop.run(6, 20) == {"status": "stopped", "next_step": 9}
    metrics = p.loop.drain()
    assert [m["step"] for m in metrics] == [6, 7, 8]
    assert metrics[-1]["gate"] == "prune" and metrics[-1]["gate_time"] >= metrics[-1]["time"]
    # a gate needing losses this rank never agreed on (steps 20..29: it resumed at 30) is
    # not applied: the driver decides
    p.loop.set_gate(PruneGate(31, 1e-9, None, 19, False, 3))
    assert p.loop.run(30, 34) == {"status": "done", "next_step": 34}
    assert all("gate" not in m for m in p.loop.drain())


def _listening(port: int) -> set[str]:
    """The local addresses listening on ``port`` (from /proc/net/tcp and tcp6)."""
    out = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(name).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, p = local.rpartition(":")
            if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                out.add(addr)
    return out


def test_rank_0s_store_listens_on_the_nodes_address_only():
    """The rendezvous store has no authentication: rank 0 hosts it on a socket bound to its
    node's address, never on every interface (docs/security.md)."""
    m = Membership("gloo", torch.device("cpu"))
    port = m.open_port("127.0.0.1")
    try:
        m.join("127.0.0.1", port, 0, 1, 1, 30.0)
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 00000000 (0.0.0.0)
        t = torch.ones(2)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        m.leave()


def test_a_failed_store_leaves_no_descriptor_to_close_twice():
    """Rank 0's store takes over the listening socket and closes it even when forming fails
    (a peer that never joins). Membership must not close that descriptor number again later
    (the next ``open_port``): by then it may belong to another socket of the process (a gloo
    pair's, Ray's), which would be closed under its user."""
    m = Membership("gloo", torch.device("cpu"))
    port = m.open_port("127.0.0.1")
    assert m._listener is not None
    n = m._listener.fileno()
    with pytest.raises(Exception, match="(?i)timed out|clients"):
        m.join("127.0.0.1", port, 0, 2, 1, 1.0)  # world 2: the other rank never comes
    other = os.open(os.devnull, os.O_RDONLY)
    try:
        if other != n:  # make the freed number belong to another file, as it would later
            os.dup2(other, n)
            os.close(other)
            other = n
        m.open_port("127.0.0.1")  # closes the previous listener, if Membership still has one
        os.fstat(other)  # still open: nobody closed it under us
    finally:
        os.close(other)
        m.close_port()


def test_memory_counts_never_read_the_live_state_beside_a_step(tmp_path):
    """The controller asks for memory counts on the actor's other thread while a segment
    trains. Reading the parameters, gradients and optimizer state meanwhile raced with the
    step freeing them (``zero_grad``): survivors died of heap corruption or SIGSEGV (issue
    13, 5). The counts must be read between steps only, and still come back while a
    segment runs."""
    import gc
    import threading
    import time

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        strategy = w.layout.strategy
        in_step = threading.Event()
        seen: list[bool] = []
        train_step, counts = strategy.train_step, strategy.memory_counts

        def slow_step(x: torch.Tensor, y: torch.Tensor) -> float:
            in_step.set()
            try:
                time.sleep(0.1)
                return train_step(x, y)
            finally:
                in_step.clear()

        def recorded_counts() -> dict[str, int]:
            seen.append(in_step.is_set())
            return counts()

        strategy.train_step, strategy.memory_counts = slow_step, recorded_counts
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(w.run(0, 6)))
        t.start()
        got = []
        for _ in range(3):
            assert in_step.wait(10)
            got.append(w.memory_counts())
        t.join(30)
        assert out == {"status": "done", "next_step": 6}
        assert seen and not any(seen), "memory counts were read in the middle of a step"
        assert all(g == counts() for g in got) and got[0]["params"] > 0
    finally:
        w.leave()
        health.reset()
        gc.unfreeze()


@contextlib.contextmanager
def _waiting_worker(tmp_path, steps: int, **kw: Any) -> Iterator[Any]:
    """A worker of one rank checkpointing every 2 steps, running ``steps`` on a thread,
    yielded once a due checkpoint waits for the previous one's commit (none is said);
    left after."""
    import gc
    import threading

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path, checkpoint_every=2, checkpoint_uri=str(tmp_path / "ck"), **kw),
               0, False, 1)
    try:
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        waiting = threading.Event()
        wait_idle = w.checkpoints._wait_idle

        def recorded_wait(*a: Any) -> bool:
            waiting.set()
            return wait_idle(*a)

        w.checkpoints._wait_idle = recorded_wait  # type: ignore[method-assign]
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(w.run(0, steps)))
        t.start()
        assert waiting.wait(30), "no checkpoint waited for the previous one's commit"
        yield w, t, out
    finally:
        w.leave()
        health.reset()
        gc.unfreeze()


def test_memory_counts_are_answered_while_a_due_checkpoint_waits_for_the_last_commit(tmp_path):
    """A due checkpoint waits at its boundary for the previous one's commit; the controller
    asks for the memory counts (the view's column) before it polls and commits. The loop,
    not at a step boundary it answers at, let that read time out (2 s), and only then was
    the commit made: every checkpoint of a job whose uploads outlast its checkpoint interval
    took 2 s more, with training held meanwhile (found in the suite's slowest chaos test:
    2.03 s per checkpoint of 0 MB)."""
    with _waiting_worker(tmp_path, 6) as (w, t, out):
        t0 = time.monotonic()
        counts = w.memory_counts()  # as the controller does before it commits
        assert time.monotonic() - t0 < 1.0 and counts["params"] > 0
        while t.is_alive():  # then the controller's commits, until the segment ends
            o = w.checkpoint_poll()
            if o and "info" in o:
                w.checkpoint_done(o["info"]["step"], True)
            time.sleep(0.005)
        t.join(30)
        assert out == {"status": "done", "next_step": 6}


def test_an_urgent_stop_ends_a_due_checkpoints_wait_for_the_last_commit(tmp_path):
    """A due checkpoint waits (up to checkpoint_wait_s, 60 s here) for the previous one's
    commit. A plain stop (a resize, a switch) waits on, and the checkpoint is taken once the
    commit comes; an urgent one (a preemption notice) ends the wait at once, the checkpoint
    skipped, the segment stopped. Was: the notice waited out checkpoint_wait_s and its node
    was lost at its deadline (found by a new user, session 48)."""
    with _waiting_worker(tmp_path, 100, checkpoint_wait_s=60) as (w, t, out):
        w.request_stop()  # a plain stop: the wait goes on
        t.join(1.0)
        assert t.is_alive()
        t0 = time.monotonic()
        w.request_stop(urgent=True)  # no commit is ever said
        t.join(30)
        assert not t.is_alive() and time.monotonic() - t0 < 5.0
        assert out["status"] == "stopped" and out["next_step"] < 100
        assert any("checkpoint_skipped" in mt for mt in w.drain())


def test_a_checkpoint_is_ended_only_by_a_word_naming_it_and_a_new_group_releases_it(tmp_path):
    """The controller's word on a checkpoint (commit, give up) is not waited for, and step
    numbers repeat after a restore: a late word about another step, another group's
    checkpoint or an earlier one of the same step and group (a rollback's replay) must not
    end the one a rank holds now. A checkpoint begun by an earlier
    generation is released when the rank joins the next one (nothing can commit it then);
    before that, a grown group never committed it and every later checkpoint was skipped. A
    skip says what the rank still holds, so the controller can release it."""
    import gc

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path, checkpoint_every=5, checkpoint_uri=str(tmp_path / "ck"),
                    checkpoint_wait_s=0.2), 0, False, 1)

    def settled(state: str) -> None:
        t0 = time.monotonic()
        while w.checkpoints._writer is None or w.checkpoints._writer.state != state:
            assert time.monotonic() - t0 < 30, w.checkpoints._writer.state
            time.sleep(0.005)

    try:
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        assert w.run(0, 5)["next_step"] == 5
        begun = [m for m in w.drain() if "checkpoint_begun" in m]
        assert [(m["checkpoint_begun"], m["generation"]) for m in begun] == [(5, 1)]
        settled("uploaded")
        w.checkpoint_done(5, True, 7)  # another group's word: not about this one
        w.checkpoint_done(4, False, 1)  # another step's
        assert w.checkpoints.busy
        w.join("127.0.0.1", free_port(), 0, 1, 2, 30.0)  # the next generation
        assert not w.checkpoints.busy
        w.restart_fresh(_spec("dp"), None, 5)
        w.run(5, 10)
        begun = [m for m in w.drain() if "checkpoint_begun" in m]
        assert [(m["checkpoint_begun"], m["generation"]) for m in begun] == [(10, 2)]
        settled("uploaded")
        w.checkpoint_done(10, False, 1)  # a late give-up of generation 1's step 10
        assert w.checkpoints.busy
        w.run(10, 15)  # step 15 is due while 10 waits for its commit: skipped, saying so
        skips = [m for m in w.drain() if "checkpoint_skipped" in m]
        assert [(m["checkpoint_skipped"], m["checkpoint_held"], m["checkpoint_held_gen"],
                 m["checkpoint_held_seq"]) for m in skips] == [(15, 10, 2, 1)]
        w.checkpoint_done(10, True, 2)
        assert not w.checkpoints.busy
        # a rollback on the same group: step 10 is checkpointed again, under a new name, and
        # a late word about the first one (same step, same generation) leaves it alone
        w.restart_fresh(_spec("dp"), None, 5)
        w.run(5, 10)
        begun = [m for m in w.drain() if "checkpoint_begun" in m]
        assert [(m["checkpoint_begun"], m["generation"], m["checkpoint_seq"])
                for m in begun] == [(10, 2, 2)]
        settled("uploaded")
        w.checkpoint_done(10, False, 2, 1)
        assert w.checkpoints.busy
        w.checkpoint_done(10, True, 2, 2)
        assert not w.checkpoints.busy
    finally:
        w.leave()
        health.reset()
        gc.unfreeze()


def _worker_with_hanging_uploads(tmp_path, **cfg):
    """A one-rank worker, joined and started under dp with a checkpoint every 5 steps, whose
    uploads hang in a "storage call" until ``gate`` is set (``blocked`` is released as each
    one starts hanging). Returns (worker, its checkpointing, gate, blocked)."""
    import threading

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path, checkpoint_every=5, checkpoint_uri=str(tmp_path / "ck"), **cfg),
               0, False, 1)
    gate, blocked = threading.Event(), threading.Semaphore(0)

    def storage_call(rank: int, step: int, gen: int) -> None:
        if not gate.is_set():
            blocked.release()
            gate.wait()

    w.checkpoints._in_upload = storage_call
    w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
    w.restart_fresh(_spec("dp"), None, 0)
    return w, w.checkpoints, gate, blocked


def test_stuck_uploads_hold_at_most_one_spare_host_copy_and_are_freed_when_they_return(
        tmp_path):
    """A given-up upload whose storage call does not return is set aside and the next
    checkpoint gets a new writer. Each writer holds a host copy of the rank's shard, so a
    second stuck one is not set aside too (due checkpoints are skipped, saying what is
    held); once the calls return, the one set aside is closed (its thread ended, its buffer
    freed) and checkpoints go on. Before, every stuck upload left one more writer behind,
    none ever closed, and the end of the job waited 60 s on it."""
    import gc

    w, ck, gate, blocked = _worker_with_hanging_uploads(tmp_path, checkpoint_wait_s=0.1)
    try:
        w.run(0, 5)  # checkpoint 5 begun; its upload hangs
        assert blocked.acquire(timeout=30)
        first = ck._writer
        w.checkpoint_done(5, False, 1, 1)  # given up (checkpoint_upload_timeout_s)
        w.run(5, 10)  # 10: the stuck writer is set aside, a new one takes it, and hangs
        assert blocked.acquire(timeout=30)
        second = ck._writer
        assert ck._stuck is first and second is not first and second.step == 10
        w.checkpoint_done(10, False, 1, 2)
        w.run(10, 15)  # 15: a second stuck writer is not set aside; skipped, saying so
        skips = [m for m in w.drain() if "checkpoint_skipped" in m]
        assert [(m["checkpoint_skipped"], m["checkpoint_held"]) for m in skips] == [(15, 10)]
        assert ck._writer is second and ck._stuck is first
        gate.set()  # the storage calls return: both uploads stop (they were given up)
        t0 = time.monotonic()
        while first.state == "uploading" or second.state == "uploading":
            assert time.monotonic() - t0 < 30
            time.sleep(0.01)
        w.run(15, 20)  # 20 is taken, and the writer set aside is closed
        begun = [m["checkpoint_begun"] for m in w.drain() if "checkpoint_begun" in m]
        assert begun == [20] and ck._stuck is None and ck._writer is second
        assert first._thread is None and first._staging is None
    finally:
        gate.set()
        w.leave()
        health.reset()
        gc.unfreeze()


def test_the_end_of_a_job_does_not_wait_on_a_stuck_upload_not_given_up_yet(tmp_path,
                                                                          monkeypatch):
    """The job ends (a pooled worker's reset) while an upload hangs in a storage call and
    the controller's give-up word, sent without an answer, has not arrived: the writer is
    left to its thread after ``CLOSE_WAIT_S`` and said to be stuck (the pool retires the
    worker). Before, the close waited 60 s on it and then raised, past the pool's 30 s
    budget for a reset."""
    import gc

    from elastic.worker import checkpointing

    monkeypatch.setattr(checkpointing, "CLOSE_WAIT_S", 0.5, raising=False)
    w, ck, gate, blocked = _worker_with_hanging_uploads(tmp_path)
    try:
        w.run(0, 5)  # checkpoint 5 begun; its upload hangs
        assert blocked.acquire(timeout=30)
        t0 = time.monotonic()
        left = ck.close()
        assert time.monotonic() - t0 < 2.5
        assert "checkpoint 5 is stuck in a storage call" in left
    finally:
        gate.set()
        w.leave()
        health.reset()
        gc.unfreeze()


def test_a_layouts_first_step_metrics_carry_its_memory_counts(tmp_path, group):
    """The view's memory column rides on the metrics: a layout's first step carries its
    counts (read on the training thread at that boundary), later steps do not, and a new
    layout's first step carries them again; a read afterwards comes back at once."""
    p = _parts(_cfg(tmp_path), group)
    p.layout.build(_spec())
    p.loop.run(0, 3)
    got = p.loop.drain()
    assert [("memory" in m) for m in got] == [True, False, False]
    assert got[0]["memory"] == p.layout.strategy.memory_counts()
    assert got[0]["memory"]["params"] > 0 and got[0]["memory"]["optim"] > 0
    p.layout.build(_spec("zero1"))  # a live switch: a new layout
    p.loop.run(3, 5)
    assert [("memory" in m) for m in p.loop.drain()] == [True, False]
    assert p.loop.memory_counts(0.0) == p.layout.strategy.memory_counts()


def test_memory_counts_during_long_steps_come_back_at_once_after_the_first(tmp_path):
    """The controller asks for the view's memory counts every 2 s; on steps that long each
    read waited for the next boundary (up to 2 s of each 2 spent blocked). A layout's counts
    answered at one boundary come back at once afterwards (the next boundary refreshes
    them); a new layout's are read afresh."""
    import gc
    import threading

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        strategy = w.layout.strategy
        train_step = strategy.train_step
        in_step = threading.Event()

        def slow_step(x: torch.Tensor, y: torch.Tensor) -> float:
            in_step.set()
            time.sleep(0.6)
            return train_step(x, y)

        strategy.train_step = slow_step
        t = threading.Thread(target=lambda: w.run(0, 4))
        t.start()
        assert in_step.wait(10)
        first = w.memory_counts()  # at step 0's end
        t0 = time.monotonic()
        again = w.memory_counts()
        took = time.monotonic() - t0
        t.join(30)
        assert again == first and first["params"] > 0
        assert took < 0.3, took  # not the next boundary's ~0.6 s
        # a new layout's first step: nothing cached for it; a short wait fails at its end
        w.restart_fresh(_spec("dp"), None, 4)
        strategy = w.layout.strategy
        train_step2 = strategy.train_step

        def slow_step2(x: torch.Tensor, y: torch.Tensor) -> float:
            in_step.set()
            time.sleep(0.6)
            return train_step2(x, y)

        strategy.train_step = slow_step2
        in_step.clear()
        t = threading.Thread(target=lambda: w.run(4, 6))
        t.start()
        assert in_step.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            w.memory_counts(0.1)
        assert time.monotonic() - t0 < 0.4
        t.join(30)
    finally:
        w.leave()
        health.reset()
        gc.unfreeze()


_LEAVE_PROBE = """
import gc, os, sys
from tests.unit.test_worker_components import _cfg, _spec
from tests.mp_harness import free_port
from elastic.worker import Worker
import pathlib
w = Worker(_cfg(pathlib.Path(sys.argv[2])), 0, False, 1)
w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
w.restart_fresh(_spec(sys.argv[1]), None, 0)
w.run(0, 2)
print(len(gc.get_objects()), flush=True)
w.leave()
os._exit(0)  # as a worker actor's process ends; the interpreter's own exit sometimes aborted in
             # a native thread's destructor ("terminate called without an active exception")
"""


@pytest.mark.parametrize("layout", ["dp", "zero3"])
def test_the_collection_in_leave_scans_only_the_jobs_objects(layout, tmp_path):
    """A survivor's group closes at the collection in ``leave``, and a peer blocked on it
    waits for that collection. It must not scan what start-up and the first layout imported:
    torch._dynamo's ~117k objects (DDP, FSDP and the optimizers import it) made it 50-70 ms on
    an idle core and up to 2.75 s while a new node started on the same cores. A fresh process,
    as a worker's is: in this one, earlier tests imported everything already."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _LEAVE_PROBE, layout, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, cwd=root,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr[-3000:]
    tracked = int(out.stdout.strip().splitlines()[-1])
    assert tracked < 20_000, tracked  # ~117,000 before torch._dynamo was frozen with start-up


def test_nccl_survivors_are_not_torn_down_by_default():
    """A GPU worker sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 before its first NCCL group
    (torch's default, 3, ends the whole process on a failed collective: a survivor of a
    peer's loss would die with it); a value the user set, under either name, is kept."""
    from elastic.worker.membership import nccl_env_defaults

    env: dict[str, str] = {}
    assert nccl_env_defaults(env) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        env = {name: "1"}
        assert nccl_env_defaults(env) == {} and env == {name: "1"}


@pytest.mark.parametrize("over, frozen", [(0, True), (10**9, False)])
def test_a_pooled_workers_reset_unfreezes_only_when_its_assign_froze(tmp_path, monkeypatch,
                                                                     over, frozen):
    """``assign`` freezes a job's set-up only when it is large (``_FREEZE_JOB_OVER``
    tracked objects), and the reset then unfreezes to collect it; a small one is left
    tracked and the reset leaves start-up's frozen objects alone. Without the unfreeze a
    large job's set-up would stay in the process for every later job."""
    import gc

    from elastic.worker import Worker, actor
    from elastic.worker.recycle import Baseline

    monkeypatch.setattr(actor, "_FREEZE_JOB_OVER", over)
    calls: list[dict[str, Any]] = []
    real = actor.reset_process
    monkeypatch.setattr(actor, "reset_process",
                        lambda base, **kw: calls.append(kw) or real(base, **kw))
    ray = sys.modules.get("ray")
    ray_was_up = ray is not None and ray.is_initialized()  # `pytest tests`: integration first
    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        w.baseline = Baseline.take()  # as a pooled worker's
        assert w.reset()["ok"]  # the constructor's job ends: the worker waits in the pool
        info = w.assign(_cfg(tmp_path).for_worker(), 0, None)
        assert w._job_frozen is frozen
        assert w.reset()["ok"]
        assert calls[-1]["unfreeze"] is frozen and w._job_frozen is False
        if not ray_was_up:  # its info() asked Ray's runtime context, which started a Ray
            ray = sys.modules.get("ray")
            assert info["node_id"] is None and (ray is None or not ray.is_initialized())
    finally:
        gc.unfreeze()


def test_a_pooled_workers_reset_drops_the_state_without_parking_it(tmp_path, monkeypatch):
    """After a job the state is dropped, not copied to host memory first (as a leave between
    layouts does): for a large job that copy could exhaust the host's memory or pass the
    pool's 30 s reset limit, and the worker was then retired as dead."""
    import gc

    from elastic.worker import Worker
    from elastic.worker.held_state import HeldState
    from elastic.worker.recycle import Baseline

    parked: list[Any] = []
    park = HeldState.park
    monkeypatch.setattr(HeldState, "park", lambda self, strategy: parked.append(strategy)
                        or park(self, strategy))
    ray = sys.modules.get("ray")
    ray_was_up = ray is not None and ray.is_initialized()  # `pytest tests`: integration first
    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        w.baseline = Baseline.take()  # as a pooled worker's, taken before its job
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        w.run(0, 2)
        out = w.reset()
        assert out["ok"], out
        assert parked == [], "the job's state was parked to host memory on reset"
        # outside Ray it says no node, and never starts a Ray (asking Ray's runtime context
        # did: the integration tests after the unit layer then found a 2-CPU local Ray)
        if not ray_was_up:
            ray = sys.modules.get("ray")
            assert out["node_id"] is None and (ray is None or not ray.is_initialized())
        assert getattr(w, "config", None) is None and "layout" not in w.__dict__
    finally:
        gc.unfreeze()


def test_a_pooled_workers_reset_lets_go_of_the_jobs_checkpointing(tmp_path):
    """A job that checkpointed hooked its writer into the process's list of calls before
    each update; a reset takes it out. Was: it stayed, and with it that job's layout, data
    (a whole Parquet table, Ray block references) and model, job after job on a pooled
    worker, each later update calling the stale hooks."""
    import gc
    import weakref

    import strategies.base as sbase
    from elastic.worker import Worker
    from elastic.worker.recycle import Baseline

    before = list(sbase._BEFORE_UPDATE)
    w = Worker(_cfg(tmp_path, checkpoint_every=1, checkpoint_uri=str(tmp_path / "ck")), 0,
               False, 1)
    try:
        w.baseline = Baseline.take()
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        w.run(0, 1)  # (a second checkpoint would wait for the first's commit: no controller)
        assert len(sbase._BEFORE_UPDATE) == len(before) + 1  # the writer's hook
        data = weakref.ref(w.data)
        out = w.reset()
        assert out["ok"], out
        assert sbase._BEFORE_UPDATE == before
        gc.collect()
        assert data() is None, gc.get_referrers(data())
    finally:
        gc.unfreeze()


def test_a_worker_outside_ray_needs_no_ray(tmp_path, monkeypatch):
    """bench/gpu_check.py runs the worker where Ray is not installed (the GPU host has none):
    a pooled worker's ``assign`` failed there, its ``info()`` asking Ray for the node's
    address. Outside Ray it gives the host's own and no node."""
    import gc

    from elastic.worker import Worker

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises, as on that host
    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        info = w.info()
        assert info["node_id"] is None and info["ip"] and info["pid"] == os.getpid()
    finally:
        gc.unfreeze()


def test_a_stop_sent_before_its_segment_starts_still_stops_it(tmp_path):
    """The actor runs calls on two threads in no fixed order: the controller's stop for a
    segment it has just started (a request already waiting) could reach the worker before
    ``run`` did, and ``run`` cleared it: the segment then ran to its end (``elastic switch``
    on a job of 100,000 steps waited out its 300 s; CI, 2026-12-04). A stop names its
    segment now; one for an earlier segment does not stop a later one."""
    import gc

    from elastic.worker import Worker

    w = Worker(_cfg(tmp_path), 0, False, 1)
    try:
        w.join("127.0.0.1", free_port(), 0, 1, 1, 30.0)
        w.restart_fresh(_spec("dp"), None, 0)
        w.request_stop(7)  # before segment 7 runs
        assert w.run(0, 50, 7) == {"status": "stopped", "next_step": 1}
        w.request_stop(7)  # a late stop for segment 7
        assert w.run(1, 4, 8) == {"status": "done", "next_step": 4}
        assert w.run(4, 6) == {"status": "done", "next_step": 6}  # unnumbered, as gpu_check
        w.request_stop()  # the last segment's: not the next one's
        assert w.run(6, 8) == {"status": "done", "next_step": 8}
        w.leave()
    finally:
        gc.unfreeze()


def test_the_profilers_trial_steps_rotate_in_blocks_and_count_all_but_each_blocks_first():
    """The profiler's trial kinds (dp with and without its update; zero3 and dp; a pipeline at
    two micro-batch counts and dp) run in blocks of 3 in turn, so that a slow phase of the host
    (1.3-2x for 10-40 steps on this VM) falls on every kind alike; a block's first step follows
    another kind and is not counted. Layouts held at once warm up 2 steps each first."""
    from elastic.worker.trial import alternating, kept, layout_at, of_kind, rotation

    assert [layout_at(s, 2) for s in range(16)] == [0, 0, 1, 1] + [0] * 3 + [1] * 3 + [0] * 3 \
        + [1] * 3
    assert [layout_at(s, 3) for s in range(15)] == [0, 0, 1, 1, 2, 2] + [0] * 3 + [1] * 3 \
        + [2] * 3
    assert [layout_at(s, 1) for s in range(8)] == [0] * 8
    assert [alternating(i) for i in range(12)] == [True] * 3 + [False] * 3 + [True] * 3 \
        + [False] * 3
    assert [rotation(i, 3) for i in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 0]
    secs = [float(i) for i in range(12)]
    assert kept(secs) == [(0, 1.0), (0, 2.0), (1, 4.0), (1, 5.0), (0, 7.0), (0, 8.0),
                          (1, 10.0), (1, 11.0)]
    assert of_kind(secs, 3, 1) == [4.0, 5.0] and of_kind(secs, 3, 0) == [1.0, 2.0, 10.0, 11.0]
    assert of_kind(secs, 1, 0) == secs  # one kind: every step counts


@pytest.mark.parametrize("free, replica, world, other, room", [
    (None, 1e12, 2, None, True),  # host memory (CPU): not measured, the rotation runs
    (10e9, 4e9, 2, None, True),  # 4 GB beside 2 x 2 GB, with a 25 % margin: 10 GB
    (9.9e9, 4e9, 2, None, False),
    (6.3e9, 4e9, 8, None, True),  # 4 GB beside 2 x 0.5 GB with 8 ranks, with the margin
    (6e9, 4e9, 8, None, False),
    # zero1 beside dp: its parameters and gradients whole, 1/world of the two moments
    (8.2e9, 4e9, 8, 0.5 + 0.5 / 8, True),  # 4 GB beside 2.25 GB, with the margin: 7.8 GB
    (7.7e9, 4e9, 8, 0.5 + 0.5 / 8, False),  # room beside zero3's shards, not beside zero1
])
def test_dp_is_held_beside_the_trial_layouts_only_where_the_device_has_room(free, replica,
                                                                            world, other,
                                                                            room):
    """zero1's, zero3's and the pipeline's trial steps run in rotation with dp's, all held
    at once: on a device without room for that (a GPU near its limit), each runs alone."""
    from elastic.worker.trial import room_beside

    assert room_beside(free, replica, world, other) is room


def test_a_checkpoint_keeps_the_cuda_generator_on_a_gpu_rank_and_restores_it(monkeypatch):
    """Dropout on a GPU draws from the device's generator: a rank on CUDA checkpoints it
    beside the CPU one and a restore sets it again (was: the CPU one only, so a resumed GPU
    job drew other masks than the uninterrupted one). A CPU rank writes and sets the CPU one
    only, and ignores a CUDA one a GPU job wrote. (No GPU here: torch.cuda's two calls are
    stood in for; bench/gpu_check.py runs the real path on a device.)"""
    from elastic.worker.checkpointing import rng_keys, rng_states, set_rng_states

    cuda = torch.device("cuda", 1)
    calls: list[tuple[str, object]] = []
    state = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: calls.append(("get", d)) or state)
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda s, d: calls.append(("set", d, bool(torch.equal(s, state)))))
    assert rng_keys(3) == rng_keys(3, torch.device("cpu")) == ["rng/rank3/torch"]
    assert rng_keys(3, cuda) == ["rng/rank3/torch", "rng/rank3/cuda"]
    torch.manual_seed(5)
    saved = rng_states(3, cuda)
    assert list(saved) == rng_keys(3, cuda) and calls == [("get", cuda)]
    want = torch.rand(3)
    set_rng_states(saved, 3, cuda)  # both go back: the CPU one, and the CUDA one to its device
    assert torch.equal(torch.rand(3), want) and calls[-1] == ("set", cuda, True)
    calls.clear()
    set_rng_states(saved, 3, torch.device("cpu"))  # a CPU rank: no CUDA call
    assert calls == [] and torch.equal(torch.rand(3), want)


def test_a_roll_forward_while_a_leave_parks_the_state_applies_the_step_once():
    """A leave (sent fire-and-forget after a failure) parks a large state on one of the
    actor's threads while the controller's roll-forward and progress run on the other.
    ``progress`` says the update is pending all along (it takes no lock: it is the
    liveness ping), and the roll-forward waits for the park and takes the parked state one
    step on. Was: the roll-forward read the live strategy before the lock, found its update
    applied by the park, and returned the step unchanged; progress said nothing pending."""
    import threading
    import time

    from elastic.worker.actor import Worker

    class _SlowPark(_PendingLayout):
        def held_state(self):
            time.sleep(0.4)
            return super().held_state()

    class _L:
        def __init__(self):
            self.strategy, self.next_step = _SlowPark(), 7

        def drop(self):
            self.strategy = None

    class _Members:
        def leave(self):
            pass

    w = Worker.__new__(Worker)
    w.held, w.layout, w.membership, w._left = HeldState(), _L(), _Members(), {}
    w.heartbeat = None
    leaving = threading.Thread(target=w.leave, kwargs={"collect": False})
    leaving.start()
    time.sleep(0.1)  # the leave holds the lock, parking
    seen = []
    for _ in range(8):  # the controller's reads during the park, without waiting on it
        seen.append(w.held.pending(w.layout.strategy))
        time.sleep(0.1)
    assert all(seen), seen
    assert w.finish_pending_step() == 8
    leaving.join()
    assert w.held.snapshot["model/w"].eq(1).all() and not w.held.pending(None)
    assert w.finish_pending_step() == 8  # once


def test_the_reference_split_in_parts_is_one_process_but_for_the_order_of_additions():
    """``reference_train(parts=2)``: each gradient summed from two halves of the batch, as
    two ranks' all-reduce sums it; its losses are the whole batch's mean. Within float noise
    of one pass over the whole batch after a few steps (tests/integration/test_replan.py
    measures how Adam amplifies that noise over a long run)."""
    from tests.helpers import RegressionData, adam, mse, wide_mlp

    one, l1 = reference_train(wide_mlp, adam, mse, RegressionData(), 64, 5, seed=0)
    two, l2 = reference_train(wide_mlp, adam, mse, RegressionData(), 64, 5, seed=0, parts=2)
    assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) < 1e-6
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-6
