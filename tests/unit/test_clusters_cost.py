"""clusters cost model: ZeRO memory figures, collectives, pipeline bubble, calibration."""

from __future__ import annotations

import math
import random

import pytest

from clusters import (
    Cluster,
    CostModel,
    Measurement,
    ModelProfile,
    Plan,
    PlanError,
    ProfileError,
    bubble_fraction,
    calibrate,
    collective_time,
    device_type,
    link_type,
    load_cluster,
    model_state_bytes,
    optimizer_state_bytes,
    transformer_profile,
)
from clusters.collectives import layout_messages
from clusters.topology import NodePool

GB = 1e9


def _cluster(
    device: str = "A100-80GB", nodes: int = 1, per: int = 8, network: str = "ib-hdr", nics: int = 8
) -> Cluster:
    return load_cluster(
        {
            "name": "t",
            "pools": [
                {
                    "name": "p",
                    "device": device,
                    "nodes": nodes,
                    "devices_per_node": per,
                    "network": network,
                    "nics": nics,
                }
            ],
        }
    )


def test_zero_paper_model_state_figures():
    """ZeRO (Rajbhandari et al. 2020), Fig. 1: 7.5B params, Adam mixed precision, 64 GPUs."""
    k = optimizer_state_bytes("adam", mixed_precision=True)
    assert k == 12 and optimizer_state_bytes("adam", mixed_precision=False) == 8
    expected = {"dp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    for strategy, gb in expected.items():
        m = model_state_bytes(
            strategy, 7.5e9, 64, bytes_per_param=2, grad_bytes=2, optimizer_bytes=k
        )
        assert round(m.model_states / GB, 1) == gb, strategy


def test_zero_figures_hold_through_the_full_estimate():
    """The same numbers come out of CostModel.estimate for real plans on 64 devices."""
    c = _cluster(nodes=8)
    prof = ModelProfile.uniform(n_params=7.5e9, n_blocks=32, flops_per_sample=1e12)
    ids = tuple(d.id for d in c.devices)
    expected = {"dp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}
    for strategy, gb in expected.items():
        est = CostModel().estimate(
            Plan(strategy=strategy, world_size=64, shares=(1,) * 64, devices=ids), c, prof
        )
        assert round(est.memory[0].model_states / GB, 1) == gb
        assert est.memory[0].activations == 0.0


def test_collective_alpha_beta_formulas():
    s, beta = 1e9, 1e-9
    assert collective_time("all_reduce", s, 4, 0.0, beta) == pytest.approx(2 * 3 / 4)
    assert collective_time("all_gather", s, 4, 0.0, beta) == pytest.approx(3 / 4)
    assert collective_time("reduce_scatter", s, 4, 0.0, beta) == pytest.approx(3 / 4)
    assert collective_time("all_reduce", 0.0, 4, 1e-5, beta) == 0.0
    # latency: the fewer hops of a ring (n-1) and a tree (ceil(log2 n)); equal up to 3 ranks
    assert collective_time("all_reduce", 8.0, 3, 1e-5, 0.0) == pytest.approx(4e-5)
    assert collective_time("all_reduce", 8.0, 4, 1e-5, 0.0) == pytest.approx(4e-5)
    assert collective_time("all_gather", 8.0, 4, 1e-5, 0.0) == pytest.approx(2e-5)
    assert collective_time("all_gather", 8.0, 3, 1e-5, 0.0) == pytest.approx(2e-5)
    assert collective_time("all_reduce", 8.0, 10_000, 1e-5, 0.0) == pytest.approx(2 * 14e-5)
    assert collective_time("p2p", s, 2, 1e-5, beta) == pytest.approx(1.0 + 1e-5)
    assert collective_time("all_reduce", s, 1, 1.0, 1.0) == 0.0
    # reduce and broadcast: a pipelined chain, (n-1) alpha + S beta
    assert collective_time("broadcast", s, 4, 0.0, beta) == pytest.approx(1.0)
    assert collective_time("reduce", 8.0, 4, 1e-5, 0.0) == pytest.approx(2e-5)
    with pytest.raises(ValueError):
        collective_time("gather", s, 4, 0, beta)


def test_data_parallel_comm_uses_the_slowest_link():
    prof = ModelProfile.uniform(n_params=1e9, n_blocks=4, flops_per_sample=1e12)
    model = CostModel(link_efficiency=1.0)
    one_node = _cluster()
    two_nodes = _cluster(nodes=2, network="eth-25g", nics=1)
    for c, link in ((one_node, "nvlink3"), (two_nodes, "eth-25g")):
        n = len(c.devices)
        p = Plan(
            strategy="dp", world_size=n, shares=(2,) * n, devices=tuple(d.id for d in c.devices)
        )
        est = model.estimate(p, c, prof)
        lk = link_type(link)
        # 4 blocks of one 500 MB tensor each: DDP sends each in a bucket of its own
        want = 4 * collective_time("all_reduce", 5e8, n, lk.latency, 1 / lk.bandwidth)
        assert est.comm == pytest.approx(want)
        assert est.link.startswith(link)


def _pipe(prof, m, schedule, p=4, v=1, shares=(16,)):
    c = _cluster()
    n = p * len(shares)
    split = (prof.n_blocks // (p * v),) * (p * v)
    return c, Plan(
        strategy="pipeline",
        world_size=n,
        shares=shares,
        pp_degree=p,
        micro_batches=m,
        schedule=schedule,
        virtual_stages=v,
        stage_split=split,
        devices=tuple(d.id for d in c.devices[:n]),
    )


def test_pipeline_bubble_is_p_minus_1_over_m():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, "gpipe") == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, "interleaved", 2) == pytest.approx(3 / 16)
    prof = ModelProfile.uniform(n_params=1e6, n_blocks=8, flops_per_sample=8e12)
    model = CostModel(pass_overhead_s=0.0)
    rate = device_type("A100-80GB").peak_flops("bf16") * model.compute_efficiency
    for m in (4, 8, 16):
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            c, p = _pipe(prof, m, schedule, v=v)
            est = model.estimate(p, c, prof)
            t_micro = (16 // m) * 2e12 / rate  # one position's work per micro-batch
            ideal = m * t_micro
            assert est.compute / ideal - 1 == pytest.approx(bubble_fraction(4, m, schedule, v))
            assert est.bubble == pytest.approx(bubble_fraction(4, m, schedule, v))


def test_pipeline_activation_memory_by_schedule():
    a = 1e6  # bytes kept per sample per block
    prof = ModelProfile.uniform(n_params=1e6, n_blocks=8, flops_per_sample=1e9, activation_bytes=a)
    m, b = 8, 2
    _, p = _pipe(prof, m, "gpipe")
    c, p1 = _pipe(prof, m, "1f1b")
    gpipe = CostModel().estimate(p, c, prof).memory
    ofob = CostModel().estimate(p1, c, prof).memory
    assert [x.activations for x in gpipe] == [pytest.approx(m * b * 2 * a)] * 4
    # 1F1B: stage s holds at most p - s micro-batches (stage 0: p = 4 < m).
    assert [x.activations for x in ofob] == [pytest.approx(k * b * 2 * a) for k in (4, 3, 2, 1)]


def test_heterogeneous_data_parallel_waits_for_the_slowest_rank():
    pools = [
        NodePool("a", device_type("A100-80GB"), 1, 1, link_type("nvlink3"), link_type("eth-100g")),
        NodePool("t", device_type("T4"), 1, 1, link_type("pcie3"), link_type("eth-100g")),
    ]
    c = Cluster.from_pools("h", pools)
    prof = ModelProfile.uniform(n_params=1e3, n_blocks=2, flops_per_sample=1e12, precision="fp16")
    model = CostModel(pass_overhead_s=0.0)
    ids = tuple(d.id for d in c.devices)
    even = model.estimate(Plan(strategy="dp", world_size=2, shares=(8, 8), devices=ids), c, prof)
    t4 = 8 * 1e12 / (65e12 * 0.4)
    assert even.compute == pytest.approx(t4)
    skew = model.estimate(Plan(strategy="dp", world_size=2, shares=(14, 2), devices=ids), c, prof)
    assert skew.compute < even.compute


def test_sample_time_sources_in_priority_order():
    c = _cluster(per=2)
    d0, d1 = c.devices
    prof = ModelProfile(
        block_params=(10, 10),
        block_flops=(1e12, 1e12),
        block_seconds={"A100-80GB": (0.5, 0.5), d1.id: (0.25, 0.25)},
    )
    model = CostModel(seconds_per_sample={d0.id: 3.0})
    assert model.sample_time(d0, prof) == 3.0  # calibrated, by id
    assert model.sample_time(d0, prof, [0]) == pytest.approx(1.5)  # by work fraction
    assert model.sample_time(d1, prof) == 0.5  # profiled, by id
    assert CostModel().sample_time(d0, prof) == 1.0  # profiled, by type
    bare = ModelProfile(block_params=(1, 1))
    with pytest.raises(ProfileError, match="cannot time"):
        CostModel().sample_time(d0, bare)


def test_profiles_validate_and_build():
    with pytest.raises(ProfileError, match="block_flops has 1"):
        ModelProfile(block_params=(1, 2), block_flops=(1.0,))
    t = transformer_profile(layers=4, d_model=256, n_heads=4, seq_len=128, vocab=1000)
    assert t.n_blocks == 6 and t.optimizer_bytes_per_param == 12
    assert t.block_params[1] == 12 * 256 * 256 + 13 * 256
    assert t.with_optimizer("sgd").optimizer_bytes_per_param == 4  # master copy only


def test_plan_validation_and_round_trip():
    p = Plan(
        strategy="pipeline",
        world_size=8,
        shares=(8, 8),
        pp_degree=4,
        dp_mode="zero1",
        micro_batches=4,
        schedule="1f1b",
        stage_split=(2, 2, 2, 2),
    )
    p.validate(8)
    assert p.dp_degree == 2 and p.rank(3, 1) == 7 and p.coords(7) == (3, 1)
    assert p.samples(7) == 8
    assert Plan.from_dict(p.to_dict()) == p
    assert set(p.spec_kwargs()) == {
        "name",
        "world_size",
        "shares",
        "pp_degree",
        "micro_batches",
        "schedule",
        "stage_split",
        "dp_mode",
        "options",
    }
    bad = [
        Plan(strategy="fsdp", world_size=1, shares=(1,)),
        Plan(strategy="dp", world_size=2, shares=(1,)),
        Plan(
            strategy="pipeline",
            world_size=4,
            shares=(6,),
            pp_degree=4,
            micro_batches=4,
            stage_split=(1, 1, 1, 1),
        ),
        Plan(
            strategy="pipeline",
            world_size=4,
            shares=(8,),
            pp_degree=4,
            micro_batches=4,
            schedule="interleaved",
            stage_split=(1, 1, 1, 1),
        ),
    ]
    for b in bad:
        with pytest.raises(PlanError):
            b.validate(4)
    with pytest.raises(PlanError, match="covers 4 blocks"):
        Plan(
            strategy="pipeline",
            world_size=4,
            shares=(8,),
            pp_degree=4,
            micro_batches=4,
            stage_split=(1, 1, 1, 1),
        ).validate(8)


# ------------------------------------------------------------------ calibration


def _synthetic(noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    rng = random.Random(seed)
    truth_c = {"A100-80GB": 0.01, "T4": 0.08}
    alpha, beta = 2e-5, 1 / 10e9
    out = []
    for dev, c in truth_c.items():
        for n in (2, 4, 8, 16):
            for nbytes in (1e8, 5e8):
                for samples in (4, 16):
                    hops = 2 * min(n - 1, math.ceil(math.log2(n)))  # ring or tree, the fewer
                    t = c * samples + hops * alpha + 2 * (n - 1) / n * nbytes * beta
                    t *= 1 + rng.uniform(-noise, noise)
                    out.append(
                        Measurement(
                            device=dev,
                            samples=samples,
                            step_time=t,
                            world_size=n,
                            comm_bytes=nbytes,
                            link="ib",
                        )
                    )
    return out


def test_calibrate_recovers_synthetic_constants():
    fit = calibrate(_synthetic())
    assert fit.seconds_per_sample["A100-80GB"] == pytest.approx(0.01, rel=1e-6)
    assert fit.seconds_per_sample["T4"] == pytest.approx(0.08, rel=1e-6)
    a, b = fit.links["ib"]
    assert a == pytest.approx(2e-5, rel=1e-4)
    assert b == pytest.approx(1e-10, rel=1e-6)
    noisy = calibrate(_synthetic(noise=0.01, seed=3))
    assert noisy.seconds_per_sample["T4"] == pytest.approx(0.08, rel=0.05)
    assert noisy.links["ib"][1] == pytest.approx(1e-10, rel=0.05)


def test_calibrated_model_predicts_the_measured_step():
    c = _cluster(per=4)
    prof = ModelProfile.uniform(
        n_params=5e7,
        n_blocks=4,
        flops_per_sample=1e12,
        bytes_per_param=4,
        optimizer_bytes_per_param=8,
    )
    ids = tuple(d.id for d in c.devices)
    grad_bytes = 5e7 * 4
    # DDP sends the 4 blocks' 50 MB tensors in 4 buckets: 4 x 4 latencies per step
    assert sum(m.count for m in layout_messages("dp", 4, [grad_bytes / 4] * 4)) == 4
    ms = [
        Measurement(
            device="A100-80GB",
            samples=s,
            world_size=4,
            comm_bytes=grad_bytes,
            messages=4,
            step_time=0.02 * s + 4 * 4 * 1e-4 + 1.5 * grad_bytes / 2e9,
            link="nvlink3",
        )
        for s in (1, 2, 4, 8)
    ]
    fit = calibrate(ms, CostModel(pass_overhead_s=0.0))
    est = fit.estimate(Plan(strategy="dp", world_size=4, shares=(8,) * 4, devices=ids), c, prof)
    assert est.compute + est.comm == pytest.approx(0.02 * 8 + 4 * 4e-4 + 1.5 * grad_bytes / 2e9)


def test_calibrate_compute_only_and_bad_input():
    fit = calibrate([Measurement(device="n/0", samples=10, step_time=0.5)])
    assert fit.seconds_per_sample == {"n/0": pytest.approx(0.05)}
    assert fit.links == {}
    with pytest.raises(Exception, match="at least one"):
        calibrate([])
    with pytest.raises(Exception, match="bad measurement"):
        calibrate([Measurement(device="x", samples=1, step_time=0.0)])


def test_a_reused_pipeline_layout_gives_each_model_its_own_estimate():
    """The planner reuses one mesh layout (and its memo of per-replica times, syncs and
    optimizer steps) for every m, schedule and dp_mode tried; the memo must answer each
    model and profile with their own figures, as a fresh layout does."""
    from clusters.pipeline_cost import mesh_layout

    prof = ModelProfile.uniform(n_params=4e8, n_blocks=8, flops_per_sample=8e12,
                                activation_bytes=1e6)
    fat = ModelProfile.uniform(n_params=8e8, n_blocks=8, flops_per_sample=4e13,
                               activation_bytes=1e6)
    c = _cluster(nodes=2)
    devs = list(c.devices)
    plans = [Plan(strategy="pipeline", world_size=16, shares=(8,) * 4, pp_degree=4,
                  micro_batches=m, schedule=s, dp_mode=mode, stage_split=(2,) * 4,
                  devices=tuple(d.id for d in devs))
             for m in (4, 8) for s in ("gpipe", "1f1b") for mode in ("dp", "zero1", "zero3")]
    models = [CostModel(), CostModel(pass_overhead_s=0.01, sync_wait_s=0.002)]
    shared = mesh_layout(models[0], c, prof, devs, 4)
    for model in models + models[::-1]:
        for pr in (prof, fat, prof):
            for p in plans:
                fresh = model.estimate(p, c, pr, layout=mesh_layout(model, c, pr, devs, 4))
                assert model.estimate(p, c, pr, layout=shared) == fresh, (p.label, pr.n_params)


@pytest.mark.parametrize("mode", ["dp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("hooks", [True, False])
def test_per_micro_batch_says_which_messages_read_the_micro_batch_count(mode, hooks):
    """The pipeline estimate keys its sync memo by m only where ``per_micro_batch``: the
    messages and meeting points of the other modes must not change with m."""
    from clusters.collectives import CommConfig, _layout_messages, per_micro_batch, sync_points

    tensors, units = (4e6, 1e6, 8e6, 2e6), (5e6, 10e6)
    # the messages as built, before layout_messages drops m where it is not read
    one = (_layout_messages(mode, 4, tensors, units, 1, CommConfig(), hooks),
           sync_points(mode, 4, len(units), 1, hooks))
    four = (_layout_messages(mode, 4, tensors, units, 4, CommConfig(), hooks),
            sync_points(mode, 4, len(units), 4, hooks))
    assert (one != four) == per_micro_batch(mode, hooks)
