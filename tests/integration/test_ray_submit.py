"""`ray up` / `ray submit` / `ray exec` on a cluster launched by Ray's own cluster launcher, its
one node this machine (tests/integration/_this_machine.py: only SSH is swapped for a local
shell). What a user of a `ray up` cluster does: `ray submit cluster.yaml train.py` (an SDK
script) and `ray exec cluster.yaml "elastic run job.yaml"`. Neither sets RAY_ADDRESS: the job
must attach to the head's cluster (it started a private one beside it before 2026-12-04).

The cluster is not taken down with `ray down` (its teardown runs `ray stop`, which ends every
Ray process of the user on the machine): the teardown ends exactly its processes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap

import pytest

from tests.integration.test_job_submit import JOB, _end_head
from tests.mp_harness import free_port

pytestmark = pytest.mark.slow

BIN = os.path.dirname(sys.executable)
HERE = os.path.dirname(os.path.abspath(__file__))

TRAIN = """\
import elastic
import torch
from elastic.models import SyntheticRegression, mlp_loss, tiny_mlp

r = elastic.fit(model=tiny_mlp, optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
                loss=mlp_loss, dataset=SyntheticRegression(), global_batch_size=16,
                max_steps=5, num_workers=2, view="plain", run_dir={run_dir!r})
print("TRAINED", len(r.history))
"""

def _cluster_yaml(home: str, port: int) -> str:
    return textwrap.dedent(f"""\
        cluster_name: elastic-here
        max_workers: 0
        provider: {{type: external, module: _this_machine.ThisMachine, home: {home}}}
        auth: {{ssh_user: {os.environ.get("USER", "root")}}}
        available_node_types:
          head: {{resources: {{CPU: 3}}, node_config: {{}}, max_workers: 0}}
        head_node_type: head
        file_mounts: {{}}
        cluster_synced_files: []
        rsync_exclude: []
        rsync_filter: []
        initialization_commands: []
        setup_commands: []
        head_setup_commands: []
        worker_setup_commands: []
        head_start_ray_commands:
          - ray start --head --port={port} --num-cpus=3 --include-dashboard=false
            --disable-usage-stats --autoscaling-config=~/ray_bootstrap_config.yaml
        worker_start_ray_commands: []
        upscaling_speed: 1.0
        idle_timeout_minutes: 5
        """)


@pytest.fixture()
def launched(tmp_path):
    """`ray up -y` of a one-node cluster on this machine; yields (env, cluster.yaml, home)."""
    tmp = tempfile.mkdtemp(prefix="ru-", dir="/tmp")  # short: Ray's socket paths live in it
    home = os.path.join(tmp, "home")
    os.makedirs(home)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAY_API_SERVER_ADDRESS")}
    env.update(HOME=os.path.join(tmp, "user"), RAY_TMPDIR=os.path.join(tmp, "rt"),
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               PATH=BIN + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(os.path.dirname(HERE))]),
               PYTHONUNBUFFERED="1")
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(_cluster_yaml(home, free_port()))
    up = subprocess.Popen([os.path.join(BIN, "ray"), "up", "-y", "--no-config-cache", str(cfg)],
                          env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = up.communicate(timeout=180)
        assert up.returncode == 0, out
        yield env, str(cfg), home
    finally:
        _end_head(up, up.pid, tmp, "the launched cluster")


def _ray(env: dict[str, str], cwd: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "ray"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_ray_submit_and_ray_exec_run_elastic_on_the_launched_cluster(launched, tmp_path):
    env, cfg, home = launched
    with open(os.path.join(env["RAY_TMPDIR"], "ray", "ray_current_cluster")) as f:
        head = f.read().strip()
    said = f"cluster at step 0: attached to the Ray cluster running on this machine at {head}"

    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(run_dir=str(tmp_path / "sdk")))
    out = _ray(env, str(tmp_path), "submit", cfg, str(script))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TRAINED 5" in out.stdout and said in out.stdout, out.stdout

    with open(os.path.join(home, "job.yaml"), "w") as f:  # (what file_mounts would sync)
        f.write(JOB + f"run_dir: {tmp_path / 'cli'}\n")
    out = _ray(env, str(tmp_path), "exec", cfg, "elastic run job.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert said in out.stdout and "[elastic] done: 5 steps" in out.stdout, out.stdout
    # a shell that has the token but never turned token authentication on (`ray start` turns
    # it on by itself where ~/.ray/auth_token exists): the job attaches as ray.init() does.
    # Was: "refused this driver ... Fix: export RAY_AUTH_MODE=token" (found by a new user)
    with open(os.path.join(home, "job2.yaml"), "w") as f:
        f.write(JOB + f"run_dir: {tmp_path / 'plain'}\n")
    plain = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run([os.path.join(BIN, "elastic"), "run", "job2.yaml"], env=plain,
                         cwd=home, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert said in out.stdout and "[elastic] done: 5 steps" in out.stdout, out.stdout
    wrong = dict(plain, RAY_AUTH_TOKEN=secrets.token_hex(32))  # refused: the head named
    out = subprocess.run([os.path.join(BIN, "elastic"), "run", "job2.yaml", "--set",
                          f"run_dir={tmp_path / 'wrong'}"], env=wrong, cwd=home,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode != 0 and (f"the Ray cluster at {head} refused this driver: it "
                                    "rejected this driver's token (from RAY_AUTH_TOKEN)"
                                    ) in out.stderr, out.stdout + out.stderr
    # both ran on the launched cluster's node, not on a private cluster's
    ask = (f"import json, ray; ray.init(address={head!r}, logging_level='ERROR'); "
           "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive']]))")
    nodes = subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True,
                           text=True, timeout=120)
    assert nodes.returncode == 0, nodes.stderr
    (node,) = json.loads(nodes.stdout.strip().splitlines()[-1])
    for run in ("sdk", "cli"):
        events = [json.loads(x) for x in (tmp_path / run / "events.jsonl").read_text().splitlines()]
        placed = [e for e in events if e["kind"] == "placed"][0]
        assert {w["node_id"] for w in placed["data"]["workers"]} == {node}
