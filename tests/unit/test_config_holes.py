"""Holes in the job config's checks found by a review (2026): YAML's booleans and exponents, the
``switch_at`` targets checked before the job starts, ``file://`` URIs with a host, resuming an
unnamed job, a Parquet directory as ``eval_dataset``, ``lr_schedule`` values, Ray resource
names and addresses, and dotted ``--set`` keys. Each refusal names the setting and a fix that
works. No Ray."""

from __future__ import annotations

import pytest

from elastic.config import JobConfig
from elastic.errors import ClusterError, ConfigError
from tests.unit.test_config import _base, _parquet


def _refused(**settings) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        JobConfig(**_base(**settings))
    return ei.value


def _yaml_job(tmp_path, text: str, overrides=None) -> JobConfig:
    p = tmp_path / "job.yaml"
    p.write_text("model: tests.helpers:mlp\noptimizer: {name: adam, lr: 0.01}\nloss: mse\n"
                 "dataset: tests.helpers:RegressionData\nglobal_batch_size: 8\nmax_steps: 6\n"
                 + text)
    return JobConfig.from_yaml(str(p), overrides)


def test_yaml_booleans_are_on_and_off_where_those_are_choices(tmp_path):
    """``balance: off``, ``balance: on``, ``switch_check: off`` unquoted (YAML booleans), and
    ``--set balance=off``. Was: "unknown value False ... use one of: auto, on, off"."""
    from elastic.cli import _parse_sets

    cfg = _yaml_job(tmp_path, "balance: off\nswitch_check: off\n")
    assert (cfg.balance, cfg.switch_check) == ("off", "off")
    assert _yaml_job(tmp_path, "balance: on\n").balance == "on"
    assert _yaml_job(tmp_path, "", _parse_sets(["balance=no"])).balance == "off"
    # no "on" among switch_check's choices: said, with why it is a boolean
    with pytest.raises(ConfigError) as ei:
        _yaml_job(tmp_path, "switch_check: on\n")
    assert ei.value.field == "switch_check" and "YAML reads unquoted on" in str(ei.value)
    assert "use one of: pieces, rehash, off" in ei.value.fix


@pytest.mark.parametrize("setting, text, words, fix", [
    ("max_steps", "1e3", "a decimal point and a signed exponent", "write max_steps: 1000"),
    ("hang_timeout_s", "1.0e3", "a decimal point and a signed exponent",
     "write hang_timeout_s: 1000.0"),
    ("max_grad_norm", "1e-3", "signed exponent", "write max_grad_norm: 0.001"),
    ("keep_last", "'3'", "a number in quotes is a string", "write keep_last: 3"),
    ("hang_timeout_s", "'1.0e+3'", "a number in quotes is a string",  # (YAML's own form)
     "write hang_timeout_s: 1.0e+3"),
])
def test_text_that_reads_as_a_number_says_why_and_the_value_meant(tmp_path, setting, text,
                                                                  words, fix):
    """PyYAML reads an exponent as a number only with a decimal point and a signed exponent.
    Was: "write 1.0e-3" (the wrong cause: a missing decimal point; the wrong value for
    1e3, and a float for an integer setting)."""
    from elastic.cli import _parse_sets

    with pytest.raises(ConfigError) as ei:  # (--set reads its value as YAML, as a file does)
        _yaml_job(tmp_path, "", _parse_sets([f"{setting}={text}"]))
    assert ei.value.field == setting and words in str(ei.value), str(ei.value)
    assert ei.value.fix == fix, str(ei.value)
    meant = fix.rpartition(" ")[2]  # the fix works
    assert getattr(_yaml_job(tmp_path, "", _parse_sets([f"{setting}={meant}"])), setting) \
        == float(meant)


def _layouts(cfg, model=None):
    from elastic.control.layouts import Layouts
    from elastic.reference import build_model

    return Layouts(cfg, model or build_model(cfg.model_factory(), cfg.seed), lambda *a, **k: None)


@pytest.mark.parametrize("settings, words", [
    ({"switch_at": {3: "pipeline"}, "pp_degree": 3, "num_workers": 2},
     "choose a pp_degree that divides 2"),
    ({"switch_at": {3: "pipeline"}, "num_workers": 8}, "8 pipeline stages but the model has "
     "only 5 blocks"),
    ({"switch_at": {3: "zero2"}, "num_workers": 3, "micro_batch_size": 1},
     "raise micro_batch_size to at least 2"),
])
def test_a_switch_at_target_that_could_not_run_is_refused_before_the_job_starts(settings,
                                                                                words):
    """Was: accepted; at its step, hours in, "switch_failed; training goes on" in the old
    layout. Checked as the start strategy is, on the starting workers."""
    from elastic.preflight import check_switch_at

    cfg = JobConfig(**_base(**settings))
    with pytest.raises(ConfigError) as ei:
        check_switch_at(cfg, _layouts(cfg))
    assert ei.value.field == "switch_at[3]", str(ei.value)
    assert words in str(ei.value) and "drop this switch" in ei.value.fix, str(ei.value)
    good = JobConfig(**_base(switch_at={2: "zero3", 3: "pipeline", 4: "auto"}, num_workers=2))
    check_switch_at(good, _layouts(good))
    # a target that runs on another size the job may have by then is not refused
    grows = JobConfig(**_base(switch_at={3: "pipeline"}, pp_degree=3, num_workers=2,
                              max_workers=3))
    check_switch_at(grows, _layouts(grows))
    never = JobConfig(**_base(switch_at={3: "pipeline"}, pp_degree=5, num_workers=2,
                              max_workers=4, min_workers=1))
    with pytest.raises(ConfigError, match=r"any size the job may have \(1..4 workers\), "
                                          r"on the 2 starting ones: pp_degree 5"):
        check_switch_at(never, _layouts(never))


@pytest.mark.parametrize("uri", ["file://./ckpt", "file://runs/ckpt", "file://ckpt"])
def test_a_file_uri_with_a_host_part_is_refused(uri):
    """Was: the host dropped: root /ckpt, or the working directory itself."""
    e = _refused(checkpoint_uri=uri)
    assert e.field == "checkpoint_uri" and "names the host" in str(e)
    assert "file:///abs/path" in e.fix
    assert _refused(resume=uri).field == "resume"
    assert JobConfig(**_base(checkpoint_uri="file://localhost/tmp/ck")
                     ).checkpoint_location.root == "/tmp/ck"
    # one reading of file:// everywhere (checkpoint.location.local_path): a dataset and an
    # export destination too (were read as /x.parquet, and as a relative path)
    with pytest.raises(ConfigError) as ei:
        JobConfig(**_base(dataset=uri + "/x.parquet")).dataset_object()
    assert ei.value.field == "dataset" and "names the host" in str(ei.value)
    from elastic.checkpoint import CheckpointStore
    from elastic.checkpoint.tools import export

    with pytest.raises(ValueError, match="names the host"):
        export(CheckpointStore("/nonexistent-elastic-ck"), uri + "/model.pt")


@pytest.mark.parametrize("resume", ["auto", "latest"])
def test_resuming_its_own_checkpoints_needs_a_name_that_stays(resume, tmp_path):
    """Each unnamed run is named anew, and a job's checkpoints carry its name. Was: with the
    default location (a new directory each run) ``auto`` always started fresh and ``latest``
    failed at the start with two "Fix:"es; with a run_dir or checkpoint_uri the next run was
    refused as another job's (the owner check naming a generated name)."""
    e = _refused(resume=resume)
    assert e.field == "resume" and "default checkpoint directory" in str(e), str(e)
    assert e.fix == "give the job a name that stays the same from run to run, e.g. name: my-job"
    for where in ({"run_dir": str(tmp_path)}, {"checkpoint_uri": str(tmp_path / "ck")}):
        e = _refused(resume=resume, **where)
        assert e.field == "resume" and "resuming them is refused" in str(e), str(e)
        assert JobConfig(**_base(resume=resume, name="j", **where)).resume == resume
    assert JobConfig(**_base(resume=resume, name="j")).resume == resume


def test_a_parquet_directory_is_an_eval_dataset_with_dataset_format_parquet(tmp_path):
    """Was: refused ("neither a Parquet dataset nor an import string"), checked as if
    dataset_format were not given."""
    for part in ("train", "eval"):
        (tmp_path / part).mkdir()
        _parquet(tmp_path / part / "part-0.parquet", labels=False)
    cfg = JobConfig(**_base(model=lambda: __import__("torch").nn.Linear(8, 1),
                            dataset=str(tmp_path / "train"), dataset_format="parquet",
                            eval_dataset=str(tmp_path / "eval"), eval_every=2))
    assert len(cfg.evaluation.dataset_object(cfg.data)) == 32
    assert _refused(eval_dataset="eval_dir").field == "eval_dataset"  # without the format


@pytest.mark.parametrize("schedule, field, words", [
    ({"name": "linear", "total_steps": -5}, "lr_schedule.total_steps", "positive integer"),
    ({"name": "cosine", "total_steps": "1000"}, "lr_schedule.total_steps", "in quotes"),
    ({"name": "cosine", "warmup_steps": -1}, "lr_schedule.warmup_steps", "integer >= 0"),
    ({"name": "cosine", "min_ratio": True}, "lr_schedule.min_ratio", "finite number"),
    ({"name": "linear", "total_steps": 4}, "lr_schedule.total_steps",
     "the last 2 steps would train with lr 0"),
    ({"name": "constant", "total_steps": 4}, "lr_schedule",
     "constant takes warmup_steps, not total_steps"),
    ({"name": "cosin", "warmup_steps": -1}, "lr_schedule", "unknown schedule 'cosin'"),
])
def test_lr_schedule_values_are_named(schedule, field, words):
    """Was: total_steps -5 taken (lr 0 from step 1), "1000" a TypeError at step 0, True a
    min_ratio, a decay ending before the run (lr 0 for its last steps) and constant's
    total_steps (ignored) taken."""
    e = _refused(lr_schedule=schedule)
    assert e.field == field and words in str(e), str(e)
    ok = JobConfig(**_base(lr_schedule={"name": "linear", "total_steps": 4, "min_ratio": 0.1}))
    assert ok.lr_schedule_fn()(5) == pytest.approx(0.1)  # a floor held after it: allowed


@pytest.mark.parametrize("res, words, fix", [
    ({"gpu": 1}, "names 'gpu'", "did you mean GPU? write {GPU: 1}"),
    ({"Cpu": 4}, "names 'Cpu'", "did you mean CPU? write {CPU: 4}"),
    ({"CPU": 0}, "0 CPU per worker", "ask for CPU: 1"),
])
def test_resource_names_ray_would_take_as_custom_ones_are_refused(res, words, fix):
    """Was: taken as custom resources no node has; the job waited out placement_timeout_s."""
    e = _refused(resources_per_worker=res)
    assert e.field == "resources_per_worker" and words in str(e) and fix in e.fix, str(e)


@pytest.mark.parametrize("addr, words", [
    ("http://127.0.0.1:8265", "the Ray dashboard's or its Jobs API's"),
    ("10.0.0.1", "has no port. Fix: add it, usually 6379"),
    ("::1:6379", "IPv6 address without brackets"),
    ("ray://head", "usually 10001"),
])
def test_a_ray_address_that_is_not_one_says_what_it_is(addr, words):
    """Was: "Name or service not known" (an http:// address), "invalid literal for int()" (no
    port; a bracketed IPv6 address, which is now read)."""
    from elastic.ray_address import check_reachable, host_port

    e = _refused(ray_address=addr)
    assert e.field == "ray_address" and words in str(e), str(e)
    with pytest.raises(ClusterError, match="RAY_ADDRESS: .*" + words.split(".")[0]):
        check_reachable(addr)  # $RAY_ADDRESS, in preflight
    assert host_port("[::1]:6379") == ("::1", 6379)
    assert JobConfig(**_base(ray_address="[::1]:6379")).ray_address == "[::1]:6379"


def test_dotted_set_keys_change_one_key_of_a_setting(tmp_path):
    """``--set optimizer.lr=0.01``: only lr changes; ``checkpoints.every=10`` is the section's
    field. Was: "optimizer.lr: is not a job setting. Fix: did you mean optimizer?"."""
    from elastic.cli import _parse_sets

    sets = _parse_sets(["optimizer.lr=0.5", "checkpoints.every=3", "training.seed=4"])
    cfg = _yaml_job(tmp_path, "checkpoints: {every: 2, keep_last: 1}\n", sets)
    assert cfg.optimizer == {"name": "adam", "lr": 0.5}
    assert (cfg.checkpoint_every, cfg.keep_last, cfg.seed) == (3, 1, 4)
    with pytest.raises(ConfigError, match="inside model, which is a str, not a mapping"):
        _yaml_job(tmp_path, "", {"model.activation": "relu"})
    with pytest.raises(ConfigError, match="optimzer.lr: .*did you mean optimizer"):
        _yaml_job(tmp_path, "", {"optimzer.lr": 0.5})
    with pytest.raises(ConfigError, match="optimizer.lrr: is not an argument"):
        _yaml_job(tmp_path, "", {"optimizer.lrr": 0.5})
    more = _yaml_job(tmp_path, "", {"resources_per_worker.GPU": 1, "use_gpu": True})
    assert more.resources_per_worker == {"CPU": 1, "GPU": 1}  # over the default
    with pytest.raises(ConfigError, match="inside lr_schedule, which is not given"):
        _yaml_job(tmp_path, "", {"lr_schedule.warmup_steps": 10})
    base = JobConfig(**_base(model={"target": "tests.helpers:mlp_act", "activation": "tanh"}))
    again = base.replace(**{"model.activation": "relu"})
    assert again.model == {"target": "tests.helpers:mlp_act", "activation": "relu"}
    assert base.model["activation"] == "tanh"  # unchanged


def test_keep_every_must_be_a_multiple_of_the_checkpoint_interval():
    """``checkpoint_every: 100, keep_every: 250`` kept only steps 500 and 1000 (a step is
    kept when it is checkpointed and a multiple of keep_every). Was: taken silently (found
    by review, session 43)."""
    e = _refused(checkpoint_every=100, keep_every=250)
    assert e.field == "keep_every" and "every 500, would stay" in str(e), str(e)
    assert e.fix == "use a multiple of 100, e.g. keep_every: 200 or 300"
    assert JobConfig(**_base(checkpoint_every=100, keep_every=300)).checkpoints.keep_every == 300
    assert JobConfig(**_base(keep_every=250)).checkpoints.keep_every == 250  # (no interval)


def test_a_key_given_twice_in_a_yaml_file_is_refused_with_both_lines(tmp_path):
    """``max_steps: 6`` then ``max_steps: 4``: YAML keeps the last without a word, and the
    job ran 6 steps (found by a new user, session 46); in a section too, and in a sweep
    file. A merge (``<<: *base``) is not a repeat."""
    from elastic.sweep.sweep_file import load_yaml

    with pytest.raises(ConfigError) as ei:
        _yaml_job(tmp_path, "max_steps: 4\n")
    assert ei.value.field == "job file", str(ei.value)
    assert "gives 'max_steps' twice (lines 6 and 7)" in str(ei.value), str(ei.value)
    assert "Fix: give it once" in str(ei.value)
    with pytest.raises(ConfigError, match="gives 'every' twice"):
        _yaml_job(tmp_path, "checkpoints:\n  every: 5\n  every: 10\n")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("trials: 2\ntrials: 3\n")
    with pytest.raises(ConfigError, match="gives 'trials' twice"):
        load_yaml(str(sweep), "sweep file")
    sweep.write_text("a: &x {p: 1}\nb:\n  <<: *x\n  <<: *x\n  q: 2\n")
    assert load_yaml(str(sweep), "sweep file")["b"] == {"p": 1, "q": 2}
