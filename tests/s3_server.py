"""A pytest fixture that runs a moto S3 server on 127.0.0.1 for tests of object storage.

One ``moto_server`` process per test session, started on first use on a free port; each test
that asks for ``s3_server`` gets a fresh bucket on it. A test may stop the server (to simulate
an outage) and start it again on the same port; the fixture makes sure the server is up again
before the next test and stops it at the end of the session. moto keeps objects in memory, so a
restart loses every bucket: ``start()`` re-creates the test's bucket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.mp_harness import free_port

__all__ = ["S3Server", "s3_server"]

_START_TIMEOUT_S = 30.0
_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


class S3Server:
    """Handle on one moto_server process. Not thread-safe; one test drives it at a time."""

    def __init__(self, port: int | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()  # below the ephemeral range
        self.bucket = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``, the value for ``endpoint_override``."""
        return f"http://{self.host}:{self.port}"

    def options(self, **extra: Any) -> dict[str, Any]:
        """Store options for elastic.checkpoint: endpoint, test credentials, short timeouts."""
        opts: dict[str, Any] = {
            "endpoint_override": self.endpoint,
            "region": "us-east-1",
            "access_key": _CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret_key": _CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "connect_timeout": 1.0,
            "request_timeout": 5.0,
            "retries": 2,
        }
        opts.update(extra)
        return opts

    def uri(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.bucket}/{prefix}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (same port as before) and wait until it answers; re-create the
        bucket if one was set. Raises RuntimeError if it does not answer within 30 s."""
        if self.running:
            return
        env = dict(os.environ, **_CREDENTIALS)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode} at start")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1.0):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not answer on {self.endpoint}") from None
                time.sleep(0.05)  # polling a child process; there is no event to wait on
        if self.bucket:
            self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        """Kill the server (SIGKILL: an outage, not a clean shutdown) and reap it."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def new_bucket(self) -> str:
        self.bucket = f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=self.bucket)
        return self.bucket

    def client(self) -> Any:
        """A boto3 S3 client on this server (for tests that tamper with objects)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )


@pytest.fixture(scope="session")
def _moto_session() -> Iterator[S3Server]:
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_server(_moto_session: S3Server) -> Iterator[S3Server]:
    """A running moto S3 server with a fresh, empty bucket (``s3_server.bucket``)."""
    _moto_session.bucket = ""
    _moto_session.start()
    _moto_session.new_bucket()
    yield _moto_session
