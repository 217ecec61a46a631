"""Checkpoints in a running job: asynchronous sharded saves every K steps, committed by the
controller; resume on another strategy and world size continues the single-process
trajectory; a real S3 server (moto, over HTTP) that dies mid-run costs a checkpoint, not the
job."""

from __future__ import annotations

import time

import pytest
import torch

import elastic
from elastic.checkpoint import CheckpointReader, CheckpointStore, committed_steps, export, load
from elastic.reference import reference_train
from tests.helpers import RegressionData, adam, max_diff, mlp, mse

G = 12
TOL = 1e-5


def _cfg(tmp_path, **kw):
    base = dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=G,
                num_workers=2, view="none", run_dir=str(tmp_path / "run"))
    base.update(kw)
    return base


def test_periodic_checkpoints_then_resume_resharded(ray_local, tmp_path):
    uri = str(tmp_path / "ckpt")
    # one job (a name of its own: the checkpoint URI is claimed for it), run twice
    r1 = elastic.fit(**_cfg(tmp_path, max_steps=12, checkpoint_uri=uri, checkpoint_every=4,
                            keep_last=2, name="ck-job"))
    assert committed_steps(CheckpointStore(uri)) == [8, 12]  # retention: keep the last 2
    ck = [e for e in r1.events if e.kind == "checkpoint"]
    assert [e.data["step"] for e in ck] == [4, 8, 12]
    saved = load(CheckpointStore(uri), 12)
    assert max_diff({k[6:]: v for k, v in saved.items() if k.startswith("model/")},
                    r1.state_dict()) == 0.0
    # step 8's parameters were copied beside step 9's compute (asynchronous host copy): the
    # checkpoint still holds step 8, not a later state
    ref8, _ = reference_train(mlp, adam, mse, RegressionData(), G, 8, seed=0)
    assert max_diff(_model(load(CheckpointStore(uri), 8)), ref8) < TOL
    # resume on 3 workers under zero3: same trajectory as 16 uninterrupted steps; it writes
    # its own checkpoints as each rank's rows of every entry (no gather)
    uri2 = str(tmp_path / "ckpt-zero3")
    r2 = elastic.fit(**_cfg(tmp_path, max_steps=16, checkpoint_uri=uri, resume="latest",
                            num_workers=3, strategy="zero3", run_dir=str(tmp_path / "run2"),
                            name="ck-job"))
    assert [h["step"] for h in r2.history] == [12, 13, 14, 15]
    resumed = next(e for e in r2.events if e.kind == "resumed")
    # each zero3 rank read only its rows: about a third of the state, every byte once
    reads, total = resumed.data["bytes_read"], resumed.data["state_bytes"]
    assert len(reads) == 3 and max(reads) < 0.5 * total
    assert total <= sum(reads) <= total + 3 * 64, (reads, total)  # Adam's 0-dim steps: each rank
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 16, seed=0)
    assert max_diff(r2.state_dict(), ref) < TOL
    r3 = elastic.fit(**_cfg(tmp_path, max_steps=6, checkpoint_uri=uri2, checkpoint_every=3,
                            num_workers=3, strategy="zero3", run_dir=str(tmp_path / "run3")))
    st = CheckpointStore(uri2)
    ref3, _ = reference_train(mlp, adam, mse, RegressionData(), G, 3, seed=0)
    assert max_diff(_model(load(st, 3)), ref3) < TOL
    assert max_diff(_model(load(st, 6)), r3.state_dict()) == 0.0
    with CheckpointReader(st, 6) as rd:
        assert sum(len(ix.items) for ix in rd.indices()) > len(rd.tensors())  # row pieces
    # export: one plain PyTorch file, loadable without elastic. The resumed run, without a
    # cadence (checkpoint_every 0), still wrote its last step (was: none, the job's 4 steps
    # past 12 in no checkpoint)
    assert committed_steps(CheckpointStore(uri))[-1] == 16
    out = tmp_path / "model.pt"
    export(CheckpointStore(uri), str(out), "latest")
    plain = torch.load(out, weights_only=True)
    assert max_diff(plain, r2.state_dict()) == 0.0


def test_s3_server_dies_mid_run_job_keeps_training(ray_local, tmp_path, s3_server):
    s3_server.start()
    s3_server.new_bucket()
    handle = elastic.submit(**_cfg(tmp_path, max_steps=60, checkpoint_uri=s3_server.uri("job"),
                                   checkpoint_options=s3_server.options(), checkpoint_every=5,
                                   loss=_slow_mse,
                                   # a due checkpoint skips, rather than waits out, an upload
                                   # still failing (~2.3 s of the S3 client's retries each)
                                   checkpoint_wait_s=0.5))
    t0 = time.time()
    while not any(e.kind == "checkpoint" for e in handle.controller.events):
        assert not handle.done() and time.time() - t0 < 120, handle.controller.events
        time.sleep(0.1)
    s3_server.stop()
    result = handle.result(timeout=300)
    kinds = [e.kind for e in result.events]
    assert "checkpoint_failed" in kinds and kinds[-1] == "finished"
    assert len(result.history) == 60
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 60, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL
    text = " ".join(e.message for e in result.events)
    assert s3_server.options()["secret_key"] not in text


def _model(state):
    return {k[len("model/"):]: v for k, v in state.items() if k.startswith("model/")}


def _slow_mse(out, y):
    time.sleep(0.02)
    return mse(out, y)


def _flip_data_byte(store: CheckpointStore, step: int) -> str:
    """Flip one byte of the first tensor's data in one shard of ``step`` (the index and the
    manifest stay sound: only reading the data finds it). Returns the shard's name."""
    with CheckpointReader(store, step) as rd:
        rec = rd.manifest.shards[-1]
        ix = rd.index(rec.rank)
        item = max(ix.items, key=lambda it: it.length)  # a parameter or an optimizer entry
    path = store.path(store.step_name(step), rec.path)
    with store.fs.open_input_file(path) as f:
        body = bytearray(f.read_at(f.size(), 0))
    body[item.offset + item.length // 2] ^= 0xFF
    with store.fs.open_output_stream(path) as f:
        f.write(bytes(body))
    return str(rec.path)


def test_resume_falls_back_past_a_corrupt_newest_checkpoint(ray_local, tmp_path):
    """One flipped byte in a shard of the newest checkpoint: resume="latest" restores the
    next older intact one, an event names the bad object, and the run then trains the
    single-process trajectory from there."""
    uri = str(tmp_path / "ckpt")
    elastic.fit(**_cfg(tmp_path, max_steps=8, checkpoint_uri=uri, checkpoint_every=4,
                       name="fallback-job"))
    shard = _flip_data_byte(CheckpointStore(uri), 8)
    r = elastic.fit(**_cfg(tmp_path, max_steps=12, checkpoint_uri=uri, resume="latest",
                           name="fallback-job", run_dir=str(tmp_path / "run2")))
    bad = [e for e in r.events if e.kind == "checkpoint_corrupt"]
    assert len(bad) == 1 and bad[0].data["step"] == 8 and shard in bad[0].message, bad
    resumed = next(e for e in r.events if e.kind == "resumed")
    assert resumed.data["step"] == 4 and resumed.step == 4  # (the event said step 0)
    # the job's first events carry the step found first (8; they said 0), later ones the
    # step it fell back to
    assert [e.step for e in r.events if e.kind in ("start", "placed")] == [8, 8], r.events
    assert all(e.step >= 4 for e in r.events) and r.events[-1].step == 12
    assert [h["step"] for h in r.history] == list(range(4, 12))
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, 12, seed=0)
    assert max_diff(r.state_dict(), ref) < TOL


def test_a_second_job_on_a_claimed_uri_is_refused_before_writing(ray_local, tmp_path):
    from elastic.errors import CheckpointOwnerError

    uri = str(tmp_path / "shared")
    elastic.fit(**_cfg(tmp_path, max_steps=4, checkpoint_uri=uri, checkpoint_every=2,
                       name="job-a"))
    before = sorted(p.name for p in (tmp_path / "shared").iterdir())
    with pytest.raises(CheckpointOwnerError, match="job-a"):
        elastic.fit(**_cfg(tmp_path, max_steps=4, checkpoint_uri=uri, checkpoint_every=2,
                           name="job-b", run_dir=str(tmp_path / "run-b")))
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == before
    # forking is explicit: job b starts from a's checkpoint and writes to its own URI
    r = elastic.fit(**_cfg(tmp_path, max_steps=6, checkpoint_uri=str(tmp_path / "b"),
                           resume=uri, name="job-b", run_dir=str(tmp_path / "run-b2")))
    assert any(e.kind == "forked" for e in r.events)
    assert [h["step"] for h in r.history] == [4, 5]


def test_a_resize_during_an_upload_keeps_checkpointing(ray_local, tmp_path):
    """The job grows 2 -> 3 while a checkpoint uploads (rank 0's uploads are slow: 1.5 s
    each, so one is in flight at every boundary). That checkpoint needs the group that began
    it: before the fix the grown group could never commit it, ranks 0 and 1 held it, every
    later checkpoint was skipped after waiting ``checkpoint_wait_s``, and the end of the run
    waited 300 s. Now the resize gives it up to ``checkpoint_wait_s`` to commit first (the
    ``scaled`` event says so), and every later one is taken."""
    uri = str(tmp_path / "ckpt")
    slow = [{"rank": 0, "step": s, "action": "slow_upload", "seconds": 1.5}
            for s in range(5, 2000, 5)]  # however long the spare takes to start
    handle = elastic.submit(**_cfg(
        tmp_path, loss=_slow_mse, max_steps=100_000, min_workers=1, max_workers=3,
        scale_check_s=3600, checkpoint_uri=uri, checkpoint_every=5, checkpoint_wait_s=20,
        faults=slow))
    t0 = time.time()
    while handle.status().get("step", 0) < 6:
        assert not handle.done(), handle.result()
        assert time.time() - t0 < 120, handle.status()
        time.sleep(0.02)
    assert handle.scale(3, timeout=90) == 3
    grown = handle.status()["step"]
    while handle.status().get("step", 0) < grown + 7:  # one checkpoint after the resize
        assert not handle.done(), handle.result()
        assert time.time() - t0 < 180, [e.message for e in handle.controller.events]
        time.sleep(0.05)
    handle.stop()
    result = handle.result(timeout=60)
    kinds = [(e.kind, e.step, e.message) for e in result.events if e.kind != "state"]
    assert not [k for k in kinds if k[0] in ("checkpoint_skipped", "checkpoint_failed")], kinds
    committed = [e.data["step"] for e in result.events if e.kind == "checkpoint"]
    n = len(result.history)  # the stop's final checkpoint is of the step it stopped at
    assert committed == sorted(set(range(5, n + 1, 5)) | {n}) and n > grown + 5, kinds
    scaled = [e for e in result.events if e.kind == "scaled"]
    assert [(e.data["from"], e.data["to"]) for e in scaled] == [(2, 3)], kinds
    wait = scaled[0].data["checkpoint_wait"]
    assert wait is not None and wait["committed"], kinds  # one was in flight, and committed
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, len(result.history), seed=0)
    assert max_diff(result.state_dict(), ref) < TOL
    assert committed_steps(CheckpointStore(uri))[-1] == committed[-1]


def test_an_upload_that_never_returns_is_given_up_and_checkpoints_go_on(ray_local, tmp_path):
    """Rank 1's upload of checkpoint 5 blocks for good (``pause_upload``: a storage call that
    never returns, as on a hung network mount). After ``checkpoint_upload_timeout_s`` the
    controller gives it up, and rank 1, whose upload thread is still stuck, takes the next
    checkpoint with a new writer. Before, every later checkpoint was skipped (each after
    ``checkpoint_wait_s``) and the end of the run waited 300 s for it."""
    from tests.ray_fixtures import _POOL

    uri = str(tmp_path / "ckpt")
    steps = 40
    failed_resets = _POOL[0].info()["retired"].get("its reset failed", 0)
    result = elastic.fit(**_cfg(
        tmp_path, loss=_slow_mse, max_steps=steps, checkpoint_uri=uri, checkpoint_every=5,
        keep_last=20, checkpoint_wait_s=0.5, checkpoint_upload_timeout_s=2.0,
        faults=[{"rank": 1, "step": 5, "action": "pause_upload",
                 "dir": str(tmp_path / "faults")}]))
    kinds = [(e.kind, e.step, e.message) for e in result.events if e.kind != "state"]
    failed = [e for e in result.events if e.kind == "checkpoint_failed"]
    assert [e.data["step"] for e in failed] == [5] and "given up" in failed[0].message, kinds
    committed = [e.data["step"] for e in result.events if e.kind == "checkpoint"]
    assert committed and committed[-1] == steps and steps - 5 in committed, kinds
    assert committed_steps(CheckpointStore(uri))[-1] == steps
    # the warm pool's worker whose upload thread is still stuck is retired at once (its
    # reset says so), not kept with that thread and its host copy
    assert _POOL[0].info()["retired"].get("its reset failed", 0) == failed_resets + 1
    ref, _ = reference_train(mlp, adam, mse, RegressionData(), G, steps, seed=0)
    assert max_diff(result.state_dict(), ref) < TOL


@pytest.mark.cold_workers  # a worker process dies: none of the warm pool's
def test_a_worker_lost_while_the_storage_is_down_ends_the_job_not_restarts_it(
        ray_local, tmp_path, s3_server):
    """zero2 on 2 workers, checkpoints on S3; the S3 server dies, then rank 1's process dies
    at step 60: the survivor does not hold the lost shard, and the checkpoints cannot be
    listed. The job ends on the StorageError (its checkpoints, on a store that comes back,
    intact). Was: the listing failure read as "no checkpoint", and the job restarted from
    step 0 ("recovered from scratch"), to write its steps over them. The unit test holds the
    same with a fake group; this one on real workers, a real S3 server and a real process
    death."""
    from elastic.errors import StorageError

    s3_server.start()
    s3_server.new_bucket()
    handle = elastic.submit(**_cfg(tmp_path, strategy="zero2", min_workers=1, max_steps=400,
                                   checkpoint_uri=s3_server.uri("job"),
                                   checkpoint_options=s3_server.options(), checkpoint_every=5,
                                   loss=_slow_mse, checkpoint_wait_s=0.5,
                                   faults=[{"rank": 1, "step": 60, "action": "exit"}]))
    t0 = time.time()
    while not any(e.kind == "checkpoint" for e in handle.controller.events):
        assert not handle.done() and time.time() - t0 < 120, handle.controller.events
        time.sleep(0.1)
    assert handle.status()["step"] < 50  # the storage goes before the loss
    s3_server.stop()
    with pytest.raises(StorageError, match="listing checkpoints"):
        handle.result(timeout=300)
    kinds = [e.kind for e in handle.controller.events]
    assert "failure" in kinds and "recovered" not in kinds
