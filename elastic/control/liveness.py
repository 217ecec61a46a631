"""Liveness: each worker keeps one TCP connection to its controller and writes a byte on it
every ``interval_s``; the controller notices a lost worker from that connection alone.

Why: after a node is lost, the first signals used to be the survivors' collective errors
(gloo sees the dead peer's sockets close: 0.2-1 s, only once its processes are gone, and never
if the host vanished without closing them) and Ray's own death notice (its health check:
periods x threshold, 1.5 s with the tests' fast settings, ~15 s by default). A worker's own
connection closes the moment its process dies (the kernel sends FIN or RST), so the
controller knows *which* rank is lost within milliseconds; and a host that vanished falls
silent, which ``timeout_s`` of silence says. Silence alone is only a suspicion: the caller
confirms it (the worker group pings the actor) before treating the worker as lost, so a slow
step, or a loaded machine that delays the writer thread, is no false alarm (the writer is a
thread of its own, never the step loop).

The listener binds to the controller's node address only (as the group's store does, see
docs/security.md) and accepts a connection only with the job's random token.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time

__all__ = ["Liveness", "HELLO", "NODE_LOST"]

HELLO = b"elastic-live "  # + token + b" " + worker id + b"\n"
NODE_LOST = b"!"  # a worker saw its node's raylet go (elastic.worker.heartbeat) and exits


class Liveness:
    """The controller's side: a listener thread that tracks every worker's connection.

    Thread-safe: ``lost`` and ``suspect`` are read from the controller's thread while the
    listener thread writes.
    """

    def __init__(self, host: str, timeout_s: float = 1.0, interval_s: float = 0.1) -> None:
        self.token = secrets.token_hex(16)
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._srv = socket.socket(family, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((host, 0))
        self._srv.listen(256)
        self._srv.setblocking(False)
        self.address = (host, int(self._srv.getsockname()[1]))
        self._lock = threading.Lock()
        self._seen: dict[int, float] = {}  # worker id -> last byte (monotonic)
        self._closed: dict[int, float] = {}  # worker id -> when its connection closed
        self._node_lost: set[int] = set()  # workers that said their node is gone
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._srv, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="elastic-liveness")
        self._thread.start()

    def _serve(self) -> None:
        pending: dict[socket.socket, bytes] = {}  # connections that have not said hello
        ids: dict[socket.socket, int] = {}
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._srv:
                    try:
                        conn, _ = self._srv.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    pending[conn] = b""
                    self._sel.register(conn, selectors.EVENT_READ, None)
                    continue
                try:
                    data = sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                now = time.monotonic()
                if sock in pending:
                    buf = pending[sock] + data
                    if b"\n" not in buf and data and len(buf) < 256:
                        pending[sock] = buf
                        continue
                    del pending[sock]
                    line, _, rest = buf.partition(b"\n")
                    wid = self._hello(line)
                    if wid is None or not data:
                        self._drop(sock)
                        continue
                    ids[sock] = wid
                    with self._lock:
                        self._seen[wid] = now
                        self._closed.pop(wid, None)
                        if NODE_LOST in rest:  # said in the same read as the hello
                            self._node_lost.add(wid)
                    continue
                wid = ids.get(sock, -1)
                if data and NODE_LOST not in data:
                    with self._lock:
                        self._seen[wid] = now
                    continue
                if data:  # its node is gone: lost now, whether or not the FIN follows
                    with self._lock:
                        self._node_lost.add(wid)
                self._drop(sock)  # EOF or reset: the worker's process is gone
                ids.pop(sock, None)
                with self._lock:
                    self._closed[wid] = now

    def _hello(self, line: bytes) -> int | None:
        if not line.startswith(HELLO):
            return None
        parts = line[len(HELLO):].split(b" ")
        if len(parts) != 2 or not secrets.compare_digest(parts[0], self.token.encode()):
            return None
        try:
            return int(parts[1])
        except ValueError:
            return None

    def _drop(self, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def lost(self, worker_ids: list[int]) -> dict[int, float]:
        """Of ``worker_ids``: those whose connection closed, with when (monotonic)."""
        with self._lock:
            return {w: self._closed[w] for w in worker_ids if w in self._closed}

    def node_lost(self, worker_id: int) -> bool:
        """Whether the worker said its node's raylet is gone before it went."""
        with self._lock:
            return worker_id in self._node_lost

    def suspect(self, worker_ids: list[int], now: float | None = None) -> list[int]:
        """Of ``worker_ids`` that connected: those silent for more than ``timeout_s``
        (the caller confirms before acting)."""
        t = time.monotonic() if now is None else now
        with self._lock:
            return [w for w in worker_ids if w in self._seen and w not in self._closed
                    and t - self._seen[w] > self.timeout_s]

    def connected(self, worker_id: int) -> bool:
        with self._lock:
            return worker_id in self._seen and worker_id not in self._closed

    def forget(self, worker_ids: list[int]) -> None:
        """Workers the job let go on purpose: their closing means nothing."""
        with self._lock:
            for w in worker_ids:
                self._seen.pop(w, None)
                self._closed.pop(w, None)
                self._node_lost.discard(w)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
        for key in list(self._sel.get_map().values()):
            sock = key.fileobj
            if isinstance(sock, socket.socket):
                sock.close()
        self._sel.close()
