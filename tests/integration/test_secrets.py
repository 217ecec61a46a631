"""Secrets are never written (issue 13, 6): credentials in the checkpoint URI (user info or
query string), in ``resume`` and in ``checkpoint_options`` stay out of every file a run writes
(run directory, checkpoint objects), every event, the view, the status and the errors.

Real jobs on a local Ray with checkpoints on a moto S3 server (which accepts any key pair)."""

from __future__ import annotations

import io
import json
import os

import pytest

import elastic
from elastic.errors import CheckpointError
from elastic.view import PlainView
from tests.helpers import RegressionData, adam, mlp, mse

SECRET = "sk-ELASTIC-93f1c0de-SECRET"  # distinctive: searched for in every byte written
ACCESS = "AKIDELASTIC93F1C0DE"


def _job(tmp_path, name, **kw):
    return dict(model=mlp, optimizer=adam, loss=mse, dataset=RegressionData(), global_batch_size=8,
                num_workers=2, run_dir=str(tmp_path / name), name=f"secrets-{name}",
                checkpoint_options={"connect_timeout": 1.0, "request_timeout": 5.0,
                                    "retries": 2}, **kw)


def _written(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.join(d, f)] = fh.read()
    return out


def test_no_file_event_or_message_of_a_run_holds_a_secret(ray_local, tmp_path, s3_server):
    ep, bucket = s3_server.endpoint, s3_server.bucket
    in_userinfo = f"s3://{ACCESS}:{SECRET}@{bucket}/job?endpoint_override={ep}&region=us-east-1"
    in_query = (f"s3://{bucket}/{{}}?access_key={ACCESS}&secret_key={SECRET}"
                f"&endpoint_override={ep}&region=us-east-1")
    shown: list[str] = []

    out1 = io.StringIO()
    first = elastic.fit(**_job(tmp_path, "first", checkpoint_uri=in_userinfo, checkpoint_every=2,
                               max_steps=4), display=PlainView(out1))
    assert [e.kind for e in first.events].count("checkpoint") == 2

    out2 = io.StringIO()  # resume from a URI with query-string keys, write to another one
    handle = elastic.submit(**_job(tmp_path, "second", checkpoint_uri=in_query.format("fork"),
                                   checkpoint_every=3, max_steps=6,
                                   resume=in_query.format("job")), display=PlainView(out2))
    shown.append(json.dumps(handle.status()))
    second = handle.result(timeout=300)
    shown.append(json.dumps(handle.status()))
    assert "resumed" in [e.kind for e in second.events]

    with pytest.raises(CheckpointError) as ei:  # an error that names the resume URI
        elastic.fit(**_job(tmp_path, "third", max_steps=2,
                           resume=f"s3://{ACCESS}:{SECRET}@{bucket}/empty"
                                  f"?endpoint_override={ep}&region=us-east-1"),
                    display=PlainView(io.StringIO()))
    shown += [str(ei.value), repr(ei.value), out1.getvalue(), out2.getvalue()]
    for r in (first, second):
        shown += [json.dumps([e.to_dict() for e in r.events], default=str)]

    files = _written(str(tmp_path))
    assert any(p.endswith("config.json") for p in files) and any(
        p.endswith("events.jsonl") for p in files)
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert any(k.startswith("job/") for k in keys) and any(k.startswith("fork/") for k in keys)
    for k in keys:
        files[f"s3://{bucket}/{k}"] = client.get_object(Bucket=bucket, Key=k)["Body"].read()
    for where, data in files.items():
        for s in (SECRET, ACCESS):
            assert s.encode() not in data, f"{where} holds {s}"
    for text in shown:
        assert SECRET not in text and ACCESS not in text, text
    config = json.loads(files[str(tmp_path / "second" / "config.json")])
    assert "***" in config["resume"] and "***" in config["checkpoint_uri"]
