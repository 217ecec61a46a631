"""Live control of a running job from anywhere that reaches its Ray cluster.

Each job registers a small named actor, ``elastic-job:<name>`` in the ``elastic`` namespace. It
holds the job's latest status and a mailbox of requests (switch, stop, scale). The controller
pushes its status and takes requests a few times a second; the CLI (``elastic status|switch|
stop|scale JOB``) posts requests and waits for the controller's reply. A malformed request is
refused by the mailbox itself (``requests.parse``) and never reaches the job. The actor lives
and dies with the job's driver; registering it claims the job's name on the cluster.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ..errors import ElasticError, JobNotFoundError
from .requests import RequestError, parse

__all__ = ["NAMESPACE", "actor_name", "JobControl", "Mailbox", "create", "lookup", "list_jobs",
           "ask"]

NAMESPACE = "elastic"
_PREFIX = "elastic-job:"


def actor_name(job: str) -> str:
    return _PREFIX + job


class JobControl:
    """Mailbox and status board of one job (the body of a Ray actor)."""

    def __init__(self, job: str) -> None:
        self.job = job
        self.status: dict[str, Any] = {"job": job, "state": "starting"}
        self.inbox: list[dict[str, Any]] = []
        self.replies: dict[int, Any] = {}
        self._ids = itertools.count(1)
        self._ended = ""  # why no request is taken any more (the job ended)

    def set_status(self, status: dict[str, Any]) -> None:
        self.status = status

    def end(self, status: dict[str, Any]) -> None:
        """The job ended with ``status``: every request still queued (posted while it was
        starting or finishing, when nothing takes them) is answered that it ended first, and
        so is any posted from now on (was: never answered; the asker then met the actor's
        death as a Ray traceback)."""
        self.status = status
        self._ended = (f"job {self.job!r} ended ({status.get('state', 'ended')}) before the "
                       "request was handled")
        for req in self.take():
            self.replies[req["id"]] = {"error": self._ended}

    def get_status(self) -> dict[str, Any]:
        return self.status

    def post(self, kind: str, value: Any = None, reason: str = "") -> int:
        """Queue a request for the controller; a malformed one is answered at once with its
        error and never queued."""
        rid = next(self._ids)
        try:
            req = parse(kind, value, reason)
        except RequestError as e:
            self.replies[rid] = {"error": str(e)}
            return rid
        if self._ended:
            self.replies[rid] = {"error": self._ended}
            return rid
        self.inbox.append({"id": rid, "kind": req.kind, "value": req.value, "reason": reason})
        return rid

    def take(self) -> list[dict[str, Any]]:
        out, self.inbox = self.inbox, []
        return out

    def reply(self, rid: int, value: Any) -> None:
        self.replies[rid] = value

    def get_reply(self, rid: int) -> Any:
        return self.replies.pop(rid, None)

    def unread_replies(self) -> int:
        return len(self.replies)


class Mailbox:
    """The controller's side of its job's control actor: publish status, take requests,
    reply. Losing the actor must not stop training: each call says whether it worked."""

    def __init__(self, handle: Any, up: Any = None) -> None:
        self._h = handle
        self._up = up  # while its process starts: the first call's result

    def exchange(self, status: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Publish ``status`` and take the queued requests (None: the actor is gone; no
        request while its process is still starting)."""
        import ray

        try:
            if self._up is not None:
                if not ray.wait([self._up], timeout=0)[0]:
                    return []
                ray.get(self._up)
                self._up = None
            self._h.set_status.remote(status)
            return list(ray.get(self._h.take.remote(), timeout=10))
        except Exception:  # noqa: BLE001 - any failure: the mailbox is lost
            return None

    def reply(self, rid: int, out: Any) -> None:
        try:
            self._h.reply.remote(rid, out)
        except Exception:  # noqa: BLE001 - the asker times out
            pass

    def close(self, status: dict[str, Any], linger_s: float = 3.0) -> None:
        """Publish the final status, let askers collect their replies (bounded), then end
        the actor."""
        import time

        import ray

        try:
            if self._up is not None and not ray.wait([self._up], timeout=0)[0]:
                ray.kill(self._h)  # never up: nobody could have asked it anything
                return
            self._h.end.remote(status)
            deadline = time.monotonic() + linger_s
            while ray.get(self._h.unread_replies.remote()) and time.monotonic() < deadline:
                time.sleep(0.1)
            ray.kill(self._h)
        except Exception:  # noqa: BLE001 - already gone
            pass


def create(job: str) -> Mailbox:
    """Start the job's control actor; refuse a name that a running job already uses. Ray
    registers a named actor's name when it is created, so the name is the job's on return;
    the actor's process starts meanwhile (a second or more: a job on warm workers trains
    its first steps before it is up, ``Mailbox.exchange``)."""
    import ray

    try:
        ray.get_actor(actor_name(job), namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise ElasticError(
            f"a job named {job!r} is already running on this cluster. Fix: pick another name "
            f"or stop it with `elastic stop {job}`."
        )
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Pinned to the driver's node: the mailbox must not die with a worker node. Hard
    # affinity: with soft=True Ray may spread it to a worker node (seen with a 0-CPU head).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    try:
        actor: Any = ray.remote(JobControl)
        handle = actor.options(
            name=actor_name(job), namespace=NAMESPACE, num_cpus=0, max_concurrency=1,
            scheduling_strategy=here,
        ).remote(job)  # registered: the name is ours
    except ValueError as e:  # another driver registered the same name between check and create
        raise ElasticError(
            f"a job named {job!r} is already running on this cluster ({e}). Fix: pick another "
            "name."
        ) from None
    return Mailbox(handle, handle.get_status.remote())


def list_jobs() -> list[str]:
    import ray

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"][len(_PREFIX):] for a in names
        if a.get("namespace") == NAMESPACE and a["name"].startswith(_PREFIX)
    )


def lookup(job: str) -> Any:
    import ray

    try:
        return ray.get_actor(actor_name(job), namespace=NAMESPACE)
    except ValueError:
        running = list_jobs()
        hint = f"running jobs: {', '.join(running)}" if running else "no elastic job is running"
        raise JobNotFoundError(
            f"no running elastic job named {job!r} on this cluster ({hint}). Fix: check the name "
            "with `elastic status` or the address in RAY_ADDRESS."
        ) from None


def ask(job: str, kind: str, value: Any = None, reason: str = "requested from the CLI",
        timeout_s: float = 300.0) -> Any:
    """Post a request to a running job and wait for its controller's reply."""
    import ray
    from ray.exceptions import RayActorError

    h = lookup(job)
    deadline = time.monotonic() + timeout_s
    try:
        rid = ray.get(h.post.remote(kind, value, reason))
        while time.monotonic() < deadline:
            out = ray.get(h.get_reply.remote(rid))
            if out is None:
                time.sleep(0.2)
                continue
            if isinstance(out, dict) and out.get("error"):
                raise ElasticError(out["error"])
            return out
    except RayActorError:  # its driver ended (or died) before the answer was read
        raise ElasticError(f"job {job!r} ended before it answered (its control actor is "
                           "gone); `elastic status` lists the running jobs") from None
    raise ElasticError(f"job {job!r} did not answer within {timeout_s:.0f}s")
