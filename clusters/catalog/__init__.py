"""The hardware catalog: device types and interconnect classes with their published figures.

The figures live beside this module in ``devices.yaml`` and ``links.yaml`` (each entry cites
its source kind). They are read once, on first use, never at import time. Look-ups are
case-insensitive; a device is also found by the accelerator name Ray reports
(``accelerator_type:A100`` -> ``A100-40GB``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ClusterFileError

__all__ = [
    "PRECISIONS",
    "MARKETS",
    "DeviceType",
    "LinkType",
    "device_type",
    "link_type",
    "device_types",
    "link_types",
    "device_for_ray_accelerator",
]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
# Where a precision is not in hardware, the next one in its chain sets the rate.
_FALLBACK = {
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
    "bf16": ("bf16", "fp32"),
    "fp16": ("fp16", "fp32"),
    "tf32": ("tf32", "fp32"),
    "fp32": ("fp32",),
}
_GB = 1e9
# How a node is bought: at the list price, or as spare capacity the cloud can take back
# (AWS Spot, GCP Spot/preemptible, Azure Spot) with a notice.
MARKETS = ("on_demand", "spot")


@dataclass(frozen=True)
class DeviceType:
    """One accelerator model. ``peak_tflops`` maps precision -> dense TFLOPS (no sparsity);
    ``prices`` maps a market (``MARKETS``) -> US dollars per device-hour, with
    ``price_source`` saying where they come from and when (devices.yaml's header)."""

    name: str
    vendor: str
    memory_gb: float
    memory_bandwidth_gbps: float
    peak_tflops: Mapping[str, float]
    intra_node_link: str
    ray_accelerator_types: tuple[str, ...] = ()
    source: str = ""
    prices: Mapping[str, float] = field(default_factory=dict)
    price_source: str = ""

    def price_per_hour(self, market: str = "on_demand") -> float | None:
        """US dollars per device-hour on ``market``; None where the catalog has no price."""
        return self.prices.get(market)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * _GB)

    def peak_flops(self, precision: str) -> float:
        """FLOP/s at ``precision``, falling back to a wider precision the device supports.

        Raises ``ValueError`` for an unknown precision name.
        """
        if precision not in _FALLBACK:
            raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
        for p in _FALLBACK[precision]:
            if p in self.peak_tflops:
                return float(self.peak_tflops[p]) * 1e12
        raise ValueError(f"{self.name} lists no fp32 rate")


@dataclass(frozen=True)
class LinkType:
    """One interconnect class: per-direction bandwidth (GB/s) and one-hop latency (us)."""

    name: str
    kind: str  # "intra" (inside a node) or "network" (between nodes)
    bandwidth_gbps: float
    latency_us: float
    source: str = ""

    @property
    def bandwidth(self) -> float:
        """Bytes per second per direction."""
        return self.bandwidth_gbps * _GB

    @property
    def latency(self) -> float:
        """Seconds."""
        return self.latency_us * 1e-6


def _load_yaml(name: str) -> dict[str, Any]:
    import yaml  # lazily: importing the catalog costs nothing until a figure is needed

    path = os.path.join(os.path.dirname(__file__), name)
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


@functools.lru_cache(maxsize=1)
def _devices() -> dict[str, DeviceType]:
    out = {}
    for name, d in _load_yaml("devices.yaml").items():
        out[name.lower()] = DeviceType(
            name=name,
            vendor=d["vendor"],
            memory_gb=float(d["memory_gb"]),
            memory_bandwidth_gbps=float(d["memory_bandwidth_gbps"]),
            peak_tflops={k: float(v) for k, v in d["peak_tflops"].items()},
            intra_node_link=d["intra_node_link"],
            ray_accelerator_types=tuple(d.get("ray_accelerator_types") or ()),
            source=d.get("source", ""),
            prices={k: float(v) for k, v in (d.get("price_per_hour") or {}).items()},
            price_source=d.get("price_source", ""),
        )
    return out


@functools.lru_cache(maxsize=1)
def _links() -> dict[str, LinkType]:
    return {
        name.lower(): LinkType(
            name=name,
            kind=d["kind"],
            bandwidth_gbps=float(d["bandwidth_gbps"]),
            latency_us=float(d["latency_us"]),
            source=d.get("source", ""),
        )
        for name, d in _load_yaml("links.yaml").items()
    }


def device_types() -> dict[str, DeviceType]:
    """All catalog devices by name (a fresh dict; the entries are immutable)."""
    return {d.name: d for d in _devices().values()}


def link_types() -> dict[str, LinkType]:
    """All interconnect classes by name."""
    return {lk.name: lk for lk in _links().values()}


def device_for_ray_accelerator(ray_name: str) -> DeviceType | None:
    """The catalog device Ray calls ``ray_name`` (e.g. ``"A100"``, ``"T4"``), or ``None``."""
    key = ray_name.lower()
    for d in _devices().values():
        if key in (a.lower() for a in d.ray_accelerator_types):
            return d
    return _devices().get(key)


def device_type(name: str) -> DeviceType:
    """The device called ``name`` (catalog name or Ray accelerator name).

    Raises ``ClusterFileError`` naming the known devices when there is none.
    """
    d = _devices().get(name.lower()) or device_for_ray_accelerator(name)
    if d is None:
        raise ClusterFileError(
            "device",
            f"unknown device type {name!r}.",
            f"use one of {', '.join(sorted(device_types()))}, or add it to "
            "clusters/catalog/devices.yaml.",
        )
    return d


def link_type(name: str) -> LinkType:
    """The interconnect called ``name``; raises ``ClusterFileError`` listing the known ones."""
    lk = _links().get(name.lower())
    if lk is None:
        raise ClusterFileError(
            "link",
            f"unknown interconnect {name!r}.",
            f"use one of {', '.join(sorted(link_types()))}.",
        )
    return lk
