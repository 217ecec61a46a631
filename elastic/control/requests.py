"""Requests to a running job (switch, scale, stop, ...), validated where they enter.

A request comes from the SDK handle (in the driver's process), from the CLI through the job's
mailbox actor, or from the controller itself (a spare joined, the ``on_step`` callback asked
to stop). ``parse`` checks its kind and the type of its value before it is queued, so a
malformed request is refused with the fix and never reaches the controller's loop; what
depends on the job (the size range, the strategy's fit) is checked at the step boundary and
refused there, with the job going on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ElasticError, InfrastructureError

__all__ = ["Request", "RequestError", "Inbox", "parse", "KINDS", "PUBLIC_KINDS"]

# what the SDK, CLI and mailbox may ask
PUBLIC_KINDS = ("switch", "scale", "stop", "memory", "evacuate")
# the controller's own: "grow" (a warm spare is up), "notice" (a node announced its end)
KINDS = PUBLIC_KINDS + ("grow", "notice")
URGENT = ("notice", "evacuate")  # taken before the others (``Inbox.take``)


class RequestError(ElasticError):
    """A request that cannot be carried out as given; the job goes on unchanged."""


@dataclass
class Request:
    """A request posted to a running controller. ``reply`` (SDK) or ``remote_id`` (mailbox)
    says where the answer goes."""

    kind: str
    value: Any = None
    reason: str = "requested"
    reply: queue.Queue[Any] | None = None
    remote_id: int | None = None


def ask(controller: Any, req: Request, timeout: float | None) -> Any:
    """Post ``req`` to ``controller`` (in this process) and wait for its answer: the answer,
    or the error it was refused with; ``TimeoutError`` saying the request may still be
    carried out when no answer comes in ``timeout`` seconds (was: a bare ``queue.Empty``)."""
    req.reply = queue.Queue()
    controller.post(req)
    try:
        out = req.reply.get(timeout=timeout)
    except queue.Empty:
        what = f"{req.kind} {req.value}" if req.value is not None else req.kind
        raise TimeoutError(f"{what} not answered within {timeout:g} s (the job's step boundary "
                           "did not come; it may still be carried out there)") from None
    if isinstance(out, BaseException):
        raise out
    return out


def parse(kind: Any, value: Any = None, reason: str = "requested", *,
          internal: bool = False) -> Request:
    """A validated ``Request``; ``RequestError`` naming the fix otherwise. ``internal``
    admits the controller's own kinds."""
    kinds = KINDS if internal else PUBLIC_KINDS
    if not isinstance(kind, str) or kind not in kinds:
        raise RequestError(f"unknown request {kind!r}. Fix: ask one of {', '.join(PUBLIC_KINDS)}")
    if kind == "scale":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("+").isdigit():
                value = int(value)
            else:
                raise RequestError(f"scale needs a whole number of workers, got {value!r}. "
                                   "Fix: e.g. `elastic scale JOB 4` or job.scale(4)")
        if value < 1:
            raise RequestError(f"scale needs at least 1 worker, got {value}")
    elif kind == "switch":
        if not isinstance(value, str) or not value.strip():
            raise RequestError(f"switch needs a strategy name, got {value!r}. Fix: e.g. "
                               "`elastic switch JOB zero3`")
        value = value.strip()
    elif kind == "evacuate":
        value = _evacuation(value)
    elif value is not None:
        raise RequestError(f"{kind} takes no value, got {value!r}")
    return Request(kind, value, str(reason or "requested"))


def _evacuation(value: Any) -> dict[str, Any]:
    """``{"node": id or prefix, "deadline_s": seconds or None}`` from a node id string or
    such a mapping."""
    fix = ("Fix: e.g. `elastic drain JOB 3f2a9c01` or job.evacuate(\"3f2a9c01\", "
           "deadline_s=120)")
    if isinstance(value, str):
        value = {"node": value}
    if not isinstance(value, dict) or set(value) - {"node", "deadline_s"}:
        raise RequestError(f"evacuate needs a node id, got {value!r}. {fix}")
    node, deadline = value.get("node"), value.get("deadline_s")
    if not isinstance(node, str) or not node.strip():
        raise RequestError(f"evacuate needs a node id, got {node!r}. {fix}")
    if deadline is not None and (isinstance(deadline, bool)
                                 or not isinstance(deadline, (int, float)) or deadline < 0):
        raise RequestError(f"evacuate's deadline must be seconds >= 0, got {deadline!r}. {fix}")
    return {"node": node.strip(), "deadline_s": None if deadline is None else float(deadline)}


class Inbox:
    """The requests a running job has yet to act on, and where their answers go.

    Requests arrive from the SDK (``post``, any thread) and from the job's mailbox actor
    (``poll_mailbox``, the controller's thread); the controller takes them one at a time at
    a step boundary (``take``) and answers each (``answer``). Growth that waits for room is
    parked (``park``) and answered once met or refused after its deadline."""

    def __init__(self, mailbox: Any, emit: Callable[..., Any]) -> None:
        self.mailbox = mailbox
        self._emit = emit
        self._queue: queue.Queue[Request] = queue.Queue()
        self.parked: list[tuple[Request, float]] = []  # growth asked for, not met yet
        self.in_hand: Request | None = None  # taken, neither answered nor parked yet
        self._lock = threading.Lock()
        self._closed: Exception | None = None  # the job ended: why

    def post(self, req: Request) -> bool:
        """Queue ``req`` (thread-safe); a malformed one, or one posted after the job ended,
        is answered at once with its error. Returns whether it was queued."""
        try:
            req.value = parse(req.kind, req.value, req.reason, internal=True).value
        except RequestError as e:
            self.answer(req, e)
            return False
        with self._lock:  # a post racing the job's end is queued before close drains, or
            closed = self._closed  # it sees the end: never queued with nobody to answer
            if closed is None:
                self._queue.put(req)
        if closed is not None:
            self.answer(req, closed)
            return False
        return True

    def waiting(self) -> bool:
        return not self._queue.empty()

    def has(self, kind: str) -> bool:
        return any(r.kind == kind for r in list(self._queue.queue))

    def urgent(self) -> bool:
        """Whether a node's announced end waits (``URGENT``): acted on before anything else
        at a boundary, a scheduled switch included."""
        return any(r.kind in URGENT for r in list(self._queue.queue))

    def take(self) -> Request | None:
        """The next request, held ``in_hand`` until it is answered or parked (an error on
        the way: ``fail_in_hand``): a node's announced end (``URGENT``) before the others,
        which it would otherwise wait behind (its deadline spent on a switch; a scale-down
        letting a healthy worker go and keeping the one whose node is leaving)."""
        with self._queue.mutex:  # (Queue's own lock: a post from another thread waits)
            items = self._queue.queue
            first = next((r for r in items if r.kind in URGENT), None)
            if first is not None:
                items.remove(first)
                self.in_hand = first
                return first
        try:
            self.in_hand = self._queue.get_nowait()
        except queue.Empty:
            return None
        return self.in_hand

    def fail_in_hand(self, err: BaseException, status: dict[str, Any] | None = None) -> None:
        """The request taken was not carried out (its handling raised): its asker hears why
        now, not at a timeout (the SDK's 300 s, and the scheduler's tick with it). An
        evacuation cut by a lost worker is said to follow the recovery (its notice is kept:
        ``Evacuation.run``); was the bare error, for a drain then carried out."""
        req = self.in_hand
        if req is not None and req.kind == "evacuate" and isinstance(err, InfrastructureError):
            err = RequestError(f"the evacuation was cut by {type(err).__name__}: "
                               f"{str(err).splitlines()[0][:200] if str(err) else ''}; the "
                               "job recovers first, then carries it out at the next step "
                               "boundary if the node still hosts its workers")
        self.answer(req, err if isinstance(err, Exception) else RequestError(
            f"the job was interrupted ({type(err).__name__}) before the request was done"),
            status)

    def answer(self, req: Request | None, result: Any, status: dict[str, Any] | None = None
               ) -> None:
        """Send ``result`` (a value, or an exception: a refusal) where ``req`` asked."""
        if req is None:
            return
        if req is self.in_hand:
            self.in_hand = None
        if req.reply is not None:
            req.reply.put(result)
        if req.remote_id is not None and self.mailbox is not None:
            out = {"error": str(result)} if isinstance(result, BaseException) else {
                "ok": True, "result": result, "status": status or {}}
            self.mailbox.reply(req.remote_id, out)

    def poll_mailbox(self, status: dict[str, Any]) -> None:
        """Publish ``status`` and queue what was posted to the mailbox. Losing the mailbox
        does not stop the job: remote control is then off, and the event says so."""
        if self.mailbox is None:
            return
        taken = self.mailbox.exchange(status)
        if taken is None:
            self._emit("control_lost", "the job's control actor failed; remote control is off "
                       "for this job, the SDK handle still works")
            self.mailbox = None
            return
        for r in taken:
            self.post(Request(r["kind"], r["value"], r["reason"] or "requested remotely",
                              remote_id=r["id"]))

    def park(self, req: Request, deadline: float) -> None:
        if req is self.in_hand:
            self.in_hand = None
        self.parked.append((req, deadline))

    def settle_parked(self, workers: int, now: float, refuse: Callable[[int], Exception],
                      status: Callable[[], dict[str, Any]] = dict) -> bool:
        """Answer parked growth that ``workers`` meets; refuse (``refuse(n)``) what is past
        its deadline; each answer with the job's ``status()`` (was: an empty one). Returns
        whether any was refused."""
        keep, refused = [], False
        for req, deadline in self.parked:
            if workers >= int(req.value):
                self.answer(req, workers, status())
            elif now > deadline:
                self.answer(req, refuse(int(req.value)), status())
                refused = True
            else:
                keep.append((req, deadline))
        self.parked = keep
        return refused

    def close(self, why: Exception, status: dict[str, Any]) -> None:
        """The job ended: answer everything left, and whatever is posted from now on, with
        ``why``; then close the mailbox."""
        with self._lock:
            self._closed = why
        self.answer(self.in_hand, why)  # taken and never answered (its handling gave up)
        while (req := self.take()) is not None:
            self.answer(req, why)
        for req, _ in self.parked:
            self.answer(req, why)
        self.parked = []
        if self.mailbox is not None:
            self.mailbox.close(status)
            self.mailbox = None
