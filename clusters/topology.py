"""The Cluster form shared by cluster files, the live inventory, the planner and the simulator.

A ``Cluster`` is a tuple of ``NodePool`` (what kinds of nodes there are) and a tuple of ``Node``
(the actual hosts), each node holding its ``Device`` s. All are frozen dataclasses: a cluster
is a value; "a node died" is ``cluster.without_nodes({...})``, a new value.

Device speed: ``Device.slowdown`` multiplies its compute time (1.0 = as the catalog says).
It is how emulated devices on a CPU machine stand in for slower GPUs (the worker sleeps for
``slowdown - 1`` times its compute, see ``elastic/worker.py``); ``emulated=True`` marks them
so every report can label emulation as such.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from .catalog import DeviceType, LinkType

__all__ = ["Emulation", "Device", "Node", "NodePool", "Cluster", "Path"]


@dataclass(frozen=True)
class Emulation:
    """A device that stands in for another: ``slowdown`` x compute time, ``memory_gb`` budget.

    ``stands_for`` is a display name (e.g. ``"T4"``); it changes no figure by itself.
    """

    slowdown: float = 1.0
    memory_gb: float | None = None
    stands_for: str = ""


@dataclass(frozen=True)
class Device:
    """One device = one worker = one rank. ``id`` is unique in its cluster (``node/index``)."""

    id: str
    type: DeviceType
    node: str
    pool: str
    memory_bytes: int
    slowdown: float = 1.0
    emulated: bool = False
    stands_for: str = ""

    @property
    def label(self) -> str:
        """What reports print: ``"A100-80GB"`` or ``"T4 (emulated on CPU, x4.0)"``."""
        if not self.emulated:
            return self.type.name
        what = self.stands_for or self.type.name
        return f"{what} (emulated on {self.type.name}, x{self.slowdown:g})"

    @property
    def short(self) -> str:
        return self.stands_for or self.type.name

    @functools.cached_property
    def speed_key(self) -> tuple[str, float]:
        """Devices with equal keys compute equally fast (same type and slowdown)."""
        return (self.type.name, self.slowdown)


@dataclass(frozen=True)
class Node:
    """One host: its devices, the link between them, and its network ports (``nics`` of them)."""

    id: str
    pool: str
    devices: tuple[Device, ...]
    intra_link: LinkType
    network: LinkType
    nics: int = 1
    address: str = ""


@dataclass(frozen=True)
class NodePool:
    """``count`` identical nodes of ``devices_per_node`` devices of type ``device``.

    ``market``: ``"on_demand"`` or ``"spot"`` (catalog.MARKETS: spot nodes are cheaper and
    can be preempted, with a notice); ``price_per_device_hour``: US dollars, None for the
    catalog's price of the device on that market (``device_price``)."""

    name: str
    device: DeviceType
    devices_per_node: int
    count: int
    intra_link: LinkType
    network: LinkType
    nics: int = 1
    memory_gb: float | None = None  # per-device override (e.g. a 32 GB V100)
    emulation: Emulation | None = None
    market: str = "on_demand"
    price_per_device_hour: float | None = None

    def device_price(self) -> float | None:
        """US dollars per device-hour: the pool's own price, else the catalog's for its
        market; None when neither has one."""
        if self.price_per_device_hour is not None:
            return self.price_per_device_hour
        return self.device.price_per_hour(self.market)

    def device_memory_bytes(self) -> int:
        if self.emulation is not None and self.emulation.memory_gb is not None:
            return int(self.emulation.memory_gb * 1e9)
        if self.memory_gb is not None:
            return int(self.memory_gb * 1e9)
        return self.device.memory_bytes

    def make_node(self, node_id: str, address: str = "") -> Node:
        em = self.emulation
        devs = tuple(
            Device(
                id=f"{node_id}/{i}",
                type=self.device,
                node=node_id,
                pool=self.name,
                memory_bytes=self.device_memory_bytes(),
                slowdown=em.slowdown if em else 1.0,
                emulated=em is not None,
                stands_for=em.stands_for if em else "",
            )
            for i in range(self.devices_per_node)
        )
        return Node(node_id, self.name, devs, self.intra_link, self.network, self.nics, address)


@dataclass(frozen=True)
class Path:
    """The bottleneck of a group of devices: bytes/s per direction and latency in seconds."""

    bandwidth: float
    latency: float
    name: str


_Links = tuple[tuple[float, float, str], ...]  # (bandwidth, latency, name) of links


@dataclass(frozen=True)
class Cluster:
    """Pools and nodes. ``inter_pool_link`` (optional) caps traffic between different pools."""

    name: str
    pools: tuple[NodePool, ...]
    nodes: tuple[Node, ...]
    inter_pool_link: LinkType | None = None
    source: str = ""

    @classmethod
    def from_pools(
        cls,
        name: str,
        pools: Sequence[NodePool],
        inter_pool_link: LinkType | None = None,
        source: str = "",
    ) -> Cluster:
        """Expand each pool into ``count`` nodes named ``<pool>-<i>``."""
        nodes = tuple(p.make_node(f"{p.name}-{i}") for p in pools for i in range(p.count))
        return cls(name, tuple(pools), nodes, inter_pool_link, source)

    @functools.cached_property
    def devices(self) -> tuple[Device, ...]:
        return tuple(d for n in self.nodes for d in n.devices)

    @functools.cached_property
    def _device_index(self) -> dict[str, Device]:
        return {d.id: d for d in self.devices}

    @functools.cached_property
    def _node_index(self) -> dict[str, Node]:
        return {n.id: n for n in self.nodes}

    def device(self, device_id: str) -> Device:
        """The device with that id; ``KeyError`` if there is none."""
        return self._device_index[device_id]

    @functools.cached_property
    def _path_sig(self) -> tuple[dict[str, _Links], dict[str, _Links]]:
        """Per node id what ``path_over`` weighs of it: alone in the group (its network),
        and with more than one member there (its network and its intra-node link)."""
        alone: dict[str, _Links] = {}
        more: dict[str, _Links] = {}
        for n in self.nodes:
            net = (n.network.bandwidth * n.nics, n.network.latency, f"{n.network.name}x{n.nics}")
            lk = n.intra_link
            alone[n.id], more[n.id] = (net,), (net, (lk.bandwidth, lk.latency, lk.name))
        return alone, more

    @functools.cached_property
    def _node_pool(self) -> dict[str, str]:
        return {n.id: n.pool for n in self.nodes}

    def node(self, node_id: str) -> Node:
        """The node with that id; ``KeyError`` if there is none."""
        return self._node_index[node_id]

    def without_nodes(self, node_ids: Iterable[str]) -> Cluster:
        """A new cluster without those nodes (pool counts follow)."""
        gone = set(node_ids)
        nodes = tuple(n for n in self.nodes if n.id not in gone)
        counts = {p.name: 0 for p in self.pools}
        for n in nodes:
            counts[n.pool] = counts.get(n.pool, 0) + 1
        pools = tuple(replace(p, count=counts.get(p.name, 0)) for p in self.pools)
        return replace(self, pools=pools, nodes=nodes)

    def path(self, devices: Sequence[Device]) -> Path | None:
        """Bottleneck link of a collective over ``devices``; ``None`` for fewer than two.

        One node: its intra-node link. Several: the slowest of each involved node's intra link
        (where it holds more than one member), its network (``nics`` x port bandwidth, since a
        ring runs one channel per NIC), and ``inter_pool_link`` when pools mix.
        """
        if len(devices) < 2:
            return None
        return self.path_over(Counter(d.node for d in devices))

    def path_over(self, per_node: Mapping[str, int]) -> Path | None:
        """``path`` of a group given as members per node id (``{"a100-0": 8, ...}``)."""
        if sum(per_node.values()) < 2:
            return None
        if len(per_node) == 1:
            lk = self.node(next(iter(per_node))).intra_link
            return Path(lk.bandwidth, lk.latency, lk.name)
        bw, lat, name = float("inf"), 0.0, ""
        sig = self._path_sig
        # alike nodes (a pool's) add nothing after the first: each signature once, in the
        # order first met (big clusters; where every node holds one member, or every node
        # more than one, in a C-level pass)
        counts = set(per_node.values())
        alone = max(counts) == 1
        if alone or min(counts) > 1:
            seen = dict.fromkeys(map(sig[not alone].__getitem__, per_node))
        else:
            seen = dict.fromkeys(sig[c > 1][n] for n, c in per_node.items())
        for cands in seen:
            for b, lt, nm in cands:
                if b < bw:
                    bw, name = b, nm
                lat = max(lat, lt)
        if (self.inter_pool_link is not None
                and len(set(map(self._node_pool.__getitem__, per_node))) > 1):
            lk = self.inter_pool_link
            if lk.bandwidth < bw:
                bw, name = lk.bandwidth, lk.name
            lat = max(lat, lk.latency)
        return Path(bw, lat, name)

    def p2p_path(self, a: Device, b: Device) -> Path:
        """Link between two devices for point-to-point sends (one NIC per stream)."""
        if a.node == b.node:
            lk = self.node(a.node).intra_link
            return Path(lk.bandwidth, lk.latency, lk.name)
        na, nb = self.node(a.node), self.node(b.node)
        links = [na.network, nb.network]
        if self.inter_pool_link is not None and na.pool != nb.pool:
            links.append(self.inter_pool_link)
        slow = min(links, key=lambda lk: lk.bandwidth)
        return Path(slow.bandwidth, max(lk.latency for lk in links), slow.name)

    def describe(self) -> str:
        """One line per pool, e.g. ``a100: 1 x 8 A100-80GB (nvlink3; ib-hdr x8)``."""
        lines = [f"cluster {self.name}: {len(self.nodes)} nodes, {len(self.devices)} devices"]
        for p in self.pools:
            em = ""
            if p.emulation is not None:
                em = (
                    f", emulating {p.emulation.stands_for or p.device.name} "
                    f"x{p.emulation.slowdown:g}"
                )
            lines.append(
                f"  {p.name}: {p.count} x {p.devices_per_node} {p.device.name}, "
                f"{p.device_memory_bytes() / 1e9:.1f} GB each "
                f"({p.intra_link.name}; {p.network.name} x{p.nics}{em})"
            )
        return "\n".join(lines)
