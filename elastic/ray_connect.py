"""Connecting to Ray: attach to the cluster a job names, or start a private local one.

The one place a driver calls ``ray.init``, and the driver side's named actors (the
scheduler's: start, find, call, end) so that their modules stay free of Ray. Errors say
what to do: an unreachable address names the fix, a cluster that refuses the driver for want
of a token (seen in milliseconds from the GCS's gRPC status, where ``ray.init`` retries for
~20 s) names ``RAY_AUTH_TOKEN``, and a local cluster started for more workers than the
machine has cores warns once (they would share the cores and every step would crawl).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

from .errors import ClusterError
from .ray_address import auth_error, check_reachable, host_port, token

_auth_error = auth_error  # (its old name)

__all__ = ["connect", "disconnect", "check_reachable", "host_port", "address_of", "attach",
           "LocalNodes", "named_actors", "named_actor", "start_named", "call", "kill", "dumps",
           "loads", "draining_nodes", "node_infos", "request_drain", "node_alive", "pg_ready",
           "bundle_count", "bundle_node", "start_in_bundle", "new_bundle", "remove_bundle", "wait_refs",
           "get_ref", "actor_key", "free_by_node", "runtime_env_now", "ray_session",
           "table_sizes", "join_tables", "free_cpus", "running_here", "live_address",
           "cluster_for", "attached_here", "resources_free"]


def address_of(explicit: str | None) -> str | None:
    """The Ray address a job names: ``ray_address``, else ``$RAY_ADDRESS``, else None (the
    cluster ``ray start`` runs on this machine if there is one, else a private local one)."""
    return explicit or os.environ.get("RAY_ADDRESS") or None


def running_here() -> str | None:
    """The GCS address of the Ray cluster ``ray start`` started on this machine, found as
    ``ray.init()`` finds it (Ray's address file in its temp dir) and only while that GCS
    runs; None when there is none. On a ``ray up`` head (``ray submit``, ``ray exec``, a
    shell there) this is the whole cluster: a private one would leave its nodes idle."""
    try:
        from ray._private.services import find_bootstrap_address, find_gcs_addresses

        def live() -> Any:
            getattr(find_gcs_addresses, "cache_clear", lambda: None)()  # Ray keeps its find
            return find_gcs_addresses()

        return live_address(find_bootstrap_address(None), live)
    except Exception:  # noqa: BLE001 - another Ray's internals: start a private one
        return None


def live_address(addr: str | None, live: Callable[[], Any]) -> str | None:
    """``addr`` (what Ray's address file says) while a GCS with that address runs
    (``live()``: the running GCS addresses, looked up only when there is a file)."""
    return addr if addr and addr in live() else None


def cluster_for(address: str | None) -> tuple[str | None, bool]:
    """Where a driver with ``ray_address=address`` attaches: (the address, or None for a
    private local cluster; whether it is the cluster ``ray start`` runs on this machine,
    found as ``ray.init()`` would find it). ``ray_address``, then ``$RAY_ADDRESS``, then
    that cluster; ``"local"`` always asks for a private one."""
    addr = address_of(address)
    if addr is None and (here := running_here()) is not None:
        return here, True
    return (addr, False) if addr and addr != "local" else (None, False)


def attached_here(addr: str) -> str:
    """What a driver that attached to the cluster running on its machine says."""
    return (f"attached to the Ray cluster running on this machine at {addr} (started by "
            "`ray start`); ray_address: local runs the job on a private one instead")


def _auth_metadata(send: bool = False) -> tuple[tuple[str, str], ...]:
    """The token header this driver's Ray calls would carry (none unless RAY_AUTH_MODE=token,
    or ``send``: attaching with ``auto``, which takes the head's token authentication), read
    by Ray's own loader (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    if not send and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ()
    if not send:
        try:
            from ray._private.authentication.grpc_authentication_client_interceptor import (
                _get_authentication_metadata_tuple,
            )

            return tuple(_get_authentication_metadata_tuple())
        except Exception:  # noqa: BLE001 - Ray's private helper moved: as its loader reads
            pass
    return (("authorization", f"Bearer {t}"),) if (t := token()) else ()


def _refuses(addr: str, send: bool = False) -> bool:
    """Whether the cluster's GCS at ``addr`` answers a call carrying this driver's credentials
    (none, or its token) with gRPC's UNAUTHENTICATED status: a typed answer, in milliseconds.
    ``ray.init`` would instead retry for ~20 s and then report that it could not connect."""
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # pragma: no cover - both ship with ray
        return False
    try:
        with grpc.insecure_channel(addr) as channel:
            stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(),  # type: ignore[attr-defined]
                              timeout=3, metadata=_auth_metadata(send))
    except grpc.RpcError as e:
        return bool(e.code() == grpc.StatusCode.UNAUTHENTICATED)
    except Exception:  # noqa: BLE001 - anything else: let ray.init say what is wrong
        return False
    return False


def attach(addr: str, namespace: str | None = None, shown: str | None = None) -> None:
    """Attach this process to the running cluster at ``addr`` (``auto`` finds a local head;
    ``shown``: the address its errors name, that head's)."""
    import ray

    gcs = addr if addr != "auto" and not addr.startswith("ray://") else None
    auto = shown if addr == "auto" else None  # (the head it finds: its token, as ray.init)
    if gcs is not None or auto is not None:
        check_reachable(gcs or str(auto))
        if _refuses(gcs or str(auto), send=gcs is None):
            raise auth_error(gcs or str(auto), sent=gcs is None)
    try:
        ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False,
                 namespace=namespace)
    except Exception as e:
        from ray.exceptions import AuthenticationError

        if isinstance(e, AuthenticationError) or (gcs and _refuses(gcs)):
            raise auth_error(shown or addr, sent=auto is not None) from None
        raise ClusterError(
            f"cannot connect to the Ray cluster at {shown or addr}: {e}. Fix: check the address "
            "or start a cluster with `ray start --head`, or unset RAY_ADDRESS for a local one."
        ) from e


def connect(address: str | None, local_cpus: float,
            say: Callable[[str], Any] | None = None) -> bool:
    """Attach to ``address`` (or ``$RAY_ADDRESS``, or the cluster ``ray start`` runs on this
    machine, as ``ray.init()`` would: ``say`` is told), or start a private local cluster with
    at least ``local_cpus`` logical CPUs (``address="local"`` always does). Returns True when
    this call started Ray (the caller then shuts it down). Does nothing if Ray is already
    initialised in this process."""
    import ray

    if ray.is_initialized():
        return False
    addr, here = cluster_for(address)
    if addr is not None:
        attach("auto" if here else addr, shown=addr)  # (the head's token auth, as ray.init())
        if here and say is not None:
            say(attached_here(addr))
        return False
    cpus, crowded = local_size(local_cpus, os.cpu_count() or 1)
    if crowded:
        warnings.warn(crowded, RuntimeWarning, stacklevel=3)  # (no log line beside: twice)
    ray.init(address="local", num_cpus=cpus, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False, _system_config=LOCAL_CONFIG)
    return True


def local_size(local_cpus: float, cores: int) -> tuple[int, str | None]:
    """The logical CPUs of a private local cluster for ``local_cpus`` workers' worth on a
    machine of ``cores``, and the warning to give when they would share the cores."""
    need = int(local_cpus + 0.999)
    if need <= cores:
        return cores, None
    return need, (f"starting a local Ray cluster for {need} workers on a machine with {cores} "
                  "cores: they will share the cores and run slower than fewer workers would. "
                  "Fix: lower num_workers/max_workers, or attach to a larger cluster "
                  "(ray_address).")


# A private local cluster's Ray workers import torch and the worker actor's code before they
# take an actor (Ray's prestarted workers), so a worker starts in ~0.3 s rather than ~2.5 s;
# with no dashboard, Ray's metrics have no reader, and their exporter held a driver's
# ray.shutdown() for 20-27 s after a node loss.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "elastic.worker.actor")
LOCAL_CONFIG = {"preload_python_modules": list(PRELOAD), "enable_metrics_collection": False}


def disconnect() -> None:
    """Shut down the Ray this process started (``connect`` returned True)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


class LocalNodes:
    """A Ray cluster of separate nodes on this machine (``ray.cluster_utils.Cluster``: a head
    with no CPUs, which this process attaches to, and ``n`` worker nodes of ``cpus`` each),
    for the demo's chaos: drain a node as a cloud's preemption does, take it away, add one.
    Call it from the main thread (Ray's cluster utilities install signal handlers there)."""

    def __init__(self, n: int, cpus: int = 1) -> None:
        from ray.cluster_utils import Cluster

        self._cluster = Cluster(initialize_head=True, connect=True, head_node_args={
            "num_cpus": 0, "include_dashboard": False,
            # a node lost is known in ~1.5 s, from its first second on (Ray's first check
            # waits 5 s after a node joins)
            "_system_config": {"health_check_period_ms": 500, "health_check_initial_delay_ms": 0,
                               "health_check_failure_threshold": 3, **LOCAL_CONFIG}})
        self._cpus = cpus
        self.nodes = [self._cluster.add_node(num_cpus=cpus) for _ in range(n)]
        self._cluster.wait_for_nodes()

    def drain(self, node_id: str, deadline_s: float, why: str) -> None:
        """Ray's drain of a preempted node (what ``ray drain-node --reason
        DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`` does)."""
        import time

        import ray
        from ray.core.generated import autoscaler_pb2

        gcs = ray._raylet.GcsClient(address=self._cluster.address)  # type: ignore[attr-defined]
        reason = autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
            "DRAIN_NODE_REASON_PREEMPTION")
        ok, msg = gcs.drain_node(node_id, reason, why, int((time.time() + deadline_s) * 1000))
        if not ok:
            raise ClusterError(f"Ray refused to drain node {node_id[:8]}: {msg}")

    def remove(self, node_id: str) -> None:
        """Take a node away at once, its Ray agents first (else they report a crash)."""
        import ray  # noqa: F401 - then Ray's own psutil (ray/thirdparty_files) imports
        psutil = __import__("psutil")
        node = next(n for n in self.nodes if n.node_id == node_id)
        for info in node.all_processes.get("raylet", []):
            try:
                for child in psutil.Process(info.process.pid).children(recursive=True):
                    title = " ".join(child.cmdline()).strip()  # the agents' process titles
                    if title.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")):
                        child.kill()
            except psutil.Error:  # already gone
                pass
        self._cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def add(self) -> None:
        self.nodes.append(self._cluster.add_node(num_cpus=self._cpus))

    def shutdown(self) -> None:
        disconnect()
        self._cluster.shutdown()


# --------------------------------------------------------------------------- named actors


def named_actors(namespace: str, prefix: str) -> list[str]:
    """The names (``prefix`` removed) of the live named actors of ``namespace`` that start
    with ``prefix``, sorted."""
    import ray

    return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == namespace and a["name"].startswith(prefix))


def named_actor(name: str, namespace: str) -> Any | None:
    """The handle of the named actor, or None when there is none."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def start_named(cls: type, name: str, namespace: str, *args: Any, detached: bool,
                ready: str = "info", max_concurrency: int = 16) -> Any:
    """Start ``cls(*args)`` as a named actor on this node (0 CPUs; ``detached``: it outlives
    the driver) and wait until its method ``ready`` answers. Returns its handle."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    opts: dict[str, Any] = {"name": name, "namespace": namespace, "num_cpus": 0,
                            "max_concurrency": max_concurrency, "scheduling_strategy": here}
    if detached:
        opts["lifetime"] = "detached"
    actor: Any = ray.remote(cls)
    h = actor.options(**opts).remote(*args)
    ray.get(getattr(h, ready).remote())
    return h


def call(method: Any, *args: Any) -> Any:
    """Call an actor method and wait; an ``ElasticError`` the actor raised comes back as
    itself (not wrapped in Ray's task error); an actor that is gone, as ``ActorGoneError``."""
    import ray

    from .errors import ActorGoneError, ElasticError

    try:
        return ray.get(method.remote(*args))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ElasticError):
            raise ElasticError(str(e.cause)) from None
        raise
    except ray.exceptions.RayActorError as e:
        raise ActorGoneError(str(e).strip().splitlines()[0] if str(e).strip() else
                             "the actor called is gone") from None


def kill(handle: Any) -> None:
    import ray

    ray.kill(handle)


def dumps(obj: Any) -> bytes:
    """Ray's cloudpickle (what a job's config travels as)."""
    from ray import cloudpickle

    return bytes(cloudpickle.dumps(obj))


def loads(data: bytes) -> Any:
    from ray import cloudpickle

    return cloudpickle.loads(data)


# --------------------------------------------------------------------------- draining nodes


def ray_session() -> str | None:
    """Which Ray connection this process has (the GCS address and the driver's job id, new
    at every ``ray.init``), or None when it has none; does not start Ray. Handles from one
    connection must not be used in the next (a test's second cluster, a reconnect to the
    same one)."""
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


def draining_nodes() -> dict[str, int]:
    """Ray's draining nodes: {node id hex: deadline, ms since the epoch (0: none)}. What Ray
    Train V2's preemption watcher polls (a private Ray module: ``ray.nodes()`` does not show
    a drain); one GCS call, ~1 ms."""
    import ray

    return dict(ray._private.state.state.get_draining_nodes() or {})


def node_infos() -> Any:
    """Every node's GCS info (its death or drain reason among it)."""
    import ray

    gcs = ray._raylet.GcsClient(  # type: ignore[attr-defined]
        address=ray.get_runtime_context().gcs_address)
    return gcs.get_all_node_info(timeout=5)


def request_drain(node_id: str, deadline_ms: int, message: str) -> tuple[bool, str]:
    """Ask Ray to drain ``node_id`` as ``ray drain-node`` does (a preemption-kind drain: the
    one Ray accepts for a busy node), so nothing new is placed there. (accepted, Ray's
    reason for refusing)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(  # type: ignore[attr-defined]
        address=ray.get_runtime_context().gcs_address)
    reason = autoscaler_pb2.DrainNodeReason.Value(  # type: ignore[attr-defined]
        "DRAIN_NODE_REASON_PREEMPTION")
    ok, why = gcs.drain_node(node_id, reason, message, deadline_ms)
    return bool(ok), str(why or "")


def node_alive(node_id: str) -> bool:
    """Whether Ray holds node ``node_id`` alive (True when the GCS cannot say)."""
    import ray

    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the GCS busy: assume the node lives
        return True


def resources_free(bundle: dict[str, float]) -> bool:
    """Whether the cluster has the resources of one more ``bundle`` free now."""
    import ray

    free = ray.available_resources()
    return all(free.get(k, 0.0) >= v for k, v in bundle.items() if v > 0)


def pg_ready(pg: Any) -> bool:
    """Whether every bundle of ``pg`` is reserved now (no task is started to find out:
    ``pg.ready()`` makes a new task each call, which a zero timeout never sees finish)."""
    import ray

    try:
        return bool(ray.util.placement_group_table(pg).get("state") == "CREATED")
    except Exception:  # noqa: BLE001 - a removed group
        return False


def bundle_count(pg: Any) -> int:
    try:
        return int(pg.bundle_count)
    except Exception:  # noqa: BLE001 - a removed group: 0
        return 0


def bundle_node(pg: Any, index: int) -> str:
    """The node bundle ``index`` of ``pg`` is reserved on now ('' when none or unknown)."""
    import ray

    try:
        nodes = ray.util.placement_group_table(pg).get("bundles_to_node_id") or {}
        return str(nodes.get(index) or "")
    except Exception:  # noqa: BLE001 - a removed group
        return ""


# --------------------------------------------------------------------------- warm pool
# (the Ray calls of ``elastic.control.pool``, which decides what to do with them)


def new_bundle(bundle: dict[str, float]) -> Any:
    """A placement group of one ``bundle`` (not waited for: an actor placed in it starts
    once it is reserved)."""
    from ray.util.placement_group import placement_group

    return placement_group([dict(bundle)])


def remove_bundle(pg: Any) -> None:
    import ray

    try:
        ray.util.remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed
        pass


def start_in_bundle(cls: type, args: tuple[Any, ...], bundle: dict[str, float], pg: Any,
                    slot: int, runtime_env: dict[str, Any] | None = None) -> Any:
    """Start ``cls(*args)`` as a threaded worker actor (``max_concurrency=2``, never
    restarted) in bundle ``slot`` of ``pg``; returns its handle at once."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    opts: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 1), "num_gpus": bundle.get("GPU", 0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
        "max_concurrency": 2, "max_restarts": 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=slot)}
    if runtime_env:
        opts["runtime_env"] = runtime_env
    remote_cls: Any = ray.remote(cls)
    return remote_cls.options(**opts).remote(*args)


def wait_refs(refs: list[Any], timeout_s: float | None) -> tuple[list[Any], list[Any]]:
    """(ready, not ready) within ``timeout_s`` (``ray.wait`` for all of them)."""
    import ray

    if not refs:
        return [], []
    ready, rest = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    return list(ready), list(rest)


def get_ref(ref: Any, timeout_s: float | None = None) -> Any:
    """The value of ``ref``; raises what the task raised (Ray's wrapper)."""
    import ray

    return ray.get(ref, timeout=timeout_s)


def table_sizes(refs: list[Any]) -> list[tuple[int, int]]:
    """(rows, bytes) of each table (Ray Data block) in ``refs``, taken by a task beside each,
    so that no table travels to this process."""
    import ray

    size = ray.remote(num_cpus=1)(_size)  # (num_cpus=0: no limit; 400 blocks spawned
    # dozens of processes, 11.7 s against 0.28 s here)
    return [(int(n), int(b)) for n, b in ray.get([size.remote(r) for r in refs])]


def join_tables(groups: list[list[Any]]) -> list[Any]:
    """One table per group of table references, the group's tables end to end in one chunk
    (a 1-CPU task each, on the cluster); None for a group whose tables do not join (other
    columns or types)."""
    import ray

    # rebuilt from lineage as often as Ray Data rebuilds its own blocks (-1: no limit)
    join = ray.remote(num_cpus=1, num_returns=2, max_retries=-1)(_join)
    pairs = [join.remote(*g) for g in groups]
    ok = ray.get([p[0] for p in pairs])
    return [p[1] if good else None for p, good in zip(pairs, ok, strict=True)]


def _size(table: Any) -> tuple[int, int]:
    return int(table.num_rows), int(table.nbytes)


def _join(*tables: Any) -> tuple[bool, Any]:
    import pyarrow as pa

    try:
        return True, pa.concat_tables(tables).combine_chunks()
    except Exception:  # noqa: BLE001 - the blocks stay as they are
        return False, None


def free_cpus() -> float:
    """The CPUs no task, actor or placement group holds on the attached cluster now."""
    import ray

    return float(ray.available_resources().get("CPU", 0.0))


def actor_key(handle: Any) -> str:
    """The actor's id (hex): one worker process, whichever handle object names it."""
    return str(handle._actor_id.hex())


def cluster_has_gpus() -> bool:
    """Whether the attached cluster has any GPU."""
    import ray

    return bool(ray.cluster_resources().get("GPU", 0) > 0)


def worker_bundle(resources: dict[str, float], use_gpu: bool | None
                  ) -> tuple[dict[str, float], bool]:
    """One worker's resources and whether it runs on a GPU (``use_gpu`` None: when it asks
    for one or the attached cluster has any): a GPU worker holds at least one, a CPU worker
    none, each at least one CPU. What a job's placement and a warm pool both use, so that a
    pool's workers are the shape the jobs on that cluster ask for."""
    res = dict(resources)
    if use_gpu is None:
        use_gpu = res.get("GPU", 0) > 0 or cluster_has_gpus()
    if use_gpu:
        res["GPU"] = max(1.0, res.get("GPU", 1.0))
    else:
        res.pop("GPU", None)
    res.setdefault("CPU", 1)
    return res, bool(use_gpu)


def free_by_node(bundle: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each node's free amount of ``bundle``'s resources now, by node id."""
    import ray

    try:
        per_node = ray._private.state.available_resources_per_node()
    except Exception:  # noqa: BLE001 - an older Ray: the cluster's total
        per_node = {"all": ray.available_resources()}
    need = [k for k, v in bundle.items() if v > 0]
    return {str(n): {k: float(f.get(k, 0.0)) for k in need} for n, f in per_node.items()}


def runtime_env_now() -> dict[str, Any]:
    """The runtime environment of this process's job (what an actor it starts inherits)."""
    import ray
    try:
        return dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # noqa: BLE001 - not in a Ray job
        return {}
