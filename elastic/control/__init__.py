"""The job's controller: a loop over explicit states (``controller``), the worker group that
is its only Ray-aware code (``worker_group``), the job's mailbox actor (``mailbox``), and the
components it drives: layouts, checkpoints, the step log, membership changes, requests."""

from .controller import Controller
from .mailbox import NAMESPACE, JobControl, actor_name, ask, list_jobs, lookup
from .requests import Request, RequestError
from .states import ControllerState, FitResult

__all__ = ["Controller", "ControllerState", "FitResult", "Request", "RequestError", "NAMESPACE",
           "JobControl", "actor_name", "ask", "list_jobs", "lookup"]
