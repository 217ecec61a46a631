"""What a driver refused by a token-protected cluster is told: where its token would come from
and the one setting to change. No Ray cluster: the message is built from the environment."""

from __future__ import annotations

import pytest

from elastic.ray_connect import _auth_error


@pytest.mark.parametrize("env, token_file, why, fix", [
    # a local ray.init() or `ray get-auth-token --generate` left ~/.ray/auth_token, and
    # `ray start --head` turned token authentication on because of it
    ({}, True, "has not turned on", "RAY_AUTH_MODE=token (this driver then sends the token in "
     "~/.ray/auth_token)"),
    ({"RAY_AUTH_TOKEN": "abc"}, True, "has not turned on", "sends the token in RAY_AUTH_TOKEN)"),
    ({"RAY_AUTH_TOKEN_PATH": "TOKEN_FILE"}, False, "has not turned on",
     "in RAY_AUTH_TOKEN_PATH (TOKEN_FILE))"),
    ({"RAY_AUTH_TOKEN_PATH": "/nonexistent/t"}, True, "requires an authentication token",
     "RAY_AUTH_TOKEN=<the cluster's token>"),  # Ray reads only that (missing) file
    ({"RAY_AUTH_MODE": "token"}, True, "rejected this driver's token (from ~/.ray/auth_token)",
     "set RAY_AUTH_TOKEN to the cluster's token"),
    ({}, False, "requires an authentication token", "RAY_AUTH_TOKEN=<the cluster's token>"),
])
def test_a_refused_driver_is_told_where_its_token_comes_from(monkeypatch, tmp_path, env,
                                                              token_file, why, fix):
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    token_path = tmp_path / "token"
    token_path.write_text("1" * 64)
    for k, v in env.items():
        monkeypatch.setenv(k, v.replace("TOKEN_FILE", str(token_path)))
    fix = fix.replace("TOKEN_FILE", str(token_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    if token_file:
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("0" * 64)
    msg = str(_auth_error("127.0.0.1:6379"))
    assert msg.startswith("the Ray cluster at 127.0.0.1:6379 refused this driver: ")
    assert why in msg and fix in msg.split("Fix: ", 1)[1], msg
    assert "0" * 64 not in msg and "abc" not in msg  # never the token itself


@pytest.mark.parametrize("want, cores, cpus, warned", [
    (6, 4, 6, True),      # more workers than cores: the cluster has them, and one warning
    (4, 4, 4, False),
    (1.5, 4, 4, False),   # a fractional need rounds up, the cluster has at least the cores
    (4.2, 4, 5, True),
])
def test_a_local_cluster_for_more_workers_than_cores_is_sized_and_warned(want, cores, cpus,
                                                                         warned):
    """Starting a local Ray for more workers than the machine has cores says so (they would
    share the cores and crawl), in one message naming the fix; ``connect`` gives it as one
    RuntimeWarning. `elastic run` and the demo start real local clusters
    (tests/integration/test_cli.py)."""
    from elastic.ray_connect import local_size

    got, msg = local_size(want, cores)
    assert got == cpus and (msg is not None) == warned
    if msg:
        assert "share the cores" in msg and "Fix: lower num_workers" in msg


def test_the_cluster_ray_start_runs_here_counts_only_while_its_gcs_runs():
    """Ray's address file names a cluster; it is one while a GCS with that address runs (a
    file left by a cluster that is gone is not), and the processes are looked at only when
    there is a file."""
    from elastic.ray_connect import live_address

    looked: list[int] = []

    def live(*addrs: str):
        return lambda: looked.append(1) or frozenset(addrs)

    assert live_address(None, live("10.0.0.1:6379")) is None and not looked
    assert live_address("10.0.0.1:6379", live("10.0.0.1:6379")) == "10.0.0.1:6379"
    assert live_address("10.0.0.1:6379", live()) is None  # its GCS is gone
    assert live_address("10.0.0.1:6379", live("10.0.0.9:6379")) is None  # another cluster


@pytest.mark.parametrize("setting, env, found, want", [
    (None, None, "10.0.0.1:6379", ("10.0.0.1:6379", True)),  # ray start ran here: as ray.init()
    (None, "10.0.0.2:6379", "10.0.0.1:6379", ("10.0.0.2:6379", False)),  # RAY_ADDRESS first
    ("10.0.0.3:6379", None, "10.0.0.1:6379", ("10.0.0.3:6379", False)),  # ray_address first
    ("local", None, "10.0.0.1:6379", (None, False)),  # a private one, asked for
    (None, None, None, (None, False)),  # nothing here: a private one
])
def test_a_job_without_an_address_attaches_to_the_cluster_ray_start_runs_here(
        monkeypatch, setting, env, found, want):
    import elastic.ray_connect as rc

    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(rc, "running_here", lambda: found)
    assert rc.cluster_for(setting) == want
    said = rc.attached_here("10.0.0.1:6379")
    assert "running on this machine at 10.0.0.1:6379" in said and "ray_address: local" in said


def test_a_command_with_no_cluster_to_attach_to_says_so_once_with_one_fix(monkeypatch) -> None:
    """``elastic status`` (the scheduler, ``plan --cluster live``, ...) with no address and no
    cluster on the machine. Was: Ray's own text and elastic's first fix inside a second
    "Fix:" about "the cluster that runs the job", with "unset RAY_ADDRESS" though none was
    set."""
    from elastic import cli, ray_connect
    from elastic.errors import ClusterError

    def attach(addr: str, namespace: str | None = None) -> None:
        assert addr == "auto"
        raise ClusterError(  # as ray_connect.attach words Ray's refusal
            "cannot connect to the Ray cluster at auto: Could not find any running Ray "
            "instance. Please specify the one to connect to by setting `--address` flag or "
            "`RAY_ADDRESS` environment variable.. Fix: check the address or start a cluster "
            "with `ray start --head`, or unset RAY_ADDRESS for a local one.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_connect, "attach", attach)
    with pytest.raises(ClusterError) as ei:
        cli._attach(None)
    msg = str(ei.value)
    assert msg.startswith("no Ray cluster runs on this machine to attach to. Fix: "), msg
    assert msg.count("Fix:") == 1 and "ray start --head" in msg and "unset" not in msg, msg
    token = ClusterError("the Ray cluster at auto refused this driver: it requires an "
                         "authentication token. Fix: set RAY_AUTH_MODE=token ...")

    def refuses(addr: str, namespace: str | None = None) -> None:
        raise token

    monkeypatch.setattr(ray_connect, "attach", refuses)  # a cluster that is there: its own fix
    with pytest.raises(ClusterError) as ei:
        cli._attach(None)
    assert ei.value is token


def test_with_no_cluster_the_cli_says_so_from_rays_own_refusal(tmp_path):
    """The test above supplies Ray's refusal text itself; this one has Ray refuse for real
    (no cluster in a private RAY_TMPDIR, no RAY_ADDRESS), so a reworded refusal in a new Ray
    release shows here: Ray is imported, none is started."""
    import glob
    import os
    import subprocess
    import sys

    def comm(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:  # (the process ended)
            return ""

    if any(comm(p) == "gcs_server" for p in glob.glob("/proc/[0-9]*/comm")):
        pytest.skip("a Ray cluster of someone else's runs on this machine: Ray finds it by "
                    "its processes, in any RAY_TMPDIR, and attaches, so nothing refuses")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "elastic.cli", "status"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "elastic: error: no Ray cluster runs on this machine to attach to. Fix: start one with "
        "`ray start --head`, or pass --address (or set RAY_ADDRESS) to a running cluster's "
        "address."), out.stderr
