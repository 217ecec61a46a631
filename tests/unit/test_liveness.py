"""Liveness and the segment watch, without Ray: a worker's connection closing is a loss within
milliseconds; silence is only a suspicion until a ping fails too (a slow step is no false
alarm); a failed future is seen within a slice, not at the controller's next poll."""

from __future__ import annotations

import socket
import time

import pytest

from elastic.control.group import Segment, WorkerRec
from elastic.control.liveness import HELLO, NODE_LOST, Liveness
from elastic.control.watch import GRACE_S, STRAGGLE, SegmentWatch, hung_after
from elastic.errors import GroupError, WorkerLostError
from elastic.failures import classify
from elastic.worker.heartbeat import Heartbeat


def _wait_until(cond, timeout=3.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout
        time.sleep(0.005)
    return time.monotonic() - t0


def test_a_closed_connection_is_a_loss_within_milliseconds():
    live = Liveness("127.0.0.1", timeout_s=5.0)
    try:
        hb = Heartbeat(*live.address, live.token, 7, 0.02)
        _wait_until(lambda: live.connected(7))
        assert live.lost([7]) == {} and live.suspect([7]) == []
        t0 = time.monotonic()
        hb.stop()  # what a process's death does to its socket
        took = _wait_until(lambda: bool(live.lost([7])))
        assert took < 0.5 and live.lost([7])[7] >= t0
        live.forget([7])
        assert live.lost([7]) == {}
    finally:
        live.close()


def test_silence_is_a_suspicion_and_a_wrong_token_is_refused():
    live = Liveness("127.0.0.1", timeout_s=0.2)
    try:
        s = socket.create_connection(live.address)
        s.sendall(HELLO + live.token.encode() + b" 3\n")  # says hello, then nothing
        _wait_until(lambda: live.connected(3))
        _wait_until(lambda: live.suspect([3]) == [3])
        assert live.lost([3]) == {}
        bad = socket.create_connection(live.address)
        bad.sendall(HELLO + b"0" * 32 + b" 4\n")
        time.sleep(0.2)
        assert not live.connected(4)
        s.close()
        bad.close()
    finally:
        live.close()


def test_a_node_loss_said_in_the_same_read_as_the_hello_is_kept():
    """A worker whose raylet went just after it connected: its hello and the node-loss byte
    can reach the controller in one read. Was: everything after the hello line was dropped,
    and the loss was reported as a closed connection, not a node lost (found by review)."""
    live = Liveness("127.0.0.1", timeout_s=5.0)
    try:
        s = socket.create_connection(live.address)
        s.sendall(HELLO + live.token.encode() + b" 5\n" + NODE_LOST)
        _wait_until(lambda: live.node_lost(5))
        s.close()
        _wait_until(lambda: bool(live.lost([5])))
    finally:
        live.close()


def test_a_process_the_job_forked_does_not_hold_the_heartbeat_open():
    """The job's code forks (a data loader's workers, ``fork`` start method) and the worker
    then dies: its connection must close with it. Was: the child held the socket, no FIN
    reached the controller, and the loss waited for the silence timeout (found by review)."""
    import os

    live = Liveness("127.0.0.1", timeout_s=30.0)
    try:
        hb = Heartbeat(*live.address, live.token, 9, 0.02)
        _wait_until(lambda: live.connected(9))
        pid = os.fork()
        if pid == 0:  # the child: outlives the worker's socket for a while
            time.sleep(3.0)
            os._exit(0)
        try:
            hb.stop()  # the worker's end (its process's death closes its socket alike)
            assert _wait_until(lambda: bool(live.lost([9])), timeout=2.0) < 1.0
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    finally:
        live.close()


class _Live:
    timeout_s = 0.1

    def __init__(self):
        self.closed: dict[int, float] = {}
        self.silent: list[int] = []

    def lost(self, ids):
        return {i: t for i, t in self.closed.items() if i in ids}

    def suspect(self, ids, now=None):
        return [i for i in self.silent if i in ids]


def _seg(n=3):
    ws = [WorkerRec(None, i, {}, rank=i) for i in range(n)]
    return Segment(0, 10, [(w, f"fut{i}") for i, w in enumerate(ws)])


def test_the_watch_reports_a_lost_worker_at_once_and_pings_a_silent_one():
    live, pings = _Live(), []
    watch = SegmentWatch(live, lambda w: pings.append(w.rank) or w.rank != 2)
    seg = _seg()
    running = lambda fs, t: ([], list(fs))  # noqa: E731 - nothing finishes
    t0 = time.monotonic()
    live.closed[1] = t0
    poll = watch.poll(seg, 5.0, running, lambda s, d: [], lambda fs: 0)
    assert time.monotonic() - t0 < 0.5 and poll.noticed_by == "liveness"
    assert [f.rank for f in poll.failures] == [1]
    assert isinstance(poll.failures[0].error, WorkerLostError)
    # silent: rank 0 answers its ping (a slow step: no alarm), rank 2 does not
    live.closed.clear()
    live.silent = [0, 2]
    assert [w.rank for w in watch.lost([w for w, _ in seg.running])] == [2]
    assert sorted(pings) == [0, 2]
    pings.clear()
    watch.lost([w for w, _ in seg.running])  # rank 0 cleared a moment ago: not pinged again
    assert pings == [2]


def test_a_failed_future_is_seen_within_a_slice_and_peers_get_a_grace():
    watch = SegmentWatch(None, lambda w: True)
    seg = _seg()
    err = classify(GroupError("rank 0: peer gone"), 0)
    calls = []

    def wait(fs, t):
        calls.append(t)
        return ["fut0"], ["fut1", "fut2"]

    t0 = time.monotonic()
    poll = watch.poll(seg, 30.0, wait, lambda s, d: [err] if d else [], lambda fs: 0)
    took = time.monotonic() - t0
    assert poll.failures == (err,) and poll.noticed_by == "collective"
    assert GRACE_S - 0.1 < took < GRACE_S + 0.5 and max(calls) <= 0.05 + 1e-9
    done = watch.poll(seg, 1.0, lambda fs, t: (list(fs), []), lambda s, d: [], lambda fs: 9)
    assert done.done and done.next_step == 9


_NODE = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(child.pid, flush=True)
time.sleep(60)
"""
_WORKER = r"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("hb", sys.argv[4])  # not the package: no torch
hb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hb)
host, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
beat = hb.Heartbeat(host, port, token, 5, 0.05, node_pid=os.getppid())
if len(sys.argv) > 5:
    beat.mute()  # the pause_silent fault
time.sleep(60)
"""


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("muted", [False, True])
def test_a_worker_whose_node_process_dies_says_so_and_ends_at_once(muted):
    """A stand-in for a node: a parent process (the raylet) with a worker child. Killing the
    parent (what ``remove_node`` does to the raylet) makes the worker's beat say its node is
    gone and end its process within a beat, not at Ray's own once-a-second check. Muted (the
    ``pause_silent`` fault) it says nothing: only its process's end would tell."""
    import os
    import signal
    import subprocess
    import sys

    live = Liveness("127.0.0.1", timeout_s=5.0)
    import elastic.worker.heartbeat as hb

    node = subprocess.Popen([sys.executable, "-c", _NODE, _WORKER, *map(str, live.address),
                             live.token, hb.__file__, *(["mute"] if muted else [])],
                            stdout=subprocess.PIPE)
    try:
        assert node.stdout is not None
        worker = int(node.stdout.readline())
        _wait_until(lambda: live.connected(5), timeout=20.0)
        time.sleep(0.3)
        assert live.lost([5]) == {} and not live.node_lost(5)  # a live node: no alarm
        t0 = time.monotonic()
        node.send_signal(signal.SIGKILL)
        if muted:
            time.sleep(0.5)
            assert live.lost([5]) == {} and not live.node_lost(5) and not _ended(worker)
            os.kill(worker, signal.SIGKILL)  # Ray's own raylet check ends it
            _wait_until(lambda: bool(live.lost([5])))
            assert not live.node_lost(5)
            return
        took = _wait_until(lambda: bool(live.lost([5])))
        assert took < 0.5 and live.node_lost(5)
        _wait_until(lambda: _ended(worker), timeout=1.0)
        assert time.monotonic() - t0 < 1.0
    finally:
        node.kill()
        node.wait()
        live.close()
        try:
            os.kill(worker, signal.SIGKILL)
        except (OSError, UnboundLocalError):
            pass


def test_the_watch_names_a_node_loss_as_such():
    live = _Live()
    live.node_lost = lambda wid: wid == 1  # type: ignore[attr-defined]
    live.closed[1] = time.monotonic()
    poll = SegmentWatch(live, lambda w: True).poll(
        _seg(), 5.0, lambda fs, t: ([], list(fs)), lambda s, d: [], lambda fs: 0)
    err = poll.failures[0].error
    assert isinstance(err, WorkerLostError) and err.node_lost and "raylet" in str(err)


def test_a_call_on_a_lost_worker_is_not_waited_for():
    """``gather``: the controller's calls (metrics, checkpoint polls, typed calls) stop
    waiting for a worker whose connection closed, instead of until Ray declares it dead."""
    live = _Live()
    watch = SegmentWatch(live, lambda w: True)
    ws = [w for w, _ in _seg().running]
    never = lambda fs, t: ([f for f in fs if f != "r1"], [f for f in fs if f == "r1"])  # noqa: E731
    t0 = time.monotonic()
    assert watch.gather(["r0", "r1", "r2"], ws, 0.3, never) == {0, 2}  # not lost: the timeout
    assert 0.25 < time.monotonic() - t0 < 1.0
    live.closed[1] = time.monotonic()
    t0 = time.monotonic()
    assert watch.gather(["r0", "r1", "r2"], ws, 30.0, never) == {0, 2}
    assert time.monotonic() - t0 < 0.5


def test_when_ranks_still_inside_a_call_are_hung():
    """``hung_after``, its whole table: not known until a rank's call failed (then the hang
    window after it), or, for an even call, long after the first answer (``STRAGGLE`` times
    its time, at least the window); whichever comes first."""
    h = 65.0
    assert hung_after(0.0, None, None, h, even=False) is None
    assert hung_after(0.0, None, None, h, even=True) is None
    assert hung_after(0.0, 2.0, None, h, even=False) is None  # unequal work: no cut
    assert hung_after(0.0, 2.0, None, h, even=True) == 2.0 + h  # 10 x 2 s < the window
    assert hung_after(0.0, 20.0, None, h, even=True) == 20.0 + STRAGGLE * 20.0
    assert hung_after(0.0, None, 3.0, h, even=False) == 3.0 + h
    assert hung_after(0.0, None, 3.0, h, even=True) == 3.0 + h
    assert hung_after(0.0, 20.0, 30.0, h, even=True) == 30.0 + h  # the failure's comes first
    assert hung_after(0.0, 1.0, 30.0, h, even=True) == 1.0 + h


def test_a_rank_still_inside_a_call_after_a_peer_failed_is_hung():
    """A worker call outside a segment (a restore, a build): rank 1 never returns (blocked in
    a storage read), rank 0's call fails in its collective (its agreement timed out). Past
    the hang window after that failure, the watch stops waiting and names rank 1 hung;
    without such a failure an uneven call is waited for up to its timeout (its ranks' work
    may differ), an even one until long after the first answer. A rank's own error (a
    corrupt checkpoint) says nothing of the others: no clock starts, and it is the error
    raised (``Gathered.cause``), before a hang."""
    from elastic.errors import CheckpointError, HangError

    watch = SegmentWatch(_Live(), lambda w: True)
    ws = [w for w, _ in _seg(3).running]
    stuck = lambda fs, t: ([f for f in fs if f != "r1"], [f for f in fs if f == "r1"])  # noqa: E731
    timed_out = GroupError("rank 0: the process group failed (timed out)")
    of = lambda r: timed_out if r == "r0" else None  # noqa: E731
    t0 = time.monotonic()
    got = watch.collect(["r0", "r1", "r2"], ws, 30.0, stuck, of, hang_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 1.5
    assert got.ended == {0, 2} and got.hung == {1} and "rank 0's call failed" in got.why
    hang = got.hang_error(ws[1], "restore_checkpoint", 0.3)
    assert got.cause([timed_out, hang]) is hang  # the group's failure only echoes the hang
    corrupt = CheckpointError("checkpoint step 5: shard 2 is corrupt")
    assert got.cause([timed_out, hang, corrupt]) is corrupt  # the caller acts on its own
    assert isinstance(hang, HangError) and "restore_checkpoint" in str(hang)
    t0 = time.monotonic()  # a rank's own error: no clock, the call's timeout only
    got = watch.collect(["r0", "r1", "r2"], ws, 0.6, stuck,
                        lambda r: corrupt if r == "r0" else None, hang_s=0.1)
    assert time.monotonic() - t0 > 0.55 and got.ended == {0, 2} and not got.hung
    t0 = time.monotonic()  # no failure, uneven: only the timeout ends the wait, nobody hung
    got = watch.collect(["r0", "r1", "r2"], ws, 0.6, stuck, lambda r: None, hang_s=0.1)
    assert time.monotonic() - t0 > 0.55 and got.ended == {0, 2} and not got.hung
    got = watch.collect(["r0", "r1", "r2"], ws, 30.0, stuck, lambda r: None, hang_s=0.2,
                        even=True)
    assert got.hung == {1} and "first rank answered" in got.why
    # a lost worker is not hung: liveness says what it is
    live = _Live()
    live.closed[1] = time.monotonic()
    got = SegmentWatch(live, lambda w: True).collect(["r0", "r1", "r2"], ws, 30.0, stuck, of,
                                                     hang_s=0.3)
    assert got.ended == {0, 2} and not got.hung
