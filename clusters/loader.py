"""Cluster files: load and validate ``clusters/examples/*.yaml``-style descriptions.

Format (YAML or an equivalent dict)::

    name: a100-t4                 # required
    description: free text        # optional
    inter_pool_link: eth-100g     # optional: caps traffic between different pools
    pools:                        # required, at least one
      - name: a100                # required, unique
        device: A100-80GB         # required: a catalog device (or a Ray accelerator name)
        nodes: 1                  # required, >= 0
        devices_per_node: 8       # required, >= 1
        intra_node_link: nvlink3  # optional, default: the device's catalog link
        network: ib-hdr           # optional, default: eth-100g
        nics: 8                   # optional, network ports per node, default 1
        memory_gb: 80             # optional per-device override
        emulation:                # optional: CPU stand-ins for other devices (tests, demos)
          slowdown: 4.0           #   compute time multiplier, > 0
          memory_gb: 2            #   memory budget per device
          stands_for: T4          #   display name
        market: spot              # optional: on_demand (default) or spot (preemptible)
        price_per_device_hour: 1.6  # optional, US$; default: the catalog's for the market

Every error is a ``ClusterFileError`` naming the field (``pools[1].device``), the problem and
the fix; unknown keys are errors (with a did-you-mean), so typos never pass silently.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from typing import Any

from .catalog import MARKETS, device_type, link_type
from .errors import ClusterFileError
from .topology import Cluster, Emulation, NodePool

__all__ = ["load_cluster", "cluster_to_dict", "example_path", "DEFAULT_NETWORK"]

DEFAULT_NETWORK = "eth-100g"
_TOP_KEYS = {"name", "description", "inter_pool_link", "pools"}
_POOL_KEYS = {
    "name",
    "device",
    "nodes",
    "devices_per_node",
    "intra_node_link",
    "network",
    "nics",
    "memory_gb",
    "emulation",
    "market",
    "price_per_device_hour",
}
_EMU_KEYS = {"slowdown", "memory_gb", "stands_for"}


def example_path(name: str) -> str:
    """Path of a shipped example cluster file, e.g. ``example_path("a100-t4")``."""
    base = name if name.endswith(".yaml") else name + ".yaml"
    return os.path.join(os.path.dirname(__file__), "examples", base)


def load_cluster(source: str | os.PathLike[str] | Mapping[str, Any]) -> Cluster:
    """Build a ``Cluster`` from a YAML file path or a dict in the format above.

    Raises ``ClusterFileError`` for any malformed field, ``FileNotFoundError`` for a missing file.
    """
    origin = ""
    if isinstance(source, Mapping):
        raw: Any = source
    else:
        import yaml

        origin = os.fspath(source)
        with open(origin, encoding="utf-8") as f:
            try:
                raw = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ClusterFileError(
                    "(file)", f"is not valid YAML ({e}).", source=origin
                ) from None
    try:
        return _parse(raw, origin)
    except ClusterFileError as e:
        if e.source or not origin:
            raise
        raise ClusterFileError(e.field, e.problem, e.fix, origin) from None


def _check_keys(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for k in d:
        if k not in allowed:
            close = difflib.get_close_matches(str(k), sorted(allowed), n=1)
            hint = (
                f"did you mean {close[0]!r}?"
                if close
                else f"allowed: {', '.join(sorted(allowed))}."
            )
            raise ClusterFileError(f"{where}{k}", "unknown key.", hint)


def _number(
    d: Mapping[str, Any],
    key: str,
    where: str,
    *,
    integer: bool,
    minimum: float,
    required: bool = True,
    strict: bool = False,
) -> Any:
    if key not in d:
        if required:
            raise ClusterFileError(f"{where}{key}", "is required.", f"add `{key}:`.")
        return None
    v = d[key]
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type:
        kind = "an integer" if integer else "a number"
        raise ClusterFileError(f"{where}{key}", f"must be {kind}, got {v!r}.")
    if not math.isfinite(v):  # YAML's .inf and .nan (was: a traceback, or a $nan price)
        raise ClusterFileError(f"{where}{key}", f"must be a finite number, got {v!r}.")
    if v < minimum or (strict and v == minimum):
        op = ">" if strict else ">="
        raise ClusterFileError(f"{where}{key}", f"must be {op} {minimum:g}, got {v!r}.")
    return v


def _named(kind: Any, value: Any, where: str) -> Any:
    if not isinstance(value, str):
        raise ClusterFileError(where, f"must be a name (string), got {value!r}.")
    try:
        return kind(value)
    except ClusterFileError as e:
        raise ClusterFileError(where, e.problem, e.fix) from None


def _parse(raw: Any, origin: str) -> Cluster:
    if not isinstance(raw, Mapping):
        raise ClusterFileError(
            "(top level)",
            f"must be a mapping, got {type(raw).__name__}.",
            "start the file with `name:` and `pools:`.",
        )
    _check_keys(raw, _TOP_KEYS, "")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ClusterFileError("name", "is required and must be a non-empty string.")
    pools_raw = raw.get("pools")
    if not isinstance(pools_raw, list) or not pools_raw:
        raise ClusterFileError(
            "pools",
            "must be a non-empty list of node pools.",
            "see clusters/examples/ for the format.",
        )
    inter = raw.get("inter_pool_link")
    inter_lk = _named(link_type, inter, "inter_pool_link") if inter is not None else None
    pools, seen = [], set()
    for i, p in enumerate(pools_raw):
        where = f"pools[{i}]."
        if not isinstance(p, Mapping):
            raise ClusterFileError(f"pools[{i}]", "must be a mapping.")
        _check_keys(p, _POOL_KEYS, where)
        pname = p.get("name")
        if not isinstance(pname, str) or not pname or "/" in pname:
            raise ClusterFileError(f"{where}name", "is required: a non-empty string without '/'.")
        if pname in seen:
            raise ClusterFileError(f"{where}name", f"duplicate pool name {pname!r}.")
        seen.add(pname)
        if "device" not in p:
            raise ClusterFileError(f"{where}device", "is required.", "e.g. `device: A100-80GB`.")
        dev = _named(device_type, p["device"], f"{where}device")
        nodes = _number(p, "nodes", where, integer=True, minimum=0)
        per = _number(p, "devices_per_node", where, integer=True, minimum=1)
        intra = _named(
            link_type, p.get("intra_node_link", dev.intra_node_link), f"{where}intra_node_link"
        )
        net = _named(link_type, p.get("network", DEFAULT_NETWORK), f"{where}network")
        nics = _number(p, "nics", where, integer=True, minimum=1, required=False) or 1
        mem = _number(p, "memory_gb", where, integer=False, minimum=0, required=False, strict=True)
        emu = None
        if "emulation" in p:
            e = p["emulation"]
            ew = f"{where}emulation."
            if not isinstance(e, Mapping):
                raise ClusterFileError(f"{where}emulation", "must be a mapping.")
            _check_keys(e, _EMU_KEYS, ew)
            slow = _number(e, "slowdown", ew, integer=False, minimum=0, required=False, strict=True)
            emem = _number(
                e, "memory_gb", ew, integer=False, minimum=0, required=False, strict=True
            )
            stands = e.get("stands_for", "")
            if not isinstance(stands, str):
                raise ClusterFileError(f"{ew}stands_for", "must be a string.")
            emu = Emulation(slowdown=float(slow or 1.0), memory_gb=emem, stands_for=stands)
        market = p.get("market", "on_demand")
        if market not in MARKETS:
            close = difflib.get_close_matches(str(market), MARKETS, n=1)
            raise ClusterFileError(f"{where}market", f"unknown market {market!r}.",
                                   f"did you mean {close[0]!r}?" if close
                                   else f"use one of {', '.join(MARKETS)}.")
        price = _number(p, "price_per_device_hour", where, integer=False, minimum=0,
                        required=False)
        pools.append(NodePool(pname, dev, per, nodes, intra, net, nics, mem, emu, market,
                              None if price is None else float(price)))
    if sum(p.count * p.devices_per_node for p in pools) == 0:
        raise ClusterFileError("pools", "hold no devices (every pool has 0 nodes).")
    return Cluster.from_pools(name, pools, inter_lk, origin)


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The cluster-file form of ``cluster`` (pools only; node ids are not kept)."""
    out: dict[str, Any] = {"name": cluster.name, "pools": []}
    if cluster.inter_pool_link is not None:
        out["inter_pool_link"] = cluster.inter_pool_link.name
    for p in cluster.pools:
        d: dict[str, Any] = {
            "name": p.name,
            "device": p.device.name,
            "nodes": p.count,
            "devices_per_node": p.devices_per_node,
            "intra_node_link": p.intra_link.name,
            "network": p.network.name,
            "nics": p.nics,
        }
        if p.memory_gb is not None:
            d["memory_gb"] = p.memory_gb
        if p.emulation is not None:
            d["emulation"] = {
                "slowdown": p.emulation.slowdown,
                "stands_for": p.emulation.stands_for,
            }
            if p.emulation.memory_gb is not None:
                d["emulation"]["memory_gb"] = p.emulation.memory_gb
        if p.market != "on_demand":
            d["market"] = p.market
        if p.price_per_device_hour is not None:
            d["price_per_device_hour"] = p.price_per_device_hour
        out["pools"].append(d)
    return out
