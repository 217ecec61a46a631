"""Membership: this rank's place in the current process group, and the control group beside it.

Every membership change is a new *generation* of the group: ``join`` forms it (a TCPStore
rendezvous at the address the controller names, a new port per generation), ``leave`` tears
it down. Rank 0 hosts the store on a socket it bound to its node's address
(``listen_socket``), not on every interface as ``init_method="tcp://..."`` would: the store
has no authentication, so it listens only where the group's peers reach it
(docs/security.md). Beside the default group, each generation has a gloo group of its own for the
per-step control all-reduce (``control_group``), kept out of torch's group registry.
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from strategies import Runtime, health

__all__ = ["NCCL_ENV", "Membership", "Waitable", "control_group", "listen_socket",
           "nccl_env_defaults"]

# NCCL's watchdog tears the whole process down when a collective fails or times out, by
# default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, "SkipCleanUp": SHOULD_TEAR_DOWN in torch's
# ProcessGroupNCCL.hpp): a survivor of a peer's loss would die with it, where elastic keeps
# survivors' processes and memory. 2 ("CleanUpOnly") aborts the communicators and leaves the
# error to the call waiting on them, which the worker's error boundary turns into a group
# failure. Read when a NCCL group is made; a value the user set is kept. NOT yet run on a GPU
# (no device machine has been lent): bench/gpu_check.py is where to check it first.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_env_defaults(environ: Any = None) -> dict[str, str]:
    """Set ``NCCL_ENV``'s variables the environment does not set; returns those it set."""
    import os

    env = os.environ if environ is None else environ
    out = {}
    for k, v in NCCL_ENV.items():
        if k not in env and k.removeprefix("TORCH_") not in env:  # torch reads both names
            env[k] = v
            out[k] = v
    return out


def listen_socket(ip: str) -> socket.socket:
    """A listening TCP socket on a free port of ``ip`` only (the node's address): rank 0's
    store takes it over (``TCPStore(master_listen_fd=...)``), so the port cannot be taken
    between choosing it and using it, and nothing listens on other interfaces."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 0))
    s.listen(128)
    return s


class Waitable(Protocol):
    """An operation in flight (a ``dist.Work``, or one already done)."""

    def wait(self) -> Any: ...


def control_group(rank: int, world: int, generation: int, timeout_s: float,
                  name: str = "elastic-ctrl") -> Any:
    """A gloo group of the same ranks for the per-step control all-reduce, kept out of
    torch's group registry. That all-reduce runs asynchronously behind the next step; if a
    peer dies, it can stay blocked on a *live* peer until the group timeout, and tearing down
    a registered group (``destroy_process_group`` shuts every group down) waits for its
    in-flight work: two survivors leaving would each wait out the timeout (measured: 30 s of
    a pipeline recovery). ``Membership.leave`` hands this group to a thread that lets it end
    instead. None if it cannot be made (then the control all-reduce is synchronous)."""
    try:
        from torch._C._distributed_c10d import ProcessGroupGloo

        store = dist.PrefixStore(f"{name}/{generation}",
                                 dist.distributed_c10d._get_default_store())
        return ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - a torch without these internals: synchronous control
        return None


def _retire(pg: Any, work: Any) -> None:
    """Let a control group's last operation end (at once, or at its timeout after a
    failure), then drop it: its destructor joins its threads, so not on a caller's thread."""
    try:
        if work is not None:
            work.wait()
    except Exception:  # noqa: BLE001 - a failed peer: the error is expected
        pass
    del pg, work


class _Done:
    """A finished operation (the synchronous fallback of the control all-reduce)."""

    def wait(self) -> bool:
        return True


class _Recorded:
    """A control all-reduce in flight whose failure is recorded in ``strategies.health``: it
    is waited for from the step loop's own code, where nothing else says the group failed."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> Any:
        try:
            return self._work.wait()
        except Exception as e:
            health.record(f"control all-reduce: {type(e).__name__}")
            raise


class Membership:
    """This rank's group: rank, world size and generation (-1, 0, 0 before the first
    ``join``), the default process group and the control group of that generation.

    Not thread-safe: ``join`` and ``leave`` run on one thread at a time (the actor's lock
    and the controller's protocol see to it); ``ctrl_allreduce`` runs on the step loop's.
    """

    def __init__(self, backend: str, device: torch.device, copies: bool = False) -> None:
        self.backend = backend
        self.device = device
        self._copies = copies  # each generation also gets a group for the peer copies
        self.copies_group: Any = None  # (elastic.worker.peer_copies), outside the registry
        self.rank = -1
        self.world = 0
        self.generation = 0
        self._ctrl_pg: Any = None  # the control all-reduce's own gloo group (control_group)
        self._ctrl_work: Any = None  # its last operation
        self._listener: socket.socket | None = None  # rank 0's store socket (listen_socket)

    def open_port(self, ip: str) -> int:
        """Bind a listening socket on ``ip`` for the next group's store (this worker is to be
        its rank 0) and return its port."""
        self.close_port()
        self._listener = listen_socket(ip)
        return int(self._listener.getsockname()[1])

    def close_port(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def join(self, addr: str, port: int, rank: int, world: int, generation: int,
             timeout_s: float) -> None:
        """Form generation ``generation`` of the group (collective with the other ranks;
        the caller has left any previous one). Nothing has failed in a new group yet:
        ``strategies.health`` is reset."""
        health.reset()
        timeout = timedelta(seconds=timeout_s)
        fd = None
        if rank == 0 and self._listener is not None:
            # The store owns the socket from here on, and closes it, also when it fails (a
            # peer that never comes): ours must let go first. Closing it after a failed
            # store would close whatever reused that descriptor number meanwhile (a gloo
            # pair's or Ray's socket), under the component that uses it.
            fd = self._listener.detach()
            self._listener = None
        store = dist.TCPStore(addr, port, world, rank == 0, timeout, master_listen_fd=fd)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world,
                                timeout=timeout)
        self._ctrl_pg = control_group(rank, world, generation, timeout_s)
        if self._copies and world > 1:
            self.copies_group = control_group(rank, world, generation, timeout_s,
                                              "elastic-copies")
        self.rank, self.world, self.generation = rank, world, generation

    def leave(self) -> None:
        """Tear down the group, if any, without waiting for the control group's last
        operation (see ``control_group``). A group whose peers died may fail to close
        cleanly; that is ignored. The caller drops every other reference to the group first
        (the layout), or its sockets stay open."""
        pg, work = self._ctrl_pg, self._ctrl_work
        self._ctrl_pg = self._ctrl_work = None
        if pg is not None:  # never joined here: see control_group
            threading.Thread(target=_retire, args=(pg, work), daemon=True,
                             name="elastic-retire-ctrl").start()
            del pg, work
        if self.copies_group is not None:  # an exchange may be blocked on a lost peer
            threading.Thread(target=_retire, args=(self.copies_group, None), daemon=True,
                             name="elastic-retire-copies").start()
            self.copies_group = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers died may not close cleanly
                pass

    def runtime(self) -> Runtime:
        """Where a layout runs: this rank of this world, on this worker's device."""
        return Runtime(self.rank, self.world, self.device)

    def ctrl_allreduce(self, ctrl: torch.Tensor) -> Waitable:
        """Start the control all-reduce (a sum, CPU tensor) on the control group; returns a
        waitable. Synchronous over the default group when there is no control group."""
        if self._ctrl_pg is None:
            dist.all_reduce(ctrl)
            return _Done()
        try:
            work = self._ctrl_pg.allreduce([ctrl])
        except Exception as e:
            health.record(f"control all-reduce: {type(e).__name__}")
            raise
        self._ctrl_work = work
        return _Recorded(work)

    def all_ranks(self, ok: bool) -> bool:
        """Collective over the default group: True on every rank iff ``ok`` on every rank."""
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        dist.all_reduce(flag)
        return flag.item() == 0
