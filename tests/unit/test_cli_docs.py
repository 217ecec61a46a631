"""What the docs say of the CLI and the SDK is what they do (found by review, session 44): the
pool example of docs/scheduler.md is a call ``fit`` takes, README's ``--set`` examples are
accepted, and docs/ray-jobs.md's ``ray job stop`` row names the test that exercises it."""

from __future__ import annotations

import ast
import os
import re
import shlex

from elastic.api import _config
from elastic.cli import _parse_sets
from elastic.config import JobConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {"model": {"target": "tests.helpers:mlp_act", "activation": "tanh"},
        "optimizer": {"name": "adam", "lr": 0.01}, "loss": "mse",
        "dataset": "tests.helpers:RegressionData", "global_batch_size": 8, "max_steps": 6,
        "num_workers": 1}


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def test_the_pool_example_of_the_scheduler_docs_is_a_call_fit_takes():
    line = next(x for x in _read("docs/scheduler.md").splitlines()
                if "elastic.fit(cfg," in x and "pool=pool" in x)
    call = ast.parse(line.split("#")[0].strip()).body[0].value
    assert isinstance(call, ast.Call)
    fields = {k.arg: eval(compile(ast.Expression(k.value), "docs", "eval"), {"lr": 0.003})
              for k in call.keywords if k.arg != "pool"}  # (the loop's lr: one value)
    cfg = _config(JobConfig.from_dict(BASE), fields)  # (was: lr=lr, "lr: is not a job setting")
    assert cfg.optimizer["lr"] == 0.003


def test_the_set_examples_of_the_readme_do_what_it_says():
    text = _read("README.md")
    assert "not a key inside one" not in text  # (was said; optimizer.lr=0.1 is taken)
    examples = [words[i + 1] for span in re.findall(r"`(--set [^`]+)`", text)
                for words in [shlex.split(span)] for i, w in enumerate(words) if w == "--set"]
    assert "optimizer.lr=0.1" in examples and "checkpoints.every=50" in examples, examples
    for kv in examples:
        JobConfig.from_dict(BASE, _parse_sets([kv]))
    cfg = JobConfig.from_dict(BASE, _parse_sets(["optimizer.lr=0.1", "model.activation=relu"]))
    assert cfg.optimizer == {"name": "adam", "lr": 0.1}  # only lr changes
    assert cfg.model == {"target": "tests.helpers:mlp_act", "activation": "relu"}


def test_the_ray_job_stop_row_names_the_test_that_exercises_it():
    row = next(x for x in _read("docs/ray-jobs.md").splitlines()
               if x.startswith("| `ray job stop"))
    assert "not exercised" not in row and "no final state" not in row, row
    named = re.findall(r"tests/integration/(test_\w+\.py)::(test_\w+)", row)
    assert named, row
    for path, name in named:
        assert f"def {name}(" in _read(f"tests/integration/{path}"), name
