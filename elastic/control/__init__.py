"""The job's controller: a loop over explicit states (``controller``), the worker group that
is its only Ray-aware code (``worker_group``), the job's mailbox actor (``mailbox``), and the
components it drives: layouts, checkpoints, the step log, membership changes, requests.

Names are imported on first use (PEP 562): the CLI's requests to a running job reach the
mailbox without importing the controller, and with it torch."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .controller import Controller
    from .mailbox import NAMESPACE, JobControl, actor_name, ask, list_jobs, lookup
    from .requests import Request, RequestError
    from .states import ControllerState, FitResult

_WHERE = {"Controller": "controller", "Request": "requests", "RequestError": "requests",
          "ControllerState": "states", "FitResult": "states",
          **{n: "mailbox" for n in ("NAMESPACE", "JobControl", "actor_name", "ask", "list_jobs",
                                    "lookup")}}

__all__ = ["Controller", "ControllerState", "FitResult", "Request", "RequestError", "NAMESPACE",
           "JobControl", "actor_name", "ask", "list_jobs", "lookup"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'elastic.control' has no attribute {name!r}")
