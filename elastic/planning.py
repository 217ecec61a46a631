"""Glue between the live job and ``clusters/``: the live workers as a ``Cluster``, the model
as a ``ModelProfile``, measured speeds, and the planner's choice as a ``StrategySpec``.

Emulation (a test and demo aid, labelled as such everywhere it shows): a worker can carry a
``slowdown`` (its compute takes that many times longer: it sleeps the difference) and a
``memory_gb`` budget the planner must respect.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn

from clusters import (
    Cluster,
    CostModel,
    Measurement,
    ModelProfile,
    Plan,
    PlanResult,
    calibrate,
    load_cluster,
    plan,
    proportional_shares,
)
from clusters import stage_split as split_stages
from clusters.collectives import CommConfig
from clusters.measured import MeasuredModel, equal_within_noise, terms_model
from clusters.pipeline_cost import SharedCores
from strategies import StrategyOptions, StrategySpec
from strategies.blocks import block_params, blocks_of

__all__ = ["live_cluster", "model_profile", "not_chained", "chained", "optimizer_bytes",
           "sample_costs", "auto_spec", "auto_plan", "plan_spec", "param_costs", "balanced_shares", "block_params", "comm_config", "device_hosts", "device_kinds",
           "shared_cores", "measured_model", "block_stage_split", "spec_plan"]

_OPT_BYTES = {"adam": 8, "adamw": 8, "sgd": 0, "rmsprop": 4, "adagrad": 4}
_UNCHAINED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def not_chained(model: nn.Module) -> None:
    """``model``'s forward is not its blocks applied one after the other (preflight saw
    them differ): it is planned as one block, so no pipeline, which would run the blocks
    chained, is planned for it."""
    _UNCHAINED.add(model)


def chained(model: nn.Module) -> bool:
    """False once ``not_chained(model)`` was said."""
    return model not in _UNCHAINED


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [model] if model in _UNCHAINED else blocks_of(model)


def model_profile(model: nn.Module, optimizer: Any, tokens_per_sample: int = 1,
                  precision: str = "fp32", sample: Any = None) -> ModelProfile:
    """fp32 weights and grads; optimizer bytes from its name; forward+backward FLOPs per
    sample estimated as 6 x parameters x tokens per sample (the usual dense-model rule), which
    the planner replaces with measured speeds whenever it has them. ``precision`` is the
    compute precision (the job's ``precision``: bf16 autocast keeps fp32 weights, gradients
    and optimizer state, and computes at the device's bf16 rate).

    ``sample``: inputs of a few samples (``elastic plan``): each block's FLOPs, the bytes
    it keeps for its backward and the bytes it hands on are then counted from a forward
    over them (``sample_costs``), and the optimizer's bytes from one step of the job's own
    optimizer (``optimizer_bytes``)."""
    opt = optimizer.get("name", "adam") if isinstance(optimizer, dict) else str(optimizer)
    opt_bytes = _OPT_BYTES.get(str(opt).lower(), 8)
    blocks = _blocks(model)
    tensors = tuple(tuple(p.numel() for p in b.parameters() if p.requires_grad)
                    for b in blocks)
    params = tuple(sum(t) for t in tensors)
    flops = tuple(6.0 * p * max(1, tokens_per_sample) for p in params)
    kw: dict[str, Any] = {}
    frozen = tuple(sum(p.numel() for p in b.parameters() if not p.requires_grad)
                   for b in blocks)
    if any(frozen):  # held as weights (was: not counted at all)
        kw["frozen_params"] = frozen
    if sample is not None:
        opt_bytes = optimizer_bytes(optimizer, opt_bytes)
        counted = sample_costs(blocks, sample)
        if counted is not None:
            flops, kw["activation_bytes"], kw["boundary_bytes"] = counted
    return ModelProfile(name=type(model).__name__, block_params=params, block_flops=flops,
                        bytes_per_param=4, grad_bytes_per_param=4,
                        optimizer_bytes_per_param=opt_bytes, precision=precision,
                        block_tensors=tensors, **kw)


def optimizer_bytes(optimizer: Any, default: int) -> int:
    """Bytes of optimizer state per parameter element of the job's optimizer (a config
    value or a factory): built on a stand-in parameter and stepped once, its state tensors
    counted (Adam's two moments: 8; SGD with momentum: 4; plain SGD: 0); ``default`` where it
    cannot be built so."""
    import torch

    from strategies.canonical import probe_state

    from .config.code import optimizer_factory

    try:
        factory = optimizer if callable(optimizer) else optimizer_factory(optimizer)
        state = probe_state(factory, (64,))
        held = sum(t.numel() * t.element_size() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.numel() > 1)
        return round(held / 64)
    except Exception:  # noqa: BLE001 - a factory that needs more: its name's figure
        return default


def sample_costs(blocks: Sequence[nn.Module], x: Any
                 ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None:
    """Per sample and block, from a training-mode forward of the blocks one after the other
    over ``x`` (a batch of a few samples): forward+backward FLOPs (3 x the forward's, as
    torch's ``FlopCounterMode`` counts them: an embedding's lookup is no matmul), the bytes
    of the tensors it saves for its backward (parameters not counted) and the bytes of its
    output (a pipeline's send). Runs on the meta device where the blocks are there (shapes
    only); None where the forward cannot run so (data-dependent control flow on meta)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    n = len(x) if hasattr(x, "__len__") else 1
    flops, kept, sent = [], [], []
    params = {id(p) for b in blocks for p in b.parameters()}
    try:
        with torch.random.fork_rng(devices=[]):
            h = x
            for block in blocks:
                was = block.training
                block.train()
                seen: dict[int, int] = {}

                def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
                    base = t._base if t._base is not None else t
                    if id(base) not in params and id(t) not in params:
                        seen[id(base)] = base.numel() * base.element_size()
                    return t

                counter = FlopCounterMode(display=False)
                try:
                    with counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        h = block(h)
                finally:
                    block.train(was)
                flops.append(3.0 * counter.get_total_flops() / n)
                kept.append(sum(seen.values()) / n)
                sent.append(float(h.numel() * h.element_size()) / n
                            if isinstance(h, torch.Tensor) else 0.0)
    except Exception:  # noqa: BLE001 - said by the caller: the 6 x parameters rule instead
        return None
    return tuple(flops), tuple(kept), tuple(sent)


def tokens_per_sample(dataset: Any) -> int:
    """Sequence length of a token-id sample (integer inputs), else 1."""
    try:
        x, _ = dataset[0]
    except Exception:
        return 1
    if hasattr(x, "dtype") and not x.dtype.is_floating_point and getattr(x, "dim", lambda: 0)() >= 1:
        return int(x.shape[0])
    return 1


def live_cluster(infos: Sequence[dict[str, Any]]) -> tuple[Cluster, list[str]]:
    """One pool per worker (its device, emulation and memory), so each rank maps to one
    device id. Returns the cluster and the device id of each rank, in rank order."""
    pools = []
    for i in infos:
        emu = i.get("emulation") or {}
        pool: dict[str, Any] = {
            "name": f"rank{i['rank']}", "nodes": 1, "devices_per_node": 1, "network": "loopback",
            "device": i.get("catalog_type") or ("CPU" if i["device"] == "cpu" else "A100-80GB"),
        }
        if emu:
            pool["emulation"] = {k: v for k, v in emu.items()
                                 if k in ("slowdown", "memory_gb", "stands_for")}
        pools.append(pool)
    cluster = load_cluster({"name": "live", "pools": pools})
    ids = [d.id for d in cluster.devices]
    return cluster, ids


def device_kinds(infos: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What makes two workers alike: their device and their emulation (devices of one kind
    are treated as equal unless they measure apart beyond the noise)."""
    return [(i.get("device_name"), tuple(sorted((i.get("emulation") or {}).items())))
            for i in infos]


def device_hosts(infos: Sequence[dict[str, Any]]) -> list[Any]:
    """For each worker, its host (the machine: its hostname, else its Ray node; Ray nodes
    started on one machine share its cores) where the job's CPU workers there need every
    core it has or more (3 single-thread ranks on 2 cores, or 2 on 2), else None. Such
    workers are timed at once while the host's scheduler shares its cores among them and
    with the driver and Ray's daemons, so what a profile sees between them is that sharing,
    not their speed (``balanced_shares`` makes them equal): 2 single-thread ranks on the
    2-core CI VM measured 11-71 % apart in 6 of 23 planner-bench configurations
    (2026-12-06), and dp then ran on shares such as [162, 94]. GPU workers and CPU workers
    with a core to spare are measured apart as before: a slow device among them is real; a
    persistent difference between equal ones is the closed loop's to find (a straggler)."""
    return _crowded(infos, *_cpu_hosts(infos), every_core=True)


def _crowded(infos: Sequence[dict[str, Any]], hosts: Sequence[Any], need: dict[Any, int],
             every_core: bool = False) -> list[Any]:
    """Each worker's host where the job's CPU workers there need more threads than its
    cores (``every_core``: at least as many), else None."""
    def crowded(threads: int, cores: int) -> bool:
        return threads >= cores if every_core else threads > cores

    return [h if h is not None and crowded(need[h], int(i.get("host_cores") or 1 << 30))
            else None for h, i in zip(hosts, infos, strict=True)]


def shared_cores(infos: Sequence[dict[str, Any]]) -> list[SharedCores | None]:
    """For each worker on a host whose job ranks need more threads than its cores (3 on 2),
    how the profile shared that host's cores among them; None for the others."""
    hosts, need = _cpu_hosts(infos)
    return [SharedCores(h, float(i["host_cores"]), float(_threads(i)), float(need[h]))
            if h is not None else None
            for h, i in zip(_crowded(infos, hosts, need), infos, strict=True)]


def _threads(info: dict[str, Any]) -> int:
    return max(1, int(info.get("threads") or 1))


def _cpu_hosts(infos: Sequence[dict[str, Any]]) -> tuple[list[Any], dict[Any, int]]:
    """Each CPU worker's host (its hostname, else its Ray node; None for a GPU worker) and
    the threads the job's CPU workers need on each host."""
    hosts = [(i.get("hostname") or i.get("node_id")) if i.get("device") == "cpu" else None
             for i in infos]
    need: dict[Any, int] = {}
    for h, i in zip(hosts, infos, strict=True):
        if h is not None:
            need[h] = need.get(h, 0) + _threads(i)
    return hosts, need


def balanced_shares(global_batch: int, speeds: Sequence[float],
                    kinds: Sequence[Any] | None = None,
                    hosts: Sequence[Any] | None = None) -> tuple[int, ...]:
    """Each worker's share of the global batch follows its measured samples/s; workers of one
    kind whose speeds agree within the noise floor, or that share a host, get equal shares
    (``clusters.measured.equal_within_noise``)."""
    return tuple(proportional_shares(global_batch, list(equal_within_noise(
        speeds, kinds=kinds, hosts=hosts))))


def comm_config() -> CommConfig:
    """How the installed strategies group their messages: ZeRO-1/2 buckets when
    ``strategies.traits`` defines them, else one message per parameter tensor."""
    try:
        from strategies.traits import BUCKET_BYTES, FIRST_BUCKET_BYTES  # type: ignore
    except ImportError:
        return CommConfig(zero_bucket_bytes=None)
    return CommConfig(zero_bucket_bytes=float(BUCKET_BYTES),
                      first_bucket_bytes=float(FIRST_BUCKET_BYTES))


def measured_model(model: nn.Module, optimizer: Any, infos: Sequence[dict[str, Any]],
                   reports: Sequence[dict[str, Any]], precision: str = "fp32"
                   ) -> tuple[Cluster, MeasuredModel]:
    """The live cluster and the cost model the workers' ``profile_terms`` reports measure
    (every term with its spread; equal devices made equal)."""
    cluster, ids = live_cluster(infos)
    base = model_profile(model, optimizer, precision=precision)
    return cluster, terms_model(reports, ids, base, kinds=device_kinds(infos),
                                hosts=device_hosts(infos), shared=shared_cores(infos),
                                comm=comm_config(), cluster=cluster)


def pipeline_rank_shares(replica_batches: Sequence[int], pp: int) -> tuple[int, ...]:
    """Per-rank shares from per-replica batches (ranks are stage-major: r = stage*D + j):
    replica j's batch is split evenly over its ``pp`` ranks, which all-gather it."""
    d = len(replica_batches)
    shares = [0] * (d * pp)
    for j, b in enumerate(replica_batches):
        base, extra = divmod(b, pp)
        for stage in range(pp):
            shares[stage * d + j] = base + (1 if stage < extra else 0)
    return tuple(shares)


def measured_profile(model: nn.Module, optimizer: Any, ids: Sequence[str],
                     details: Sequence[dict[str, Any]], precision: str = "fp32") -> ModelProfile:
    """The model's profile with what the workers measured: per-block forward+backward
    seconds per sample on each device, and the activation bytes per sample between blocks."""
    base = model_profile(model, optimizer, precision=precision)
    secs = {ids[r]: tuple(d["block_seconds"]) for r, d in enumerate(details)
            if len(d.get("block_seconds", ())) == len(base.block_params)}
    bounds = details[0].get("boundary_bytes") if details else None
    kw: dict[str, Any] = {"block_seconds": secs}
    if bounds and len(bounds) == len(base.block_params):
        kw["boundary_bytes"] = tuple(float(b) for b in bounds)
    return replace(base, **kw)


def link_model(points: Sequence[tuple[int, float]], world: int) -> CostModel:
    """A cost model whose links are fitted (alpha, beta) from timed all-reduces between the
    live workers (``points`` = (bytes, seconds))."""
    ms = [Measurement(device="*", samples=0, step_time=t, world_size=world, comm_bytes=n,
                      collective="all_reduce", link="*") for n, t in points if t > 0]
    return calibrate(ms) if ms and world > 1 else CostModel()


def auto_plan(cluster: Cluster, measured: MeasuredModel, global_batch: int,
              **options: Any) -> PlanResult:
    """The planner on the live workers with what they measured, every worker used;
    ``options``: the planner's others (``clusters.planner.plan``: ``trial_tolerance``...)."""
    return plan(cluster, measured.profile, global_batch, model=measured.model, subsets=False,
                rank_order=True, **options)


def auto_spec(model: nn.Module, optimizer: Any, infos: Sequence[dict[str, Any]],
              speeds: Sequence[float], global_batch: int,
              details: Sequence[dict[str, Any]] | None = None,
              links: Sequence[tuple[int, float]] | None = None,
              precision: str = "fp32") -> tuple[StrategySpec, str]:
    """Ask the planner for the fastest plan that fits every worker's memory, using all
    workers, measured speeds, per-block timings and the measured links; returns the spec and
    the planner's explanation."""
    cluster, ids = live_cluster(infos)
    profile = (measured_profile(model, optimizer, ids, details, precision) if details
               else model_profile(model, optimizer, precision=precision))
    cost = link_model(links, len(infos)) if links else None
    result = plan(cluster, profile, global_batch, model=cost,
                  speeds={ids[r]: s for r, s in enumerate(speeds)}, subsets=False,
                  rank_order=True)
    return plan_spec(result.plan), result.explanation


def plan_spec(p: Plan) -> StrategySpec:
    """The ``StrategySpec`` that carries out plan ``p``: a pipeline's shares per rank, and
    for dp and ZeRO the plan's micro-batches as gradient accumulation passes."""
    kw = p.spec_kwargs()
    if p.strategy == "pipeline":
        kw["shares"] = pipeline_rank_shares(p.shares, p.pp_degree)
    elif p.micro_batches > 1:  # dp/ZeRO: the plan's accumulation passes (activations)
        kw["options"] = replace(StrategyOptions.of(kw["options"]),
                                accumulation_steps=p.micro_batches)
        kw["micro_batches"] = 1
    return StrategySpec(**kw)


def param_costs(model: nn.Module) -> list[float]:
    """Each pipeline block's parameters (at least 1), the cost proxy without timings."""
    return [float(max(1, p)) for p in block_params(model)]


def speed_stage_split(model: nn.Module, stage_speeds: Sequence[float]) -> tuple[int, ...]:
    """Pipeline stages from layer costs (parameters as the cost proxy) and device speeds."""
    return split_stages(param_costs(model), list(stage_speeds))


def block_stage_split(block_costs: Sequence[float], stage_speeds: Sequence[float]
                      ) -> tuple[int, ...]:
    """Pipeline stages from measured per-block seconds and each stage's speed (pass speeds
    already made equal where they agree within the noise: ``balanced_shares``'s rule)."""
    return split_stages([max(1e-12, c) for c in block_costs], list(stage_speeds))


def spec_plan(spec: StrategySpec, ids: Sequence[str], model: nn.Module) -> Plan:
    """The ``Plan`` a running ``spec`` carries out on devices ``ids`` (rank order): what the
    cost model predicts for it (the inverse of ``plan_spec``)."""
    if spec.name != "pipeline":
        m = max(1, int(spec.options.accumulation_steps))
        return Plan(strategy=spec.name, world_size=spec.world_size, shares=tuple(spec.shares),
                    micro_batches=m, devices=tuple(ids))
    from strategies.pipeline import _resolve_split, pipeline_blocks

    split = tuple(spec.stage_split or _resolve_split(spec, pipeline_blocks(model)))
    d = spec.world_size // spec.pp_degree
    replicas = tuple(sum(spec.shares[s * d + j] for s in range(spec.pp_degree))
                     for j in range(d))
    v = 2 if spec.schedule == "interleaved" else 1
    return Plan(strategy="pipeline", world_size=spec.world_size, shares=replicas,
                pp_degree=spec.pp_degree, dp_mode=spec.dp_mode,
                micro_batches=spec.micro_batches, schedule=spec.schedule, virtual_stages=v,
                stage_split=split, devices=tuple(ids))
