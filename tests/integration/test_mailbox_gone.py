"""The CLI's ``ask`` of a job whose control actor died before it answered (its driver
ended): one ``ElasticError``, not Ray's traceback. Ray's error type is needed, not a
cluster (the handle and ``ray.get`` are stood in for)."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.control import mailbox
from elastic.errors import ElasticError


class _Gone:
    """A control actor's handle whose actor died after the post (the driver ended)."""

    class _Call:
        def __init__(self, fn: Any) -> None:
            self.remote = fn

    def __init__(self) -> None:
        from ray.exceptions import ActorDiedError

        def died(*_: Any) -> Any:
            raise ActorDiedError()

        self.post = self._Call(lambda *a: 1)
        self.get_reply = self._Call(died)


def test_ask_of_a_job_that_ended_before_answering_is_one_error(monkeypatch):
    import ray

    monkeypatch.setattr(mailbox, "lookup", lambda job: _Gone())
    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    with pytest.raises(ElasticError, match=r"job 'j' ended before it answered"):
        mailbox.ask("j", "stop")
