"""Ray's drains, for one job (``WorkerGroup``'s): notices of the draining nodes that host its
workers, and drain requests (``job.evacuate``, ``elastic drain``). Ray is reached through
``elastic.ray_connect``."""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..ray_connect import draining_nodes, node_infos, request_drain
from .group import DrainNotice, WorkerRec, drain_notices, drain_reason

__all__ = ["NodeDrains"]


class NodeDrains:
    """The job's view of Ray's drains; each draining node's reason is read once."""

    def __init__(self) -> None:
        self._reasons: dict[str, tuple[str, str]] = {}  # draining node -> (reason, message)

    def notices(self, workers: Sequence[WorkerRec]) -> list[DrainNotice]:
        """Ray's draining nodes that host some of ``workers``, with their deadlines (one GCS
        call, ~1 ms, ``ray_connect.draining_nodes``)."""
        try:
            drained = draining_nodes()
        except Exception:  # noqa: BLE001 - the GCS busy: no news this time
            return []
        return drain_notices(drained or {}, workers, self._reason)

    def _reason(self, node: str) -> tuple[str, str]:
        if node not in self._reasons:
            try:
                self._reasons[node] = drain_reason(node_infos(), node)
            except Exception:  # noqa: BLE001 - the reason is a nicety; the deadline counts
                self._reasons[node] = ("preemption", "")  # see drain_reason
        return self._reasons[node]

    def request(self, node_id: str, deadline_s: float | None, message: str) -> str:
        """Ask Ray to drain ``node_id`` (``ray_connect.request_drain``); its deadline is in
        ``deadline_s`` seconds (None: none). Returns "" when accepted, else Ray's reason."""
        deadline_ms = 0 if deadline_s is None else int((time.time() + deadline_s) * 1000)
        try:
            ok, why = request_drain(node_id, deadline_ms, message)
        except Exception as e:  # noqa: BLE001 - said to the asker
            return f"{type(e).__name__}: {e}"
        return "" if ok else str(why or "refused")
