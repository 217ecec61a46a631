"""The job's control actor's body (``elastic.control.mailbox.JobControl``) and the CLI's
``ask``, without Ray: what an asker gets when the job ends before its request is handled."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.control import mailbox
from elastic.control.mailbox import JobControl
from elastic.errors import ElasticError


def test_a_request_posted_while_the_job_ends_is_answered_that_it_ended():
    """``elastic stop JOB`` while the job places its workers or writes its final checkpoint
    (nothing takes requests then), and one posted after its end: each is answered that the
    job ended first. Was: never answered; the asker met the actor's death as a traceback
    (found by review, session 44)."""
    box = JobControl("j")
    early = box.post("stop", None, "from the CLI")
    box.end({"job": "j", "state": "finished"})
    late = box.post("switch", "zero2", "from the CLI")
    for rid in (early, late):
        assert box.get_reply(rid) == {"error": "job 'j' ended (finished) before the request "
                                               "was handled"}
    assert box.take() == [] and box.get_status()["state"] == "finished"


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
