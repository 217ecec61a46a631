"""What a cluster or a plan costs: prices per device-hour by pool, per hour, per 1,000 steps.

A pool's price is its own (``price_per_device_hour`` in the cluster file, or set here from
``elastic plan --prices``), else the catalog's for the device on the pool's market
(``catalog/devices.yaml``: on-demand list prices with their source and date; spot figures are
an assumption there, since spot prices move). A plan costs the devices it runs on: a pool the
planner leaves out (``drop the T4s``) is not counted, since it can be released.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .catalog import MARKETS
from .errors import ClusterFileError
from .plan import Plan
from .topology import Cluster

__all__ = [
    "CATALOG_PRICES",
    "with_prices",
    "parse_prices",
    "plan_cost_per_hour",
    "cost_per_1k_steps",
    "cluster_cost_per_hour",
    "describe_prices",
]


CATALOG_PRICES = ("AWS us-east-1 on-demand list prices (2024 to May 2025), spot assumed at "
                  "40 % of them (clusters/catalog/devices.yaml)")


def with_prices(cluster: Cluster, prices: Mapping[str, float]) -> Cluster:
    """``cluster`` with each pool's price per device-hour set from ``prices``, keyed by pool
    name, else device type, else market (``spot``, ``on_demand``), case-insensitive; pools
    no key names keep theirs. Raises ``ClusterFileError`` for a key that names nothing or a
    price that is not a number >= 0."""
    by = {str(k).lower(): v for k, v in prices.items()}
    known = ({p.name.lower() for p in cluster.pools} | {p.device.name.lower() for p in
                                                         cluster.pools} | set(MARKETS))
    for k, v in by.items():
        if k not in known:
            raise ClusterFileError("prices", f"{k!r} names no pool, device type or market of "
                                   f"cluster {cluster.name}.",
                                   f"use one of {', '.join(sorted(known))}.")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ClusterFileError("prices", f"{k}: a price must be US dollars per "
                                   f"device-hour >= 0, got {v!r}.")
    pools = []
    for p in cluster.pools:
        for key in (p.name.lower(), p.device.name.lower(), p.market):
            if key in by:
                p = replace(p, price_per_device_hour=float(by[key]))
                break
        pools.append(p)
    return replace(cluster, pools=tuple(pools))


def parse_prices(text: str) -> dict[str, float]:
    """``--prices``: ``KEY=USD[,KEY=USD...]`` (US dollars per device-hour; a key as in
    ``with_prices``), or a YAML file mapping keys to prices. Raises ``ClusterFileError``."""
    if os.path.exists(text):
        import yaml

        with open(text, encoding="utf-8") as f:
            raw: Any = yaml.safe_load(f)
        if not isinstance(raw, Mapping):
            raise ClusterFileError("prices", f"{text} must map pool names or device types to "
                                   "prices per device-hour.", "write e.g. `a100: 4.10`.",
                                   text)
        return {str(k): v for k, v in raw.items()}
    out: dict[str, float] = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, eq, val = part.partition("=")
        try:
            if not eq or not key.strip():
                raise ValueError
            out[key.strip()] = float(val)
        except ValueError:
            raise ClusterFileError("--prices", f"{part!r} is not KEY=USD.",
                                   "write e.g. --prices a100=4.10,t4=0.39 (per device-hour) "
                                   "or give a YAML file.") from None
    if not out:
        raise ClusterFileError("--prices", "is empty.", "write e.g. --prices a100=4.10.")
    return out


def plan_cost_per_hour(plan: Plan, cluster: Cluster) -> float | None:
    """US dollars per hour of the devices ``plan`` runs on; None when one has no price."""
    price = {p.name: p.device_price() for p in cluster.pools}
    total = 0.0
    for d in plan.devices:
        v = price.get(cluster.device(d).pool)
        if v is None:
            return None
        total += v
    return total


def cluster_cost_per_hour(cluster: Cluster) -> float | None:
    """US dollars per hour of every device of ``cluster``; None when a pool has no price."""
    total = 0.0
    for p in cluster.pools:
        v = p.device_price()
        if v is None:
            return None
        total += v * p.count * p.devices_per_node
    return total


def cost_per_1k_steps(per_hour: float, step_time_s: float) -> float:
    """US dollars per 1,000 steps of ``step_time_s`` seconds at ``per_hour`` dollars."""
    return per_hour * step_time_s * 1000.0 / 3600.0


def describe_prices(cluster: Cluster) -> str:
    """One line: each pool's price per device-hour and where it comes from."""
    parts, catalog = [], False
    for p in cluster.pools:
        v = p.device_price()
        where = ("given" if p.price_per_device_hour is not None else
                 "catalog" if v is not None else "no price")
        catalog |= where == "catalog"
        parts.append(f"{p.name} " + (f"${v:.4g}" if v is not None else "-")
                     + f" ({p.market}, {where})")
    return "prices per device-hour: " + ", ".join(parts) + (
        "; catalog: " + CATALOG_PRICES if catalog else "")
