"""The live inventory: ``ray.nodes()`` output -> the same ``Cluster`` form as cluster files.

This module never calls Ray; the caller passes the node dicts (``ray.nodes()`` in the
controller, hand-written dicts in tests, ``cluster_from_launcher_config`` for launcher files).

How a node's device type is found, first match wins:
1. label ``elastic.io/device-type`` (a catalog name, e.g. ``A100-80GB``);
2. a custom resource ``elastic_device:<catalog name>`` (for Ray versions without labels);
3. Ray's ``accelerator_type:<name>`` resources, most specific (longest) name first, so a
   launcher's ``accelerator_type:A100-80G`` beats the ``accelerator_type:A100`` Ray adds;
4. label ``ray.io/accelerator-type``; 5. ``default_gpu_type``; else ``InventoryError``.
A bare ``A100`` means the 40 GB part (the catalog's safe choice). Nodes without GPUs give
CPU devices (``CPU // cpus_per_device`` of them, sharing Ray's ``memory`` resource) when the
cluster has no GPUs or ``use_gpu=False``. Emulation comes from labels
``elastic.io/emulated-slowdown``, ``elastic.io/emulated-memory-gb``,
``elastic.io/emulated-type`` or from the ``emulation`` argument (by NodeID). Network: label
``elastic.io/network`` (+ ``elastic.io/nics``), else the ``network`` argument, else loopback
when every node has the same address (one host), else ``eth-100g``. Market (what the node
costs, whether it can be preempted): label ``elastic.io/market``, else Ray's own
``ray.io/market-type`` (KubeRay sets it), ``spot`` or ``on-demand``; default on-demand. Pools
group nodes with equal (pool label or ``ray.io/node-group``, device, count, emulation,
network, market).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .catalog import MARKETS, DeviceType, device_for_ray_accelerator, device_type, link_type
from .errors import ClusterFileError, InventoryError
from .loader import DEFAULT_NETWORK
from .topology import Cluster, Emulation, Node, NodePool

__all__ = [
    "cluster_from_ray_nodes",
    "cluster_from_launcher_config",
    "LABEL_DEVICE",
    "LABEL_POOL",
    "LABEL_NETWORK",
    "LABEL_NICS",
    "LABEL_SLOWDOWN",
    "LABEL_MEMORY",
    "LABEL_STANDS_FOR",
    "LABEL_MARKET",
    "RESOURCE_DEVICE_PREFIX",
]

LABEL_DEVICE = "elastic.io/device-type"
LABEL_POOL = "elastic.io/pool"
LABEL_NETWORK = "elastic.io/network"
LABEL_NICS = "elastic.io/nics"
LABEL_SLOWDOWN = "elastic.io/emulated-slowdown"
LABEL_MEMORY = "elastic.io/emulated-memory-gb"
LABEL_STANDS_FOR = "elastic.io/emulated-type"
LABEL_MARKET = "elastic.io/market"
RESOURCE_DEVICE_PREFIX = "elastic_device:"
_RAY_ACCEL_LABEL = "ray.io/accelerator-type"
_RAY_GROUP_LABEL = "ray.io/node-group"
_RAY_MARKET_LABEL = "ray.io/market-type"


def _market(node: Mapping[str, Any]) -> str:
    labels = node.get("Labels") or {}
    raw = labels.get(LABEL_MARKET) or labels.get(_RAY_MARKET_LABEL) or "on_demand"
    market = str(raw).strip().lower().replace("-", "_")
    if market not in MARKETS:
        raise InventoryError(
            f"node {node.get('NodeID')}: unknown market {raw!r} in its labels; use spot or "
            f"on-demand in {LABEL_MARKET}")
    return market


def _gpu_type(node: Mapping[str, Any], default: str | None) -> DeviceType:
    res, labels = node.get("Resources") or {}, node.get("Labels") or {}
    nid = node.get("NodeID", "?")
    try:
        if LABEL_DEVICE in labels:
            return device_type(labels[LABEL_DEVICE])
        for k in res:
            if k.startswith(RESOURCE_DEVICE_PREFIX):
                return device_type(k[len(RESOURCE_DEVICE_PREFIX) :])
    except ClusterFileError as e:
        raise InventoryError(f"node {nid}: {e.problem} {e.fix}") from None
    names = sorted(
        (k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")),
        key=lambda s: (-len(s), s),
    )
    if _RAY_ACCEL_LABEL in labels:
        names.append(labels[_RAY_ACCEL_LABEL])
    for nm in names:
        d = device_for_ray_accelerator(nm)
        if d is not None:
            return d
    if default is not None:
        return device_type(default)
    what = f"accelerator {names[0]!r}" if names else "a GPU of no reported type"
    raise InventoryError(
        f"node {nid} has {what}, which the catalog does not know. Fix: label the node "
        f"{LABEL_DEVICE}=<catalog name>, add the type to clusters/catalog/devices.yaml, or pass "
        "default_gpu_type="
    )


def _emulation(node: Mapping[str, Any], given: Mapping[str, Emulation] | None) -> Emulation | None:
    if given and node.get("NodeID") in given:
        return given[node["NodeID"]]
    labels = node.get("Labels") or {}
    if not any(k in labels for k in (LABEL_SLOWDOWN, LABEL_MEMORY, LABEL_STANDS_FOR)):
        return None
    try:
        mem = labels.get(LABEL_MEMORY)
        return Emulation(
            slowdown=float(labels.get(LABEL_SLOWDOWN, 1.0)),
            memory_gb=float(mem) if mem is not None else None,
            stands_for=str(labels.get(LABEL_STANDS_FOR, "")),
        )
    except ValueError:
        raise InventoryError(
            f"node {node.get('NodeID')}: emulation labels must be numbers, got {dict(labels)}"
        ) from None


def cluster_from_ray_nodes(
    nodes: Sequence[Mapping[str, Any]],
    *,
    name: str = "live",
    use_gpu: bool | None = None,
    cpus_per_device: float = 1.0,
    network: str | None = None,
    nics: int = 1,
    emulation: Mapping[str, Emulation] | None = None,
    default_gpu_type: str | None = None,
) -> Cluster:
    """Map ``ray.nodes()`` dicts onto catalog devices; rules in the module docstring.

    ``use_gpu``: None = GPUs if any alive node has one. Dead nodes are skipped. Raises
    ``InventoryError`` for an unknown accelerator or when no device is left.
    """
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    has_gpu = any((n.get("Resources") or {}).get("GPU", 0) >= 1 for n in alive)
    gpu_mode = has_gpu if use_gpu is None else use_gpu
    one_host = len({n.get("NodeManagerAddress") for n in alive}) == 1
    pools: dict[tuple[Any, ...], NodePool] = {}
    names: dict[str, tuple[Any, ...]] = {}
    built: list[Node] = []
    for n in alive:
        res, labels = n.get("Resources") or {}, n.get("Labels") or {}
        if gpu_mode:
            count = int(res.get("GPU", 0))
            if count < 1:
                continue
            dev = _gpu_type(n, default_gpu_type)
        else:
            count = int(res.get("CPU", 0) // cpus_per_device)
            if count < 1:
                continue
            dev = device_type("CPU")
        emu = _emulation(n, emulation)
        mem_gb = None
        if not gpu_mode and res.get("memory"):
            mem_gb = float(res["memory"]) / count / 1e9
        net_name = (
            labels.get(LABEL_NETWORK) or network or ("loopback" if one_host else DEFAULT_NETWORK)
        )
        try:
            net, intra = link_type(net_name), link_type(dev.intra_node_link)
            n_nics = int(labels.get(LABEL_NICS, nics))
        except (ClusterFileError, ValueError) as e:
            raise InventoryError(f"node {n.get('NodeID')}: bad network label: {e}") from None
        base = (
            labels.get(LABEL_POOL)
            or labels.get(_RAY_GROUP_LABEL)
            or (emu.stands_for if emu and emu.stands_for else dev.name).lower()
        )
        market = _market(n)
        key = (base, dev.name, count, emu, net.name, n_nics, mem_gb, market)
        if key not in pools:
            pname = base
            k = 2
            while pname in names:
                pname, k = f"{base}-{k}", k + 1
            names[pname] = key
            pools[key] = NodePool(pname, dev, count, 0, intra, net, n_nics, mem_gb, emu, market)
        pool = pools[key]
        pools[key] = replace(pool, count=pool.count + 1)
        built.append(pool.make_node(str(n.get("NodeID")), str(n.get("NodeManagerAddress", ""))))
    if not built:
        kind = "GPU" if gpu_mode else f"CPU (>= {cpus_per_device} per device)"
        raise InventoryError(
            f"no usable {kind} devices among {len(alive)} alive node(s) of "
            f"{len(nodes)}; check the cluster or pass use_gpu="
        )
    return Cluster(name, tuple(pools.values()), tuple(built))


def cluster_from_launcher_config(
    config: Mapping[str, Any], counts: Mapping[str, int] | None = None, **kwargs: Any
) -> Cluster:
    """The cluster a Ray launcher config would give: ``counts[node_type]`` nodes of each type
    (default ``min_workers``; the head type counts one more), mapped as ``ray.nodes()`` would
    show them (node types must state ``GPU`` in ``resources``). No cloud calls.
    """
    types = config.get("available_node_types") or {}
    head = config.get("head_node_type")
    fake = []
    for t_i, (tname, spec) in enumerate(types.items()):
        c = (counts or {}).get(tname, spec.get("min_workers", 0) + (1 if tname == head else 0))
        for i in range(c):
            fake.append(
                {
                    "Alive": True,
                    "NodeID": f"{tname}-{i}",
                    "NodeManagerAddress": f"10.0.{t_i}.{i}",
                    "Resources": {
                        **{"CPU": 1.0},
                        **{k: float(v) for k, v in (spec.get("resources") or {}).items()},
                    },
                    "Labels": {**{_RAY_GROUP_LABEL: tname}, **(spec.get("labels") or {})},
                }
            )
    return cluster_from_ray_nodes(fake, name=str(config.get("cluster_name", "launcher")), **kwargs)
