"""Bad input gets one clear error naming the field and the fix, before any worker starts;
user code failing on a worker surfaces with that worker's rank and traceback."""

from __future__ import annotations

import pytest

import elastic
from elastic import ClusterError, ConfigError, WorkerError
from tests.helpers import ExplodingLoss, RegressionData, adam, failing_model, mlp, mse


def _cfg(**kw):
    base = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(64),
                global_batch_size=8, max_steps=3, num_workers=2, view="none")
    base.update(kw)
    return base


@pytest.mark.parametrize(
    "kw, field, words",
    [
        ({"strategy": "turbo"}, "strategy", "unknown strategy"),
        ({"global_batch_size": 0}, "global_batch_size", "positive integer"),
        ({"global_batch_size": -4}, "global_batch_size", "positive integer"),
        ({"global_batch_size": 1}, "global_batch_size", "smaller than num_workers"),
        ({"dataset": RegressionData(5)}, "dataset", "fewer than one global batch"),
        ({"model": failing_model}, "model", "broken on purpose"),
        ({"max_steps": 0}, "max_steps", "positive integer"),
        ({"model": "no.such.module:thing"}, "model", "cannot import"),
        ({"optimizer": {"name": "adamx"}}, "optimizer", "unknown optimizer"),
        ({"switch_at": {2: "nope"}}, "switch_at[2]", "unknown strategy"),
    ],
)
def test_bad_config_is_refused_before_workers_start(tmp_path, kw, field, words):
    with pytest.raises(ConfigError) as ei:
        elastic.fit(**_cfg(run_dir=str(tmp_path), **kw))
    assert ei.value.field == field
    assert words in str(ei.value)
    assert "Fix:" in str(ei.value)


def test_unknown_setting_in_yaml(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: tests.helpers:mlp\nglobal_batchsize: 8\n")
    with pytest.raises(ConfigError) as ei:
        elastic.JobConfig.from_yaml(str(p))
    assert ei.value.field == "global_batchsize"


def test_renamed_setting_says_its_new_name(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("model: tests.helpers:mlp\nverify_switch: false\n")
    with pytest.raises(ConfigError) as ei:
        elastic.JobConfig.from_yaml(str(p))
    assert ei.value.field == "verify_switch" and "switch_check: pieces" in str(ei.value)


def test_workers_that_cannot_start_fail_clearly(ray_local, tmp_path):
    """The job's code imports on the driver but not on the workers: placement fails with a
    ClusterError naming why, not an IndexError."""
    cfg = _cfg(run_dir=str(tmp_path))
    cfg["model"] = "tests._fails_in_actors:mlp"
    with pytest.raises(ClusterError, match="failed to start.*cannot be imported on the workers"):
        elastic.fit(**cfg)


def test_unreachable_ray_address(tmp_path):
    with pytest.raises(ClusterError, match="cannot reach the Ray cluster"):
        elastic.fit(**_cfg(ray_address="127.0.0.1:1", run_dir=str(tmp_path)))


def test_user_error_on_worker_has_rank_and_traceback(ray_local, tmp_path):
    with pytest.raises(WorkerError) as ei:
        elastic.fit(**_cfg(loss=ExplodingLoss(), run_dir=str(tmp_path)))
    err = ei.value
    assert err.rank == 1
    assert "bad loss on purpose" in str(err)
    assert "Traceback" in err.traceback_text and "helpers.py" in err.traceback_text


def test_user_error_mid_run_says_its_step_and_keeps_the_steps_before(ray_local, tmp_path):
    """Rank 1's loss raises at step 4. Was: the error named no step, and the steps done
    before it were lost (metrics.jsonl empty, the failure at step 0) when no poll had
    drained them yet. Step 3 is not among them: a step's agreed values (loss, ...) are read
    during the next step, which failed first (its update was applied)."""
    import json

    with pytest.raises(WorkerError) as ei:
        elastic.fit(**_cfg(loss=ExplodingLoss(after=4), max_steps=8, run_dir=str(tmp_path)))
    assert ei.value.step == 4 and ("at step 4 (its part: 4 samples): ValueError: bad loss on "
                                   "purpose") in str(ei.value)
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [0, 1, 2]
    with open(tmp_path / "events.jsonl") as f:
        ends = [(e["kind"], e["step"]) for e in map(json.loads, f)
                if e["kind"] in ("failure", "failed")]
    assert ends == [("failure", 4), ("failed", 4)], ends


def test_a_batch_size_error_names_the_ranks_part(ray_local, tmp_path):
    """A batch norm over one sample fails in torch; the error says that rank's part of the
    step was 1 sample (3 on 2 workers: shares 2 and 1), so the cause is in sight (was: torch's
    "Expected more than 1 value per channel" alone; found by a new user, session 46)."""
    from tests.helpers import bn_mlp

    with pytest.raises(WorkerError) as ei:
        elastic.fit(**_cfg(model=bn_mlp, global_batch_size=3, run_dir=str(tmp_path)))
    assert ei.value.rank == 1 and ei.value.part == "1 sample", str(ei.value)
    assert "at step 0 (its part: 1 sample): ValueError: Expected more than 1 value" in str(
        ei.value)
    with pytest.raises(WorkerError) as ei:  # micro-batches of 1 under zero2 (lockstep: 2 each)
        elastic.fit(**_cfg(model=bn_mlp, global_batch_size=4, strategy="zero2",
                           micro_batch_size=1, run_dir=str(tmp_path / "z2")))
    assert ei.value.part == "2 samples in 2 micro-batches", str(ei.value)
    with pytest.raises(WorkerError) as ei:  # a pipeline's stage runs its replica's batch
        elastic.fit(**_cfg(model=bn_mlp, global_batch_size=4, strategy="pipeline",
                           micro_batches=4, run_dir=str(tmp_path / "pp")))
    assert ei.value.part == "its replica's 4 samples in 4 micro-batches", str(ei.value)


def test_user_error_in_an_evaluation_says_its_step_and_that_it_was_the_evaluation(
        ray_local, tmp_path):
    """Rank 1's loss raises in the evaluation after step 2 (every 3 steps), not in a step:
    the error names step 2 and the evaluation (was: "at step 2" alone, read as the training
    step), with the evaluation's frames in the traceback; steps 0 and 1 are kept."""
    import json

    with pytest.raises(WorkerError) as ei:
        elastic.fit(**_cfg(loss=ExplodingLoss(in_eval=True), max_steps=8,
                           eval_dataset=RegressionData(16, seed=1), eval_every=3,
                           run_dir=str(tmp_path)))
    err = ei.value
    assert err.rank == 1 and err.step == 2 and err.during == "the evaluation after it"
    assert "at step 2, in the evaluation after it: ValueError: bad loss on purpose" in str(err)
    assert "_evaluate" in err.traceback_text
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [0, 1]
