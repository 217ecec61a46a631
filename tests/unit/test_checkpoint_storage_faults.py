"""Storage faults of the checkpoint store: a filesystem that cannot rename, a write that fails
halfway, and ``resume`` URIs whose last name only ends in ``step-<n>``. No Ray."""

from __future__ import annotations

import errno
import os
from typing import Any

import pyarrow.fs as pafs
import pytest

from elastic.checkpoint.location import split_step_dir
from elastic.checkpoint.owner_record import OWNER_NAME, read_owner
from elastic.checkpoint.ownership import claim
from elastic.checkpoint.store import CheckpointStore
from elastic.errors import StorageError


class _NoRename(pafs.LocalFileSystem):
    """Local storage that writes but cannot rename (some FUSE mounts of a bucket)."""

    def move(self, src: str, dest: str) -> None:
        raise OSError(errno.ENOTSUP, "Operation not supported")


class _HalfWrite:
    """An output stream that writes half of what it is given, then finds the disk full."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> _HalfWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.close()

    def write(self, data: bytes) -> int:
        self.inner.write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


class _DiskFull(pafs.LocalFileSystem):
    def open_output_stream(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return _HalfWrite(super().open_output_stream(path, *args, **kwargs))


def test_probe_fails_where_storage_cannot_rename(tmp_path) -> None:
    store = CheckpointStore(str(tmp_path), filesystem=_NoRename())
    with pytest.raises(StorageError, match="cannot rename a file over another") as e:
        store.check_writable()
    assert "s3:// or gs:// URI" in str(e.value)
    assert os.listdir(tmp_path) == []  # neither the probe nor its temporary file is left


def test_a_checkpoint_uri_that_is_a_file_says_so_with_the_fix(tmp_path) -> None:
    """Was: "... is not writable: FileExistsError: [Errno 17] Cannot create directory ...:
    non-directory entry exists", no fix (found by a new user, session 46)."""
    (tmp_path / "ck").write_text("")
    for uri in (tmp_path / "ck", tmp_path / "ck" / "below"):  # the file, or a parent of it
        with pytest.raises(StorageError) as e:
            CheckpointStore(str(uri)).check_writable()
        assert "a file stands where a directory must be" in str(e.value), str(e.value)
        assert "Fix: point the checkpoint URI at a directory" in str(e.value)


def test_probe_passes_and_cleans_up_on_local_storage(tmp_path) -> None:
    CheckpointStore(str(tmp_path)).check_writable()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("uri", ["s3://b/exp/finetune-step-5000", "/ckpt/ft-step-100",
                                 "s3://b/run-step-10?region=us-east-1", "s3://step-5"])
def test_resume_uri_ending_in_step_is_not_split(uri) -> None:
    assert split_step_dir(uri) == (uri, None)


@pytest.mark.parametrize("uri, root, step", [
    ("/ckpt/run/step-100", "/ckpt/run", 100),
    ("/ckpt/run/step-000000000100/", "/ckpt/run", 100),
    ("s3://b/run/step-000000000010?region=us-east-1", "s3://b/run?region=us-east-1", 10),
    ("file:///ckpt/step-3", "file:///ckpt", 3),
])
def test_resume_step_dir_is_split(uri, root, step) -> None:
    assert split_step_dir(uri) == (root, step)


def test_owner_record_survives_a_failed_rewrite(tmp_path) -> None:
    first = claim(CheckpointStore(str(tmp_path)), "job-a")
    before = (tmp_path / OWNER_NAME).read_bytes()
    full = CheckpointStore(str(tmp_path), filesystem=_DiskFull())
    with pytest.raises(StorageError, match="No space left"):
        claim(full, "job-a")  # the same job again: rewrites the record with a new nonce
    assert (tmp_path / OWNER_NAME).read_bytes() == before
    healthy = CheckpointStore(str(tmp_path))
    held = read_owner(healthy)
    assert held is not None and held.nonce == first.record.nonce
    assert claim(healthy, "job-a").record.job == "job-a"  # later claims still work
    assert sorted(os.listdir(tmp_path)) == [OWNER_NAME]  # no temporary file left


def test_a_resume_with_nothing_to_resume_from_gives_one_fix(tmp_path) -> None:
    """Was: "... holds no step-<12 digits> directory. Fix: check the path (...). Fix: check
    the URI, or drop resume to start fresh" (found by a new user, session 46)."""
    from elastic.checkpoint.resume import plan_resume
    from elastic.errors import CheckpointError

    (tmp_path / "empty").mkdir()
    for where in ("empty", "missing"):
        with pytest.raises(CheckpointError) as e:
            plan_resume(str(tmp_path / where), "job-a", own=None)
        assert str(e.value).count("Fix:") == 1, str(e.value)
        assert str(e.value).endswith(", or drop resume to start fresh"), str(e.value)


def test_listing_checkpoints_of_a_path_that_is_none_fails(tmp_path, capsys) -> None:
    """``elastic checkpoints list`` of a missing path exits 1, as ``ls`` does (a script's
    misspelled path; was 0, found by a new user, session 46); of a directory with no
    checkpoint yet, 0."""
    from elastic import cli

    (tmp_path / "empty").mkdir()
    assert cli.main(["checkpoints", "list", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().out
    assert cli.main(["checkpoints", "list", str(tmp_path / "empty")]) == 0


def test_an_unknown_access_key_in_pyarrows_spelling_is_access_denied(tmp_path) -> None:
    """pyarrow writes S3's InvalidAccessKeyId as ``INVALID_ACCESS_KEY_ID``: said as access
    denied with the fix. Was: pyarrow's raw text, no fix (found by a new user, session 47)."""
    store = CheckpointStore(str(tmp_path / "ck"))
    said = store.explain(OSError("When listing objects under key 'x' in bucket 'b': AWS "
                                 "Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: "
                                 "The AWS Access Key Id you provided does not exist"))
    assert "access denied. Fix: check the credentials" in said, said
