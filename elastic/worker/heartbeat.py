"""The worker's side of liveness (``elastic.control.liveness``): one TCP connection to the
controller, a byte on it every ``interval_s``, from a daemon thread of its own (the step loop
never writes it, so a slow step is never silence). The connection closes when the process
dies, which is how the controller learns of it first.

The same thread watches the worker's node: Ray starts a worker as a child of its node's
raylet, and a raylet that is gone is a node that is gone (``remove_node``, a raylet killed by
the OOM killer or crashed, a node torn down). Ray itself then ends the worker, but only at
its own raylet check (once a second: ``raylet_death_check_interval_milliseconds``), and until
then the worker lives on: its connections stay open, it may even go on stepping with its
peers, and nothing tells them. Measured on a ``ray.cluster_utils.Cluster``
(bench/recovery.py): the worker's process went 0.6-1.3 s after ``remove_node``. Here the
beat sees the raylet gone within ``interval_s``, says so (``NODE_LOST``), and ends the process
at once, which closes its liveness connection and its group's sockets, so the controller
knows which rank is lost and the survivors' collectives fail now, not a second later.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections.abc import Callable

__all__ = ["Heartbeat", "NODE_LOST", "NODE_LOST_EXIT", "raylet_parent"]

HELLO = b"elastic-live "  # as elastic.control.liveness.HELLO (the worker does not import it)
NODE_LOST = b"!"  # as elastic.control.liveness.NODE_LOST: "my node's raylet is gone"
NODE_LOST_EXIT = 75  # the worker's exit status after its node's loss


def raylet_parent() -> int | None:
    """The raylet's pid when it is this process's parent (Ray sets ``RAY_RAYLET_PID`` for the
    processes it starts); None outside Ray or when something stands between them (a
    container wrapper), where the parent's end would say nothing about the node."""
    try:
        pid = int(os.environ.get("RAY_RAYLET_PID", "0"))
    except ValueError:
        return None
    return pid if pid > 1 and os.getppid() == pid else None


def _exit() -> None:
    os._exit(NODE_LOST_EXIT)


_LIVE: weakref.WeakSet[Heartbeat] = weakref.WeakSet()  # heartbeats whose socket is open


def _close_in_child() -> None:
    """In a process the job's code forked: the heartbeat's connection is its parent's. Held
    open here, the parent's death (killed, out of memory) would send the controller no FIN,
    and the loss would wait for the silence timeout."""
    for hb in list(_LIVE):
        sock, hb._sock = hb._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


os.register_at_fork(after_in_child=_close_in_child)


class Heartbeat:
    """Started once per worker process; ``stop`` at shutdown. A connection that cannot be
    made is no error: the controller then sees this worker by its other signals.

    ``node_pid``: the parent process whose end means this node is gone (``raylet_parent()``);
    then ``on_node_lost`` runs (by default the process exits with ``NODE_LOST_EXIT``)."""

    def __init__(self, host: str, port: int, token: str, worker_id: int,
                 interval_s: float, node_pid: int | None = None,
                 on_node_lost: Callable[[], None] = _exit) -> None:
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._interval = interval_s
        self._node_pid = node_pid
        self._on_node_lost = on_node_lost
        try:
            self._sock = socket.create_connection((host, port), timeout=5.0)
            self._sock.sendall(HELLO + token.encode() + b" " + str(worker_id).encode() + b"\n")
            _LIVE.add(self)
        except OSError:
            self._sock = None
            if node_pid is None:
                return
        threading.Thread(target=self._beat, daemon=True, name="elastic-heartbeat").start()

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            if self._node_pid is not None and os.getppid() != self._node_pid:
                self._send(NODE_LOST)
                self.stop()
                self._on_node_lost()
                return
            if self._sock is not None and not self._send(b"."):
                if self._node_pid is None:
                    return  # the controller is gone: nothing to tell

    def _send(self, data: bytes) -> bool:
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False

    def mute(self) -> None:
        """Stop watching the node: this process then ends with it without saying so (the
        ``pause_silent`` fault)."""
        self._node_pid = None

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
