"""CLI inputs that ended in a traceback (found by review, session 44): each is now one line
naming the flag or the field, exit code 2, before any cluster is reached. No Ray here: the
CLI's attach is replaced by one that fails the test if it is reached too early."""

from __future__ import annotations

import pytest
import yaml

from elastic import cli

JOB = {"model": "tests.unit.test_cli_inputs:broken_model", "optimizer": {"name": "adam",
       "lr": 0.01}, "loss": "mse", "dataset": "tests.helpers:RegressionData",
       "global_batch_size": 8, "max_steps": 6, "num_workers": 1}


class Attached(Exception):
    """The command reached the cluster."""


@pytest.fixture
def no_cluster(monkeypatch):
    def attach(address):
        raise Attached(address)

    monkeypatch.setattr(cli, "_attach", attach)  # build_parser hands it to sched_cli


def broken_model():
    raise RuntimeError("no such layer: 'sigmoidd'")


def _one_line(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    return err


def test_plan_with_a_model_factory_that_raises_names_the_model(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    assert cli.main(["plan", str(job), "--cluster", "a100-t4"]) == 2  # (was: a traceback)
    _one_line(capsys, "elastic: error: model: the model factory raised RuntimeError: no such "
              "layer", "Fix: fix the factory; it must return an nn.Module")


def test_export_to_a_file_uri_with_a_host_names_out(tmp_path, capsys):
    rc = cli.main(["checkpoints", "export", str(tmp_path / "ck"), "--out", "file://model.pt"])
    assert rc == 2
    _one_line(capsys, "elastic: error: --out: file://model.pt names the host 'model.pt'",
              "Fix: write file:///abs/path")
    from elastic.checkpoint import CheckpointStore
    from elastic.checkpoint.tools import export
    from elastic.errors import ConfigError

    with pytest.raises(ConfigError) as e:  # the SDK's: a ConfigError (a ValueError too)
        export(CheckpointStore(str(tmp_path / "ck")), "file://model.pt")
    assert e.value.field == "dest" and e.value.fix


@pytest.mark.parametrize("argv, flag", [
    (["queue", "watch", "--interval", "-1"], "--interval"),
    (["queue", "watch", "--interval", "0"], "--interval"),
    (["scheduler", "start", "--workers", "-2"], "--workers"),
    (["scheduler", "start", "--cpus", "0"], "--cpus"),
    (["scheduler", "start", "--workers", "2", "--round-s", "nan"], "--round-s"),
    (["scheduler", "start", "--workers", "2", "--warm", "-1"], "--warm"),
    (["scheduler", "start", "--workers", "2", "--db", "/missing/dir/q.sqlite"], "--db"),
    (["scheduler", "start", "--workers", "2", "--db", "/tmp"], "--db"),  # a directory
])
def test_a_bad_scheduler_flag_is_one_line_before_the_cluster(no_cluster, capsys, argv, flag):
    assert cli.main(argv) == 2  # (was: attached, then a traceback from the actor or loop)
    _one_line(capsys, f"elastic: error: {flag}: ", "Fix:")


def test_good_scheduler_flags_reach_the_cluster(no_cluster, tmp_path):
    for argv in (["queue", "watch", "--interval", "0.5"], ["queue", "list"],
                 ["scheduler", "start", "--workers", "2", "--db", str(tmp_path / "q.sqlite")],
                 ["scheduler", "start", "--gpus", "1", "--db", "none"]):
        with pytest.raises(Attached):
            cli.main(argv)


@pytest.mark.parametrize(("before", "rc", "said"), [
    ("queued", 0, "cancelled 'j' (it was queued)"),
    ("running", 0, "cancelling 'j': it stops at its next step boundary"),
    ("finished", 1, "'j' had already ended (finished): nothing to cancel"),
    ("cancelled", 1, "'j' had already ended (cancelled): nothing to cancel"),
])
def test_queue_cancel_says_what_it_did(monkeypatch, capsys, before, rc, said):
    """Was: "cancelled 'j' (was finished)" and exit 0 for a job that had ended, which went
    on being listed finished (found by a new user, session 46)."""
    import argparse

    from elastic import scheduler
    from elastic.sched_cli import _cancel

    class Job:
        def __init__(self, name: str, job: str) -> None:
            pass

        def cancel(self) -> str:
            return before

    monkeypatch.setattr(scheduler, "ScheduledJob", Job)
    assert _cancel(argparse.Namespace(name="s", job="j")) == rc
    assert said in capsys.readouterr().out


def test_export_to_a_directory_or_under_a_file_names_out(tmp_path, capsys):
    """``--out newdir/`` (not there yet), an existing directory, or a path under a file: one
    line naming --out, exit 2, before the checkpoint is read. Was: a file named ``newdir``
    written and reported done; a FileExistsError traceback (found by a new user, session
    47)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    for out, said in ((f"{tmp_path}/newdir/", "is a directory"),
                      (str(tmp_path / "adir"), "is a directory"),
                      (str(tmp_path / "afile" / "x.pt"), "is a file, so")):
        rc = cli.main(["checkpoints", "export", str(tmp_path / "ck"), "--out", out])
        assert rc == 2
        _one_line(capsys, "elastic: error: --out: ", said)
    assert not (tmp_path / "newdir").exists()
