"""The command line as a user runs it: checkpoint tools on a real job's checkpoints, and the
planner's table for a cluster file."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
import torch

import elastic
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def _clis(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """``_cli`` for each call, all at once (each is mostly its interpreter's start-up)."""
    procs = [(args, subprocess.Popen([sys.executable, "-m", "elastic.cli", *args], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
             for args in calls]
    out = []
    try:
        for args, p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append(subprocess.CompletedProcess(list(args), p.returncode, stdout, stderr))
    finally:
        for _, p in procs:
            p.kill()  # a no-op for one that ended
    return out


def test_checkpoint_tools(ray_local, tmp_path):
    uri = str(tmp_path / "ckpt")
    result = elastic.fit(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                         global_batch_size=8, max_steps=6, num_workers=2, view="none",
                         checkpoint_uri=uri, checkpoint_every=3, run_dir=str(tmp_path / "run"))
    dest = tmp_path / "model.pt"
    st = tmp_path / "model.safetensors"
    listed, inspected, verified, exported, exported_st = _clis(
        ("checkpoints", "list", uri), ("checkpoints", "inspect", uri),
        ("checkpoints", "verify", uri), ("checkpoints", "export", uri, "--out", str(dest)),
        ("checkpoints", "export", uri, "--out", str(st)))
    assert listed.returncode == 0 and "3" in listed.stdout and "6" in listed.stdout, listed
    assert inspected.returncode == 0 and "model/0.weight" in inspected.stdout
    assert "dp" in inspected.stdout
    assert verified.returncode == 0 and verified.stdout.count("OK") == 2
    assert exported.returncode == 0, exported.stderr
    assert max_diff(torch.load(dest, weights_only=True), result.state_dict()) == 0.0
    assert exported_st.returncode == 0 and "load_file" in exported_st.stdout, exported_st.stderr
    from safetensors.torch import load_file

    mlp().load_state_dict(load_file(st))  # a plain model takes it as it is
    assert max_diff(load_file(st), result.state_dict()) == 0.0
    # flip bytes in one shard of the newest checkpoint: verify names it and exits 1
    shard = sorted(glob.glob(os.path.join(uri, "step-*6", "shard-*.bin")))[0]
    with open(shard, "r+b") as f:
        f.seek(64)
        f.write(b"\xff" * 16)
    nothing = str(tmp_path / "nothing-here")
    bad, listed, verified = _clis(("checkpoints", "verify", uri),
                                  ("checkpoints", "list", nothing),
                                  ("checkpoints", "verify", nothing))  # a CI gate fails
    assert bad.returncode == 1 and "BAD" in bad.stdout
    assert listed.returncode == 1 and "does not exist" in listed.stdout
    assert verified.returncode == 1 and "does not exist" in verified.stderr


def test_plan_prints_a_ranked_table_with_reasons():
    out = _cli("plan", "examples/gpt.yaml", "--cluster", "a100-t4", "--global-batch", "256")
    assert out.returncode == 0, out.stderr
    assert "chose" in out.stdout and "Rejected" in out.stdout and "step s" in out.stdout
    out = _cli("plan", "examples/gpt.yaml", "--cluster", "no-such-cluster")
    assert out.returncode != 0 and "no-such-cluster" in out.stderr


def test_plan_prices_each_plan():
    out = _cli("plan", "examples/gpt.yaml", "--cluster", "a100-t4", "--global-batch", "256",
               "--prices", "a100=2,t4=0.5")
    assert out.returncode == 0, out.stderr
    assert "$/h" in out.stdout and "$/1k steps" in out.stdout
    assert "a100 $2 (on_demand, given), t4 $0.5 (on_demand, given)" in out.stdout
    out = _cli("plan", "examples/gpt.yaml", "--cluster", "a100-spot-mixed")
    assert out.returncode == 0 and "(spot, catalog)" in out.stdout, out.stderr
    out = _cli("plan", "examples/gpt.yaml", "--cluster", "a100-t4", "--prices", "h100=3")
    assert out.returncode == 2 and "names no pool, device type or market" in out.stderr


def test_entry_script_runs_like_ray_submit_would(tmp_path):
    """`ray submit CLUSTER.yaml scripts/elastic_entry.py ARGS` copies the file to the head
    and runs `python elastic_entry.py ARGS` there: the same, from another directory."""
    import shutil

    script = tmp_path / "elastic_entry.py"
    shutil.copy(os.path.join(ROOT, "scripts", "elastic_entry.py"), script)
    out = subprocess.run([sys.executable, str(script), "plan", os.path.join(ROOT, "examples",
                          "gpt.yaml"), "--cluster", "h100x8"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0 and "chose" in out.stdout, out.stderr


_USER_MODULE = '''
import torch
from torch import nn


def model(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))


class Data:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(64, 4, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
'''


def test_console_script_imports_modules_of_the_current_folder(tmp_path):
    """`elastic run job.yaml` from the folder that holds the job's module works like
    `python -m elastic` does: the driver and Ray's workers import it."""
    import shutil

    import yaml

    script = shutil.which("elastic", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no elastic console script beside this Python (not installed)")
    (tmp_path / "my_job_module.py").write_text(_USER_MODULE)
    job = {"model": "my_job_module:model", "dataset": "my_job_module:Data", "loss": "mse",
           "optimizer": {"name": "adam", "lr": 0.01}, "global_batch_size": 8, "max_steps": 2,
           "num_workers": 1, "view": "none", "run_dir": str(tmp_path / "run")}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    sweep = {"base": "job.yaml", "n_trials": 1,
             "params": {"model.widthh": {"type": "int", "low": 4, "high": 8}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    env = dict(os.environ, PYTHONPATH=ROOT)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([script, *args], capture_output=True, text=True, timeout=240,
                              cwd=tmp_path, env=env)

    out = run("sweep", "sweep.yaml")  # checked before Ray starts: the module was imported
    assert out.returncode == 2, out.stderr
    assert "params.model.widthh" in out.stderr and "did you mean width" in out.stderr, out.stderr
    assert "No module named" not in out.stderr, out.stderr
    out = run("run", "job.yaml")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: 2 steps" in out.stdout


def test_drain_and_demo_chaos_parse(monkeypatch):
    """``elastic drain JOB NODE [--deadline S]`` asks the job's mailbox to evacuate (the
    request is checked where it enters); ``elastic demo --chaos`` reaches the chaos demo."""
    from elastic import cli, control

    asked = []
    monkeypatch.setattr(cli, "_attach", lambda address: None)
    monkeypatch.setattr(control, "ask", lambda *a, **kw: asked.append((a, kw)) or {"ok": 1})
    assert cli.main(["drain", "myjob", "3f2a9c", "--deadline", "30"]) == 0
    (args, kw), = asked
    assert args == ("myjob", "evacuate", {"node": "3f2a9c", "deadline_s": 30.0})
    demo = []
    import elastic.demo

    monkeypatch.setattr(elastic.demo, "run_chaos_demo", lambda **kw: demo.append(kw) or 0)
    assert cli.main(["demo", "--chaos", "--steps", "50"]) == 0
    assert demo and demo[0]["max_steps"] == 50

