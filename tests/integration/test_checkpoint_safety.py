"""Checkpoint safety (issue 13): the right error class for corruption and for storage
failures, falling back past a corrupt newest checkpoint with notes that name the bad object,
tools that say when nothing was found, and one job per checkpoint URI (claims, owners in
manifests, explicit forks). Ray-free; local disk and S3 (moto)."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import pyarrow.fs as pafs
import pytest
import torch

import elastic.checkpoint.ownership as ownership_mod
from elastic import cli
from elastic.checkpoint import (
    MANIFEST_NAME,
    OWNER_NAME,
    CheckpointMeta,
    CheckpointStore,
    CheckpointWarning,
    check_owner,
    check_resume,
    check_steps,
    claim,
    commit,
    committed_steps,
    find_latest_valid,
    list_checkpoints,
    load,
    load_latest_valid,
    plan_resume,
    read_manifest,
    read_owner,
    release,
    verify,
    write_shard,
)
from elastic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointOwnerError,
    ConfigError,
    StorageError,
)
from strategies import state_hash
from tests.integration.test_checkpoint import make_state, save


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ckpt"))
    server = request.getfixturevalue("s3_server")
    return CheckpointStore(server.uri(), server.options())


def _flip(store: CheckpointStore, step: int, shard: str, offset: int) -> None:
    """Flip the bytes at ``offset`` of a shard file, keeping its size."""
    path = store.path(store.step_name(step), shard)
    with store.fs.open_input_file(path) as f:
        body = bytearray(f.read_at(f.size(), 0))
    body[offset] ^= 0xFF
    with store.fs.open_output_stream(path) as f:
        f.write(bytes(body))


class _FlakyReads:
    """A filesystem whose reads of shard files fail like a dropped connection."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def open_input_file(self, path: str) -> Any:
        if "/shard-" in path:
            raise OSError("injected: connection reset by peer")
        return self._fs.open_input_file(path)


# --------------------------------------------------------------------------- error classes


def test_corruption_and_storage_failures_have_their_classes(store: CheckpointStore) -> None:
    old, new = make_state(seed=1, rows=200), make_state(seed=2, rows=200)
    save(store, 10, old)
    m = save(store, 20, new)
    bad = m.shards[1].path
    _flip(store, 20, bad, 100)  # inside the data region: the index still verifies

    with pytest.raises(CheckpointCorruptError, match="checksum mismatch") as e:
        load(store, 20)
    assert (e.value.step, e.value.shard) == (20, bad)
    err = pickle.loads(pickle.dumps(e.value))  # as it would cross a Ray actor boundary
    assert isinstance(err, CheckpointError) and (err.step, err.shard) == (20, bad)

    # a missing shard of a committed checkpoint is corruption too, not a storage failure
    store.fs.delete_file(store.path(store.step_name(20), bad))
    with pytest.raises(CheckpointCorruptError, match="missing") as e:
        load(store, 20)
    assert e.value.shard == bad

    # a manifest that is not one
    with store.fs.open_output_stream(store.path(store.step_name(20), MANIFEST_NAME)) as f:
        f.write(b"[1, 2]")
    with pytest.raises(CheckpointCorruptError, match="not an elastic checkpoint manifest") as e:
        read_manifest(store, 20)
    assert (e.value.step, e.value.shard) == (20, None)


def test_storage_failure_is_a_storage_error_and_never_a_fallback(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"))
    save(store, 10, make_state(seed=1, rows=64))
    save(store, 20, make_state(seed=2, rows=64))
    store.fs = _FlakyReads(store.fs)
    with pytest.raises(StorageError, match="connection reset"):
        load(store, 20)
    # an outage is not a bad checkpoint: no silent fall back to step 10 (or to scratch)
    with pytest.raises(StorageError):
        find_latest_valid(store)
    with pytest.raises(StorageError):
        load_latest_valid(store)


def test_unreachable_s3_is_a_storage_error(s3_server) -> None:
    store = CheckpointStore(s3_server.uri(), s3_server.options(
        endpoint_override="http://127.0.0.1:9", retries=1))
    with pytest.raises(StorageError, match="cannot reach"):
        find_latest_valid(store)
    with pytest.raises(StorageError, match="cannot reach"):
        store.check_writable()


# --------------------------------------------------------------------------- fallback


def test_restore_falls_back_past_a_corrupt_newest_checkpoint(store: CheckpointStore) -> None:
    """The controller's protocol: pick the newest that verifies (shallow), every rank loads
    it; a rank meeting corruption in its data reports step and shard; pick again without
    that step."""
    old, new = make_state(seed=1, rows=200), make_state(seed=2, rows=200)
    save(store, 10, old)
    m = save(store, 20, new)
    _flip(store, 20, m.shards[0].path, 64)

    manifest, notes = find_latest_valid(store)  # indices verify: the data is not read
    assert manifest is not None and manifest.step == 20 and notes == []
    with pytest.raises(CheckpointCorruptError) as e:
        load(store, manifest)
    manifest, notes = find_latest_valid(store, exclude={e.value.step}, deep=True)
    assert manifest is not None and manifest.step == 10 and notes == []
    assert state_hash(load(store, manifest)) == state_hash(old)

    # deep: the census says which steps verify and names the bad object
    checks = check_steps(store, deep=True)
    assert [(c.step, c.ok, c.corrupt, c.shard) for c in checks] == [
        (20, False, True, m.shards[0].path), (10, True, False, None)]
    assert checks[0].bad_object == f"{store.step_name(20)}/{m.shards[0].path}"
    with pytest.warns(CheckpointWarning):
        manifest, notes = find_latest_valid(store, deep=True)
    assert manifest is not None and manifest.step == 10
    assert len(notes) == 1 and "step 20" in notes[0] and m.shards[0].path in notes[0]

    # a corrupt index is found without deep, and load_latest_valid names it too
    _flip(store, 20, m.shards[1].path, m.shards[1].index_offset + 3)
    with pytest.warns(CheckpointWarning, match="index checksum mismatch"):
        res = load_latest_valid(store)
    assert res is not None and res.step == 10
    assert "step 20" in res.notes[0] and m.shards[1].path in res.notes[0]


# --------------------------------------------------------------------------- nothing found


@pytest.mark.parametrize("where, says", [
    ("missing", "does not exist"),
    ("empty", "holds no step-"),
    ("uncommitted", "without a manifest.json"),
    ("step-dir", "one checkpoint's directory"),
])
def test_tools_say_when_nothing_is_found(tmp_path, capsys, where: str, says: str) -> None:
    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root))
    uri = str(tmp_path / "misspelled")
    if where != "missing":
        uri = str(root)
        root.mkdir()
    if where == "uncommitted":
        write_shard(store, 5, 0, {"model/w": torch.ones(2)})
    if where == "step-dir":
        save(store, 5, make_state(rows=16))
        uri = str(root / store.step_name(5))
    report = verify(CheckpointStore(uri))
    assert report.exit_code == 1 and not report.ok and says in (report.nothing or "")

    assert cli.main(["checkpoints", "verify", uri]) == 1
    out = capsys.readouterr()
    assert says in out.err and uri in out.err
    # (a path that is none fails the listing, as `ls`; a directory lists what it holds)
    assert cli.main(["checkpoints", "list", uri]) == (1 if where == "missing" else 0)
    assert says in capsys.readouterr().out
    assert cli.main(["checkpoints", "inspect", uri]) == 2
    assert says in capsys.readouterr().err


def test_list_and_verify_still_report_checkpoints(tmp_path, capsys) -> None:
    store = CheckpointStore(str(tmp_path))
    save(store, 3, make_state(rows=16))
    assert cli.main(["checkpoints", "verify", str(tmp_path)]) == 0
    assert "step 3: OK" in capsys.readouterr().out
    assert [r.step for r in list_checkpoints(store)] == [3]


# --------------------------------------------------------------------------- ownership


def _tiny_commit(store: CheckpointStore, step: int, owner: str | None = None,
                 extra: dict[str, Any] | None = None) -> Any:
    return commit(store, step, [write_shard(store, step, 0, {"model/w": torch.ones(2) * step})],
                  CheckpointMeta(owner=owner, extra=extra or {}))


def test_one_job_per_checkpoint_uri(store: CheckpointStore) -> None:
    a = claim(store, "job-a")
    assert a.fresh and a.atomic and a.job == "job-a"  # exclusive create / conditional put
    assert read_owner(store).job == "job-a"

    with pytest.raises(CheckpointOwnerError) as e:
        claim(store, "job-b")
    msg = str(e.value)
    assert e.value.owner == "job-a" and "job-a" in msg and "job-b" in msg
    assert "own checkpoint_uri" in msg and "fork" in msg and OWNER_NAME in msg
    assert read_owner(store).job == "job-a"  # the refused claim wrote nothing

    again = claim(store, "job-a")  # a restart or resume of the same job: it takes over
    assert not again.fresh and again.record.job == "job-a" and again.record.nonce != a.record.nonce
    assert read_owner(store).nonce == again.record.nonce
    # the earlier run, still going (a driver cut off, not dead), can no longer commit there
    # (was: both runs of the job committed into one URI, their steps mixed)
    info = write_shard(store, 0, 0, {"model/w": torch.ones(2)})
    with pytest.raises(CheckpointOwnerError, match="another run of job 'job-a' took"):
        commit(store, 0, [info], CheckpointMeta(owner="job-a"), nonce=a.record.nonce)
    assert commit(store, 0, [info], CheckpointMeta(owner="job-a"), nonce=again.record.nonce)

    m = _tiny_commit(store, 1, owner="job-a")
    assert m.owner == "job-a" and read_manifest(store, 1).job == "job-a"
    with pytest.raises(CheckpointOwnerError, match="belongs to job 'job-a'"):
        _tiny_commit(store, 2, owner="job-b")  # a job that lost a claim race cannot commit
    assert check_owner(store, "job-a") == "job-a"
    assert check_owner(m, "job-a") == "job-a"
    with pytest.raises(CheckpointOwnerError, match="fork"):
        check_owner(m, "job-b")

    with pytest.raises(CheckpointOwnerError):
        release(store, "job-b")
    assert release(store, "job-a") and read_owner(store) is None
    with pytest.raises(CheckpointOwnerError, match="wrote checkpoint step 1"):
        claim(store, "job-b")  # no record, but job-a's manifests are there


def test_uri_written_before_owner_records(tmp_path) -> None:
    """Old manifests carry the job in ``extra.job``: that job may claim, another may not."""
    store = CheckpointStore(str(tmp_path))
    m = _tiny_commit(store, 4, extra={"job": "old-job"})
    assert m.owner is None and m.job == "old-job"
    with pytest.raises(CheckpointOwnerError, match="old-job"):
        claim(store, "new-job")
    with pytest.raises(CheckpointOwnerError):
        check_owner(store, "new-job")
    assert claim(store, "old-job").fresh
    plain = CheckpointStore(str(tmp_path / "anonymous"))
    _tiny_commit(plain, 1)  # no owner at all (tests, tools): anyone may claim it
    assert claim(plain, "someone").fresh and check_owner(read_manifest(plain, 1), "x") is None


def test_fork_is_explicit(tmp_path) -> None:
    theirs = CheckpointStore(str(tmp_path / "a"))
    mine = CheckpointStore(str(tmp_path / "b"))
    claim(theirs, "job-a")
    m = _tiny_commit(theirs, 7, owner="job-a")
    # resuming job-a's URI as job-b's own: refused; from job-b's own URI: a fork
    with pytest.raises(CheckpointOwnerError):
        check_resume(theirs, m, "job-b", own=CheckpointStore(f"file://{tmp_path}/a/"))
    fork = check_resume(theirs, m, "job-b", own=mine)
    assert fork.fork and fork.source_owner == "job-a"
    own = check_resume(theirs, m, "job-a", own=theirs)
    assert not own.fork and own.source_owner == "job-a"
    assert claim(mine, "job-b").fresh  # and it writes to its own URI


def test_a_listing_that_races_the_folders_creation_is_retried(tmp_path) -> None:
    """Arrow's local listing of a missing folder (``allow_not_found``) fails when the folder
    appears between its failed listing and its existence check: one of 8 concurrent claims
    on a fresh URI got a ``StorageError`` instead of the owner's refusal (``.ci/run``). The
    listing is tried again; a storage that keeps failing still says so."""
    from types import SimpleNamespace

    from elastic.checkpoint.manifest import _step_dirs

    real = CheckpointStore(str(tmp_path / "race"))
    real.fs.create_dir(real.path("step-000000000005"))
    calls: list[int] = []

    def flaky(selector):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("Cannot list directory: [errno 2] No such file or directory")
        return real.fs.get_file_info(selector)

    store = SimpleNamespace(fs=SimpleNamespace(get_file_info=flaky), root=real.root,
                            uri=real.uri, error=real.error)
    assert list(_step_dirs(store)) == [5] and len(calls) == 2  # type: ignore[arg-type]

    def broken(selector):
        raise OSError("connection reset")

    store.fs = SimpleNamespace(get_file_info=broken)
    with pytest.raises(StorageError, match="listing checkpoints"):
        _step_dirs(store)  # type: ignore[arg-type]


def test_concurrent_claims_one_winner(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path / "race"))
    won: list[str] = []
    refused: list[str] = []
    go = threading.Barrier(8)

    def run(i: int) -> None:
        go.wait()
        try:
            claim(store, f"job-{i}")
            won.append(f"job-{i}")
        except CheckpointOwnerError:
            refused.append(f"job-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1 and len(refused) == 7 and read_owner(store).job == won[0]


def test_s3_without_conditional_put_checks_then_writes(s3_server, monkeypatch) -> None:
    """Without boto3 (or a store that answers 501) the claim is check-then-write with a
    read-back: not atomic, but a second job is still refused."""
    monkeypatch.setattr(ownership_mod, "_s3_client", lambda store: None)
    store = CheckpointStore(s3_server.uri(), s3_server.options())
    c = claim(store, "job-a")
    assert c.fresh and not c.atomic
    with pytest.raises(CheckpointOwnerError):
        claim(store, "job-b")
    assert not claim(store, "job-a").fresh


# --------------------------------------------------------------------------- resume plans


def test_plan_resume(store: CheckpointStore, tmp_path) -> None:
    claim(store, "job-a")
    for step in (10, 20):
        _tiny_commit(store, step, owner="job-a")
    m20 = read_manifest(store, 20)
    _flip(store, 20, m20.shards[0].path, m20.shards[0].index_offset + 2)

    plan = plan_resume("latest", "job-a", own=store, max_steps=100)
    assert (plan.step, plan.fork, plan.source_owner) == (10, False, "job-a")
    assert [(c.step, c.shard) for c in plan.skipped] == [(20, m20.shards[0].path)]
    assert "index checksum mismatch" in plan.skipped[0].note
    assert plan_resume("latest", "job-a", own=store, exclude={20}).skipped == ()
    with pytest.raises(ConfigError, match="max_steps 10"):
        plan_resume("latest", "job-a", own=store, max_steps=10)

    # job-b writing to its own URI may start from job-a's checkpoints: a fork
    mine = CheckpointStore(str(tmp_path / "mine"))
    uri = store.uri
    plan = plan_resume(uri, "job-b", own=mine, options=store.options)
    assert (plan.step, plan.fork, plan.source_owner) == (10, True, "job-a")
    plan = plan_resume(f"{uri}/{store.step_name(10)}", "job-b", own=mine, options=store.options)
    assert plan.step == 10 and plan.fork
    # but not resume job-a's URI as its own
    with pytest.raises(CheckpointOwnerError, match="job-a"):
        plan_resume("latest", "job-b", own=store)
    with pytest.raises(CheckpointError, match="does not exist"):
        plan_resume(str(tmp_path / "typo"), "job-b", own=mine)


# --------------------------------------------------------------------------- one run per URI


def _tracker(uri: str, **kw: Any) -> Any:
    """The controller's checkpoint tracker of a job writing to ``uri`` (no workers)."""
    from elastic.config import JobConfig
    from elastic.control.checkpoints import CheckpointTracker
    from tests.helpers import RegressionData, adam, mlp, mse

    settings: dict[str, Any] = dict(model=mlp, optimizer=adam, loss=mse,
                                    dataset=RegressionData(), global_batch_size=8,
                                    max_steps=100, num_workers=1, view="none", name="job-a",
                                    checkpoint_uri=uri)
    cfg = JobConfig(**{**settings, **kw})
    events: list[tuple[str, str]] = []
    tracker = CheckpointTracker(cfg, CheckpointStore(uri),
                                lambda kind, msg, **_: events.append((kind, msg)))
    tracker.events = events
    return tracker


def test_a_run_that_does_not_resume_is_refused_where_checkpoints_are(tmp_path) -> None:
    """A second run of a job on its own URI without ``resume`` (or forking from another URI
    into it): its steps would be written over the first run's, retention (newest step numbers first) would delete its own checkpoints,
    and a recovery or a later ``resume: latest`` would take the other run's step. Refused
    before anything is written, naming the fix. Was: allowed (same job name)."""
    uri = str(tmp_path / "ckpt")
    _tracker(uri).check_fresh()  # nothing there: fine
    store = CheckpointStore(uri)
    claim(store, "job-a")
    for step in (10, 20):
        _tiny_commit(store, step, owner="job-a")
    with pytest.raises(ConfigError, match=r"checkpoint_uri: .*steps 10 \.\. 20.*resume: latest"):
        _tracker(uri).check_fresh()
    # a fork into it: the same (its steps go to its own URI)
    src = CheckpointStore(str(tmp_path / "src"))
    _tiny_commit(src, 5)
    with pytest.raises(ConfigError, match=r"checkpoint_uri: .*a fork from another URI"):
        _tracker(uri, resume=src.uri).find_resume(src.uri)
    assert committed_steps(store) == [10, 20]


def test_a_rewind_in_the_jobs_own_uri_is_refused_while_newer_steps_are_there(tmp_path) -> None:
    """``resume: <own uri>/step-10`` while step 20 is committed there would write the rewound
    run's steps over the newer ones (and mix the two in retention and recovery): refused, the
    fix a fork. A fork to a URI of its own goes on; ``resume: latest`` past a corrupt newest
    step is no rewind (the step it passes over is known bad)."""
    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    claim(store, "job-a")
    for step in (10, 20):
        _tiny_commit(store, step, owner="job-a")
    pinned = f"{uri}/{store.step_name(10)}"
    with pytest.raises(ConfigError, match=r"resume: step 10 is not the newest.*step 20.*fork"):
        _tracker(uri, resume=pinned).find_resume(pinned)
    fork = _tracker(str(tmp_path / "mine"), resume=pinned)
    assert fork.find_resume(pinned)[1] == 10
    m20 = read_manifest(store, 20)
    _flip(store, 20, m20.shards[0].path, m20.shards[0].index_offset + 2)
    latest = _tracker(uri, resume="latest")
    assert latest.find_resume("latest")[1] == 10 and latest.bad_steps == {20}


def test_steps_found_corrupt_in_a_forks_source_are_not_the_jobs_own(tmp_path) -> None:
    """A fork passes over the source's corrupt step 20; the job's own step 20, committed later,
    is intact and a recovery may use it. Was: one set of step numbers for both URIs, so the
    job's own step 20 was never restored (a recovery went back further, or to step 0)."""
    src = CheckpointStore(str(tmp_path / "src"))
    for step in (10, 20):
        _tiny_commit(src, step)
    m20 = read_manifest(src, 20)
    _flip(src, 20, m20.shards[0].path, m20.shards[0].index_offset + 2)
    own = str(tmp_path / "own")
    tracker = _tracker(own, resume=src.uri)
    assert tracker.find_resume(src.uri)[1] == 10
    _tiny_commit(CheckpointStore(own), 20, owner="job-a")
    assert tracker.valid_steps() == (20,)


def test_a_step_written_again_whole_is_no_longer_bad(tmp_path) -> None:
    """``resume: latest`` passed over a corrupt step 20; the run commits step 20 again, whole:
    it is the newest a recovery may restore. Was: still excluded for the rest of the run."""
    from strategies import StrategySpec

    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    claim(store, "job-a")
    for step in (10, 20):
        _tiny_commit(store, step, owner="job-a")
    m20 = read_manifest(store, 20)
    _flip(store, 20, m20.shards[0].path, m20.shards[0].index_offset + 2)
    tracker = _tracker(uri, resume="latest")
    assert tracker.find_resume("latest")[1] == 10 and tracker.valid_steps() == (10,)

    class OneRank:
        def __init__(self) -> None:
            self.done: list[Any] = []

        def checkpoint_poll(self) -> list[Any]:
            info = write_shard(store, 20, 0, {"model/w": torch.ones(2) * 20})
            return [{"info": info.to_dict()}]

        def checkpoint_done(self, *args: Any) -> None:
            self.done.append(args)

    spec = StrategySpec("dp", 1, (8,))
    tracker.on_metric({"rank": 0, "checkpoint_begun": 20, "checkpoint_blocked_s": 0.0,
                     "generation": 0, "checkpoint_seq": 1}, spec)
    tracker.tick(OneRank())
    assert [k for k, _ in tracker.events][-1] == "checkpoint"
    assert tracker.valid_steps() == (20, 10)


def test_a_short_secret_is_redacted_in_the_manifests_values_not_its_numbers(tmp_path) -> None:
    """A credential of one character ("1", as a test server takes) or a common word: the
    manifest's free-form values are redacted, its numbers, checksums and owner are not, and
    it reads back. Was: the whole JSON text redacted, so ``"version": ***`` was written (over
    a good manifest, on a replay of the commit) and the step no longer read."""
    store = CheckpointStore(str(tmp_path / "ckpt"), {"secret_key": "1", "access_key": "test"},
                            filesystem=pafs.LocalFileSystem())
    for _ in range(2):  # a replay of the same commit
        info = write_shard(store, 1, 0, {"model/w": torch.ones(2)})
        commit(store, 1, [info], CheckpointMeta(owner="test-job",
                                                extra={"note": "key 1 of test", "n": 11}))
    m = read_manifest(store, 1)
    assert m.step == 1 and m.job == "test-job" and m.extra["n"] == 11
    assert m.extra["note"] == "key *** of ***"
    assert check_owner(m, "test-job") == "test-job"


def test_resume_auto_goes_on_where_a_checkpoint_is_and_starts_fresh_where_none_is(tmp_path):
    """``resume: auto`` (a driver that an outside scheduler may run again with the same
    config): the first attempt starts fresh, a later one goes on from the newest committed
    checkpoint of the job's own URI. ``latest`` fails where none is, and a run without
    ``resume`` is refused where one is, so no one config served both attempts."""
    from elastic.control import Controller
    from tests.helpers import mlp
    from tests.unit.fake_group import FakeGroup

    uri = str(tmp_path / "ckpt")
    first = _tracker(uri, resume="auto")
    assert not first.auto_resume()
    first.check_fresh()
    store = CheckpointStore(uri)
    claim(store, "job-a")
    commit(store, 10, [write_shard(store, 10, 0, {f"model/{k}": v for k, v in  # (its model:
        mlp().state_dict().items()})], CheckpointMeta(owner="job-a"))  # the job checks it)
    again = _tracker(uri, resume="auto")
    assert again.auto_resume() and again.find_resume("auto")[1] == 10

    def run(cfg_uri: str) -> list[str]:
        from elastic.config import JobConfig
        from tests.helpers import RegressionData, adam, mse

        fake = FakeGroup(mlp())
        cfg = JobConfig(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(),
                        global_batch_size=8, max_steps=20, num_workers=2, view="none",
                        run_dir=str(tmp_path / f"run-{len(cfg_uri)}"), name="job-a",
                        checkpoint_uri=cfg_uri, resume="auto")
        ctl = Controller(cfg, group_factory=lambda c: fake, mailbox_factory=lambda j: None)
        result = ctl.run()
        return [f"{e.kind}@{e.step}" for e in ctl.events if e.kind == "resumed"] + [
            str(result.history[0]["step"])]

    assert run(uri) == ["resumed@10", "10"]
    assert run(str(tmp_path / "empty-uri")) == ["0"]


def test_a_run_whose_uri_another_run_of_the_job_took_over_stops_at_its_next_commit(tmp_path):
    """Two runs of one job on one URI (the first's driver cut off, not dead; the job started
    again elsewhere): the newer claim takes the URI over, and the earlier run's next commit
    ends it with the reason, committing nothing. Was: both committed there, their steps
    interleaved (same job name, so the owner check let both through)."""
    from strategies import StrategySpec

    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    old = _tracker(uri)
    old.claim()
    claim(store, "job-a")  # the job started again, elsewhere

    class OneRank:
        def __init__(self) -> None:
            self.done: list[Any] = []

        def checkpoint_poll(self) -> list[Any]:
            return [{"info": write_shard(store, 5, 0, {"model/w": torch.ones(2)}).to_dict()}]

        def checkpoint_done(self, *args: Any) -> None:
            self.done.append(args)

    group = OneRank()
    old.on_metric({"rank": 0, "checkpoint_begun": 5, "checkpoint_blocked_s": 0.0,
                   "generation": 0, "checkpoint_seq": 1}, StrategySpec("dp", 1, (8,)))
    with pytest.raises(CheckpointOwnerError, match="another run of job 'job-a' took"):
        old.tick(group)
    assert committed_steps(store) == [] and group.done and group.done[0][:2] == (5, False)


def test_a_resume_under_another_global_batch_or_seed_is_refused(tmp_path) -> None:
    """A step number is a place in the sample stream only under the global batch and seed it
    was trained with: going on from step 10 of a G=16 run with G=8 would train positions
    80..159 of its order again (and the rest of the epoch later than the run it continues
    would). Refused, naming the
    field and the fix; a fork (a new run from its weights) is said in an event. Was: not
    checked (the manifest held both, shown by `elastic checkpoints inspect` only)."""
    uri = str(tmp_path / "ckpt")
    store = CheckpointStore(uri)
    claim(store, "job-a")
    commit(store, 10, [write_shard(store, 10, 0, {"model/w": torch.ones(2)})],
           CheckpointMeta(owner="job-a", rng={"seed": 0},
                          extra={"job": "job-a", "global_batch_size": 16}))
    with pytest.raises(ConfigError, match=r"global_batch_size: is 8, but checkpoint step 10 "
                                          r"was trained with global_batch_size 16"):
        _tracker(uri, resume="latest").find_resume("latest")
    fork = _tracker(str(tmp_path / "mine"), resume=uri)
    assert fork.find_resume(uri)[1] == 10
    assert "resume_sampling" in [k for k, _ in fork.events]
    with pytest.raises(ConfigError, match="seed: is 3"):
        _tracker(uri, resume="latest", seed=3, global_batch_size=16).find_resume("latest")
    assert _tracker(uri, resume="latest", global_batch_size=16).find_resume("latest")[1] == 10
    # the dataset's length, as the driver read it when each run started
    commit(store, 20, [write_shard(store, 20, 0, {"model/w": torch.ones(2)})],
           CheckpointMeta(owner="job-a", rng={"seed": 0}, extra={
               "job": "job-a", "global_batch_size": 16, "dataset_length": 256}))
    grown = _tracker(uri, resume="latest", global_batch_size=16)
    grown.cfg.dataset_length = 300
    with pytest.raises(ConfigError, match="dataset: has 300 samples, but checkpoint step 20 "
                                          "was trained on 256"):
        grown.find_resume("latest")


def test_a_resume_into_another_model_is_refused_on_the_driver(tmp_path) -> None:
    """The job's model is not the one its checkpoint holds (a layer widened, one added): the
    driver reads the checkpoint's shard indices and refuses, naming the entries, before any
    worker starts. Was: found by the workers' load after the cluster was up (found by
    review, session 43). The model it was trained with goes on."""
    from tests.helpers import mlp

    model = mlp()
    src = CheckpointStore(str(tmp_path / "src"))
    commit(src, 10, [write_shard(src, 10, 0, {f"model/{k}": v for k, v in
                                              model.state_dict().items()})], CheckpointMeta())
    tracker = _tracker(str(tmp_path / "own"), resume=src.uri)
    assert tracker.find_resume(src.uri, model)[1] == 10
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError) as e:
        _tracker(str(tmp_path / "own2"), resume=src.uri).find_resume(src.uri, wider)
    msg = str(e.value)
    assert e.value.field == "resume" and "holds another model than this job's" in msg, msg
    assert "0.weight is [16, 8] there, [32, 8] here" in msg and "it lacks 5.bias, 5.weight" in msg
