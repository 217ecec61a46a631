"""The worker's side of liveness (``elastic.control.liveness``): one TCP connection to the
controller, a byte on it every ``interval_s``, from a daemon thread of its own (the step loop
never writes it, so a slow step is never silence). The connection closes when the process
dies, which is how the controller learns of it first."""

from __future__ import annotations

import socket
import threading

__all__ = ["Heartbeat"]

HELLO = b"elastic-live "  # as elastic.control.liveness.HELLO (the worker does not import it)


class Heartbeat:
    """Started once per worker process; ``stop`` at shutdown. A connection that cannot be
    made is no error: the controller then sees this worker by its other signals."""

    def __init__(self, host: str, port: int, token: str, worker_id: int,
                 interval_s: float) -> None:
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection((host, port), timeout=5.0)
            self._sock.sendall(HELLO + token.encode() + b" " + str(worker_id).encode() + b"\n")
        except OSError:
            self._sock = None
            return
        self._interval = interval_s
        threading.Thread(target=self._beat, daemon=True, name="elastic-heartbeat").start()

    def _beat(self) -> None:
        sock = self._sock
        while sock is not None and not self._stop.wait(self._interval):
            try:
                sock.sendall(b".")
            except OSError:  # the controller is gone: nothing to tell
                return

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
