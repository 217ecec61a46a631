"""Fault injection: a test aid that makes a chosen rank fail at a chosen step.

``JobConfig.faults`` lists ``{rank, step, action, dir?}``. An entry fires at the start of
step ``step`` on the worker that is rank ``rank`` then, at most once per job: firing first
creates the marker ``fired-rank{r}-step{s}`` in the fault directory (``dir``, default
``<run_path>/faults``) with ``O_EXCL``, so a recovered job that replays the step does not
fire it again. Actions:

* ``exit``: the process dies at once (``os._exit(1)``);
* ``pause``: writes ``paused-rank{r}-step{s}.json`` ({node_id, pid, rank, step, generation},
  atomically), then blocks until the process is killed: a test waits for that file (an event,
  not a sleep) and removes the node;
* ``pause_silent``: as ``pause``, but the process will not tell the controller that its node
  went (its heartbeat stops watching the raylet): it ends with its node at Ray's own check,
  unannounced, as on a machine that vanishes, and the controller finds it gone before Ray
  does;
* ``hang``: blocks forever inside the step: its peers' collectives time out;
* ``raise``: ``RuntimeError`` from the job's code path (a user error);
* ``nan``: this rank's batch inputs are NaN for that step (for integer inputs: the outputs
  of the blocks it computes), so the loss and gradients are not finite;
* ``pause_upload``: as ``pause``, but on the upload thread, once this rank's shard of
  checkpoint ``step`` (the checkpoint taken after ``step`` steps) has begun to upload and
  while its training goes on: a node lost in the middle of an upload, on purpose.
* ``corrupt_copy``: one byte of a buddy's copy this rank holds is flipped (peer copies), so
  a restore from it must find the checksum wrong and fall back to storage;
* ``slow``: that step waits ``seconds`` before it computes (a slow device or a straggler, as
  the emulated slowdown makes one): its peers wait for it in their collectives, and nothing
  may take it for a lost worker;
* ``slowdown``: from that step on, this rank computes ``factor`` times slower (its blocks'
  forwards and backwards, as an emulated slower device: ``Profiler.set_emulation``): a
  straggler that appears mid-run, seen in the rank's own compute figure;
* ``slow_upload``: this rank's upload of checkpoint ``step`` waits ``seconds`` once it has
  begun (slow storage), while training goes on;
* ``hang_restore``: this rank blocks forever when it begins to read checkpoint ``step`` in a
  restore (a storage read that never returns, as on a hung network mount), outside any
  training step: its peers time out in the restore's agreement;
* ``exit_final``: the process dies as the job's final state is gathered after ``step``
  steps (its peers inside that gather), outside any training step.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import JobConfig, WorkerConfig

__all__ = ["Faults", "FaultInjected", "nan_inputs"]


class FaultInjected(RuntimeError):
    """The ``raise`` fault: what user code raising looks like to elastic."""


_ELSEWHERE = ("pause_upload", "slow_upload", "hang_restore", "exit_final")  # not at a
# step's start


def _block_forever() -> None:
    threading.Event().wait()


class Faults:
    """The job's fault entries, indexed by (rank, step); a no-op when there are none.

    ``node_id`` says which node this process runs on (for ``pause``); ``block``, ``exit``,
    ``corrupt``, ``mute`` and ``slowdown`` are what ``pause``/``hang``, ``exit``,
    ``corrupt_copy``, ``pause_silent`` and ``slowdown`` do (tests replace them).
    """

    def __init__(self, config: JobConfig | WorkerConfig, node_id: Callable[[], str | None] = lambda: None,
                 block: Callable[[], None] = _block_forever,
                 exit: Callable[[int], Any] = os._exit,
                 corrupt: Callable[[], Any] = lambda: None,
                 mute: Callable[[], Any] = lambda: None,
                 slowdown: Callable[[float], Any] = lambda factor: None) -> None:
        self._at: dict[tuple[int, int], list[dict[str, Any]]] = {}
        for f in config.faults or []:
            self._at.setdefault((int(f["rank"]), int(f["step"])), []).append(f)
        self._default_dir = os.path.join(config.run_path, "faults") if self._at else ""
        self._node_id = node_id
        self._block = block
        self._exit = exit
        self._corrupt = corrupt
        self._mute = mute
        self._slowdown = slowdown

    def at_step(self, rank: int, step: int, generation: int) -> bool:
        """At the start of ``step`` on ``rank``: fire the entries due there that have not
        fired yet in this job. Returns whether this step's inputs are to be made NaN
        (``nan``); the other actions act here (and ``raise`` raises)."""
        entries = self._at.get((rank, step))
        if not entries:
            return False
        nan = False
        for f in entries:
            if f["action"] in _ELSEWHERE:
                continue  # fires on the upload thread (in_upload) or in a restore
            where = f.get("dir") or self._default_dir
            if not self._claim(where, rank, step, f["action"]):
                continue
            action = f["action"]
            if action == "exit":
                self._exit(1)
            elif action in ("pause", "pause_silent"):
                if action == "pause_silent":
                    self._mute()
                self._write_paused(where, rank, step, generation)
                self._block()
            elif action == "hang":
                self._block()
            elif action == "raise":
                raise FaultInjected(f"fault injected at rank {rank}, step {step} (faults)")
            elif action == "nan":
                nan = True
            elif action == "corrupt_copy":
                self._corrupt()
            elif action == "slow":
                time.sleep(float(f["seconds"]))
            elif action == "slowdown":
                self._slowdown(float(f["factor"]))
        return nan

    def in_upload(self, rank: int, step: int, generation: int) -> None:
        """On the upload thread, after bytes of this rank's shard of checkpoint ``step`` were
        written: fire a due ``pause_upload`` (write the report, block the thread) or
        ``slow_upload`` entry (wait its ``seconds``)."""
        for f in self._at.get((rank, step), ()):
            if f["action"] not in ("pause_upload", "slow_upload"):
                continue
            where = f.get("dir") or self._default_dir
            if not self._claim(where, rank, step, f["action"]):
                continue
            if f["action"] == "slow_upload":
                time.sleep(float(f["seconds"]))
            else:
                self._write_paused(where, rank, step, generation)
                self._block()

    def in_restore(self, rank: int, step: int) -> None:
        """As ``rank`` begins to read checkpoint ``step``: a due ``hang_restore`` blocks."""
        if self._due(rank, step, "hang_restore"):
            self._block()

    def in_final(self, rank: int, step: int) -> None:
        """As ``rank`` begins to give its part of the final state after ``step`` steps: a due
        ``exit_final`` ends the process."""
        if self._due(rank, step, "exit_final"):
            self._exit(1)

    def _due(self, rank: int, step: int, action: str) -> bool:
        """Whether an ``action`` entry at (``rank``, ``step``) fires now (once per job)."""
        return any(f["action"] == action and self._claim(
            f.get("dir") or self._default_dir, rank, step, action)
            for f in self._at.get((rank, step), ()))

    @staticmethod
    def _claim(where: str, rank: int, step: int, action: str) -> bool:
        """Create the entry's marker atomically; False if it exists (fired before)."""
        os.makedirs(where, exist_ok=True)
        try:
            fd = os.open(os.path.join(where, f"fired-rank{rank}-step{step}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(f"{action} pid {os.getpid()}\n")
        return True

    def _write_paused(self, where: str, rank: int, step: int, generation: int) -> None:
        info = {"node_id": self._node_id(), "pid": os.getpid(), "rank": rank, "step": step,
                "generation": generation}
        path = os.path.join(where, f"paused-rank{rank}-step{step}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)


def nan_inputs(x: torch.Tensor, blocks: Callable[[], list[torch.nn.Module]]
               ) -> tuple[torch.Tensor, contextlib.AbstractContextManager[Any]]:
    """The ``nan`` fault for one step: NaN inputs when they are floating point; else (token
    ids) the inputs as they are, and a context in which the outputs of ``blocks()`` (the
    modules this rank computes) are NaN."""
    if x.is_floating_point():
        return torch.full_like(x, float("nan")), contextlib.nullcontext()
    return x, _nan_outputs(blocks())


@contextlib.contextmanager
def _nan_outputs(blocks: list[torch.nn.Module]) -> Iterator[None]:
    def hook(_mod: Any, _args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            return out * float("nan")
        return out

    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
