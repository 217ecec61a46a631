"""clusters: catalog, cluster files, live inventory, launcher files, import boundaries."""

from __future__ import annotations

import ast
import copy
import glob
import os
import pickle
import subprocess
import sys

import pytest
import yaml

from clusters import (
    ClusterFileError,
    InventoryError,
    cluster_from_launcher_config,
    cluster_from_ray_nodes,
    cluster_to_dict,
    device_type,
    device_types,
    example_path,
    link_type,
    link_types,
    load_cluster,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "clusters")


# ------------------------------------------------------------------ catalog


def test_catalog_lists_required_devices_with_sources():
    names = set(device_types())
    assert {
        "A100-40GB",
        "A100-80GB",
        "H100",
        "H200",
        "V100",
        "T4",
        "L4",
        "A10G",
        "MI300X",
        "CPU",
    } <= names
    for d in device_types().values():
        assert d.source, d.name
        assert d.memory_gb > 0 and d.memory_bandwidth_gbps > 0
        assert "fp32" in d.peak_tflops
        link_type(d.intra_node_link)  # every device names a known link
    h100 = device_type("H100")
    assert h100.peak_tflops["bf16"] == pytest.approx(989.4)  # dense: sparse 1979 halved
    assert h100.peak_tflops["fp8"] == pytest.approx(1978.9)
    assert device_type("A100-80GB").memory_gb == 80
    assert device_type("H200").memory_gb == 141


def test_precision_falls_back_where_hardware_lacks_it():
    t4 = device_type("T4")
    assert t4.peak_flops("bf16") == pytest.approx(8.1e12)  # Turing: no bf16 -> fp32 rate
    assert t4.peak_flops("fp16") == pytest.approx(65e12)
    assert device_type("A100-40GB").peak_flops("fp8") == pytest.approx(312e12)
    with pytest.raises(ValueError, match="unknown precision"):
        t4.peak_flops("int4")


def test_catalog_links_cover_the_interconnect_classes():
    names = set(link_types())
    assert {
        "nvlink2",
        "nvlink3",
        "nvlink4",
        "pcie3",
        "pcie4",
        "pcie5",
        "ib-hdr",
        "ib-ndr",
        "eth-25g",
        "eth-100g",
        "loopback",
    } <= names
    for lk in link_types().values():
        assert lk.source and lk.bandwidth > 0 and lk.latency > 0
    assert link_type("ib-ndr").bandwidth == pytest.approx(50e9)
    assert link_type("pcie4").bandwidth == pytest.approx(31.5e9)


def test_device_lookup_by_ray_accelerator_name():
    assert device_type("A100").name == "A100-40GB"  # ambiguous bare name: safe (smaller) part
    assert device_type("A100-80G").name == "A100-80GB"
    assert device_type("AMD-Instinct-MI300X-OAM").name == "MI300X"
    assert device_type("t4").name == "T4"
    with pytest.raises(ClusterFileError, match="unknown device type 'B999'.*A100-40GB"):
        device_type("B999")


# ------------------------------------------------------------------ cluster files


def test_every_example_cluster_file_loads():
    files = sorted(glob.glob(os.path.join(PKG, "examples", "*.yaml")))
    assert len(files) >= 4
    for f in files:
        c = load_cluster(f)
        assert c.devices and c.source == f
        assert c.describe().startswith(f"cluster {c.name}")


def test_example_a100_t4_shape_and_bottleneck():
    c = load_cluster(example_path("a100-t4"))
    assert [(p.name, p.device.name, p.count, p.devices_per_node) for p in c.pools] == [
        ("a100", "A100-80GB", 1, 8),
        ("t4", "T4", 2, 4),
    ]
    assert len(c.devices) == 16 and len({d.id for d in c.devices}) == 16
    a100 = [d for d in c.devices if d.pool == "a100"]
    assert c.path(a100).name == "nvlink3"
    assert c.path(c.devices).name == "eth-50gx1"  # the T4 nodes' single 50 GbE port
    assert c.path(c.devices[:1]) is None
    mixed = load_cluster(example_path("mixed-a100-l4-t4"))
    a100_l4 = [d for d in mixed.devices if d.pool in ("a100", "l4")]
    assert mixed.path(a100_l4).name == "eth-25g"  # inter_pool_link caps cross-pool traffic
    two_a100_nodes = [d for d in mixed.devices if d.pool == "a100"]
    assert mixed.path(two_a100_nodes).bandwidth == pytest.approx(8 * 25e9)  # 8 x HDR
    h = load_cluster(example_path("h100x8"))
    assert h.path(h.devices).name == "nvlink4"


def test_emulated_example_marks_devices():
    c = load_cluster(example_path("cpu-emulated"))
    slow = [d for d in c.devices if d.pool == "slow"]
    assert len(slow) == 1 and slow[0].emulated and slow[0].slowdown == 4.0
    assert slow[0].memory_bytes == 0.5e9
    assert "emulated" in slow[0].label and "T4" in slow[0].label


def test_cluster_dict_round_trip():
    c = load_cluster(example_path("mixed-a100-l4-t4"))
    again = load_cluster(cluster_to_dict(c))
    assert cluster_to_dict(again) == cluster_to_dict(c)
    assert [d.id for d in again.devices] == [d.id for d in c.devices]


def _good() -> dict:
    return {
        "name": "x",
        "pools": [{"name": "a", "device": "A100-80GB", "nodes": 2, "devices_per_node": 8}],
    }


@pytest.mark.parametrize(
    "mutate, field, text",
    [
        (
            lambda d: d["pools"][0].update(devices_per_nod=8),
            "pools[0].devices_per_nod",
            "did you mean 'devices_per_node'",
        ),
        (lambda d: d["pools"][0].update(device="A200"), "pools[0].device", "unknown device type"),
        (lambda d: d["pools"][0].update(nodes=-1), "pools[0].nodes", "must be >= 0"),
        (lambda d: d["pools"][0].update(nodes=True), "pools[0].nodes", "must be an integer"),
        (
            lambda d: d["pools"][0].update(network="infiniband"),
            "pools[0].network",
            "unknown interconnect",
        ),
        (lambda d: d["pools"][0].pop("device"), "pools[0].device", "is required"),
        (lambda d: d.pop("pools"), "pools", "non-empty list"),
        (lambda d: d["pools"].append(dict(d["pools"][0])), "pools[1].name", "duplicate"),
        (
            lambda d: d["pools"][0].update(emulation={"slowdown": 0}),
            "pools[0].emulation.slowdown",
            "must be > 0",
        ),
        (lambda d: d["pools"][0].update(nodes=0), "pools", "hold no devices"),
        (lambda d: d.update(colour="red"), "colour", "unknown key"),
        # YAML's .inf / .nan (was: a traceback, or a price printed as $nan; session 47)
        (lambda d: d["pools"][0].update(memory_gb=float("inf")), "pools[0].memory_gb",
         "must be a finite number"),
        (lambda d: d["pools"][0].update(price_per_device_hour=float("nan")),
         "pools[0].price_per_device_hour", "must be a finite number"),
    ],
)
def test_cluster_file_errors_name_the_field(mutate, field, text):
    d = _good()
    mutate(d)
    with pytest.raises(ClusterFileError) as ei:
        load_cluster(d)
    assert ei.value.field == field
    assert text in str(ei.value)
    again = pickle.loads(pickle.dumps(ei.value))  # crosses Ray actors intact
    assert str(again) == str(ei.value)


def test_cluster_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npools:\n  - name: a\n    device: T4\n    nodes: 1\n")
    with pytest.raises(ClusterFileError, match=r"bad\.yaml: pools\[0\]\.devices_per_node"):
        load_cluster(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ClusterFileError, match="not valid YAML"):
        load_cluster(str(broken))


# ------------------------------------------------------------------ live inventory


def _node(nid, addr, res, labels=None, alive=True):
    return {
        "Alive": alive,
        "NodeID": nid,
        "NodeManagerAddress": addr,
        "Resources": res,
        "Labels": labels or {},
    }


def test_inventory_maps_ray_nodes_onto_the_catalog():
    nodes = [
        _node("head", "10.0.0.1", {"CPU": 8.0, "memory": 3e10}),
        _node(
            "n-a100",
            "10.0.0.2",
            {
                "CPU": 96.0,
                "GPU": 8.0,
                "accelerator_type:A100": 1.0,
                "accelerator_type:A100-80G": 1.0,
            },
        ),
        _node("n-t4-1", "10.0.0.3", {"CPU": 48.0, "GPU": 4.0, "accelerator_type:T4": 1.0}),
        _node("n-t4-2", "10.0.0.4", {"CPU": 48.0, "GPU": 4.0}, {"ray.io/accelerator-type": "T4"}),
        _node("n-dead", "10.0.0.5", {"GPU": 8.0, "accelerator_type:H100": 1.0}, alive=False),
        _node(
            "n-l4",
            "10.0.0.6",
            {"GPU": 4.0, "elastic_device:L4": 1.0},
            {"elastic.io/network": "eth-50g", "elastic.io/nics": "2"},
        ),
    ]
    c = cluster_from_ray_nodes(nodes)
    by_pool = {p.name: p for p in c.pools}
    assert set(by_pool) == {"a100-80gb", "t4", "l4"}
    assert by_pool["a100-80gb"].device.name == "A100-80GB"  # the longer, exact name wins
    assert by_pool["t4"].count == 2 and by_pool["t4"].devices_per_node == 4
    assert by_pool["l4"].network.name == "eth-50g" and by_pool["l4"].nics == 2
    assert by_pool["a100-80gb"].network.name == "eth-100g"  # default between hosts
    assert len(c.devices) == 8 + 4 + 4 + 4
    assert {n.id for n in c.nodes} == {"n-a100", "n-t4-1", "n-t4-2", "n-l4"}  # no head, no dead
    assert c.node("n-a100").address == "10.0.0.2"
    assert c.device("n-t4-2/3").type.name == "T4"


def test_inventory_unknown_accelerator_says_how_to_fix():
    nodes = [_node("n1", "10.0.0.2", {"GPU": 8.0, "accelerator_type:B200": 1.0})]
    with pytest.raises(InventoryError, match="B200.*elastic.io/device-type"):
        cluster_from_ray_nodes(nodes)
    c = cluster_from_ray_nodes(nodes, default_gpu_type="H100")
    assert c.devices[0].type.name == "H100"
    with pytest.raises(InventoryError, match="no usable GPU"):
        cluster_from_ray_nodes([_node("h", "1", {"CPU": 4.0})], use_gpu=True)


def test_inventory_cpu_workers_with_emulation_labels():
    nodes = [
        _node("fast", "127.0.0.1", {"CPU": 2.0, "memory": 4e9}),
        _node(
            "slow",
            "127.0.0.1",
            {"CPU": 1.0, "memory": 4e9},
            {
                "elastic.io/emulated-slowdown": "4",
                "elastic.io/emulated-memory-gb": "0.5",
                "elastic.io/emulated-type": "T4",
            },
        ),
    ]
    c = cluster_from_ray_nodes(nodes)
    fast = [d for d in c.devices if d.node == "fast"]
    slow = [d for d in c.devices if d.node == "slow"]
    assert len(fast) == 2 and not fast[0].emulated and fast[0].memory_bytes == 2e9
    assert slow[0].emulated and slow[0].slowdown == 4.0 and slow[0].memory_bytes == 0.5e9
    assert {p.network.name for p in c.pools} == {"loopback"}  # one host
    bad = [_node("x", "1", {"CPU": 1.0}, {"elastic.io/emulated-slowdown": "fast"})]
    with pytest.raises(InventoryError, match="must be numbers"):
        cluster_from_ray_nodes(bad)


# ------------------------------------------------------------------ launcher files


def _launcher_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(PKG, "launcher", "*.yaml")))
    assert files
    return files


def test_launcher_files_pass_rays_own_validation():
    util = pytest.importorskip("ray.autoscaler._private.util")
    jsonschema = pytest.importorskip("jsonschema")
    for f in _launcher_files():
        with open(f) as fh:
            cfg = yaml.safe_load(fh)
        util.validate_config(util.prepare_config(copy.deepcopy(cfg)))
    broken = copy.deepcopy(cfg)
    next(iter(broken["available_node_types"].values()))["resources"]["GPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        util.validate_config(util.prepare_config(broken))


def test_launcher_file_gives_the_same_cluster_as_the_example():
    with open(os.path.join(PKG, "launcher", "aws-a100-t4.yaml")) as fh:
        cfg = yaml.safe_load(fh)
    live = cluster_to_dict(cluster_from_launcher_config(cfg))
    example = cluster_to_dict(load_cluster(example_path("a100-t4")))
    live.pop("name"), example.pop("name")
    assert live == example
    bigger = cluster_from_launcher_config(cfg, counts={"a100": 2, "t4": 0})
    assert [(p.name, p.count) for p in bigger.pools] == [("a100", 2)]
    for f in _launcher_files():
        with open(f) as fh:
            assert cluster_from_launcher_config(yaml.safe_load(fh)).devices


# ------------------------------------------------------------------ boundaries


def test_clusters_imports_no_torch_elastic_or_ray():
    """clusters/ knows hardware and cost: no torch, Ray or elastic. Of strategies/ it reads
    only the torch-free traits table (what each layout shards: strategies are described
    once), never the layouts themselves."""
    banned = {"torch", "elastic", "strategies", "ray"}
    allowed = {"strategies.traits"}
    for f in glob.glob(os.path.join(PKG, "**", "*.py"), recursive=True):
        with open(f) as fh:
            tree = ast.parse(fh.read(), f)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            for m in mods:
                assert m in allowed or m.split(".")[0] not in banned, f"{f} imports {m}"
    code = (
        "import sys, clusters, clusters.simulator, clusters.planner; "
        "bad = [m for m in ('torch', 'ray', 'elastic') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
