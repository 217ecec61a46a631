"""The job's control actor's body (``elastic.control.mailbox.JobControl``), without Ray: what
an asker gets when the job ends before its request is handled (the CLI's ``ask`` when the
actor is gone: ``tests/integration/test_mailbox_gone.py``)."""

from __future__ import annotations

from elastic.control.mailbox import JobControl


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
