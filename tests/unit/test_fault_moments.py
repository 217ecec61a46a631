"""Moments of faults the controller must see per node, not per rank: a layout exposed to the
loss of one node's ranks, and the bundles of a node that was to drain but lives on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.control import worker_group as wg
from elastic.control.layouts import unprotected
from strategies import StrategySpec
from tests.unit.test_controller import _controller, _events


@pytest.mark.parametrize("nodes, said", [
    ({0: "nodeA", 1: "nodeA", 2: "nodeB", 3: "nodeB"}, 1),  # PACK: a stage's replicas together
    ({}, 0),  # a node each: every stage keeps a replica whichever node goes
    ({0: "nodeA", 1: "nodeB", 2: "nodeA", 3: "nodeB"}, 0),  # each node a replica of each stage
])
def test_a_pipeline_whose_stage_replicas_share_a_node_is_said_unprotected(tmp_path, nodes,
                                                                         said):
    """pp2 x dp2 on two nodes of two workers: stage 0 is ranks 0, 1 (node A), stage 1 ranks
    2, 3 (node B), so a lost node loses a whole stage and, with neither checkpoints nor peer
    copies, the job goes back to step 0. Was: no ``unprotected`` event (the loss of one rank
    was all that counted, which the pipeline survives)."""
    ctl, fake = _controller(tmp_path, strategy="pipeline", pp_degree=2, num_workers=4)
    fake.node_of.update(nodes)
    ctl.run()
    got = _events(ctl, "unprotected")
    assert len(got) == said, [e.message for e in got]
    if said:
        assert "node" in got[0].message and "peer_copies_every" in got[0].message


def test_unprotected_counts_each_nodes_ranks():
    pp = StrategySpec("pipeline", 4, (2, 2, 2, 2), pp_degree=2, micro_batches=2,
                      schedule="gpipe", dp_mode="dp")
    cfg = SimpleNamespace(checkpoint_every=0, peer_copies_every=0)
    assert unprotected(pp, cfg, ["a", "a", "b", "b"])
    assert not unprotected(pp, cfg, ["a", "b", "c", "d"])
    assert not unprotected(pp, cfg)  # nodes unknown: per rank, as before
    assert not unprotected(pp, cfg, ["a"] * 4)  # one node: its loss is the whole job's
    assert not unprotected(pp, SimpleNamespace(checkpoint_every=5, peer_copies_every=0),
                           ["a", "a", "b", "b"])
    dp = StrategySpec("dp", 4, (2, 2, 2, 2))
    assert not unprotected(dp, cfg, ["a", "a", "b", "b"])
    z = StrategySpec("zero3", 2, (4, 4))
    assert unprotected(z, cfg, ["a", "a"])  # one rank's loss already loses a shard


def _placement(monkeypatch, alive: bool, draining: object) -> wg.Placement:
    def nodes() -> dict[str, int]:
        if isinstance(draining, Exception):
            raise draining
        return dict(draining)  # type: ignore[call-overload]

    monkeypatch.setattr(wg, "node_alive", lambda node: alive)
    monkeypatch.setattr("elastic.ray_connect.draining_nodes", nodes)
    monkeypatch.setattr(wg, "pg_ready", lambda pg: True)
    monkeypatch.setattr(wg, "resources_free", lambda b: False)  # full
    p = wg.Placement(SimpleNamespace(for_worker=lambda: None))
    p._bundle_res = {"CPU": 1.0}  # noqa: SLF001
    p.draining = [("pg", 0, "nodeA")]
    p.lost = [("pg", 1, "nodeB")]  # lost with a node Ray holds alive: waits for its death
    return p


def test_a_notice_that_did_not_come_true_gives_its_bundles_back(monkeypatch):
    """Ray had the node draining (a notice), then drains it no more while it lives on: the
    released workers' bundles become free slots and the job can grow back into them
    (``room``). Was: held in ``draining`` until the node died, for the rest of the run: on
    a full cluster the job never grew back. A hand drain Ray refused was never draining: its
    bundles stay held (a spare there would land on the node the user asked to empty)."""
    drains = {"nodeA": 0}
    p = _placement(monkeypatch, alive=True, draining=drains)
    assert not p.room() and p.draining == [("pg", 0, "nodeA")]
    drains.clear()  # the drain was cancelled
    assert p.room()
    assert p.free_slots == [("pg", 0)] and p.draining == []
    assert p.lost == [("pg", 1, "nodeB")]
    refused = _placement(monkeypatch, alive=True, draining={})
    refused.revive()
    assert refused.free_slots == [] and refused.draining == [("pg", 0, "nodeA")]


@pytest.mark.parametrize("draining", [{"nodeA": 0}, RuntimeError("GCS busy")])
def test_a_node_still_draining_keeps_its_bundles_until_it_goes(monkeypatch, draining):
    p = _placement(monkeypatch, alive=True, draining=draining)
    p.revive()
    assert p.free_slots == [] and p.draining == [("pg", 0, "nodeA")]
    monkeypatch.setattr(wg, "node_alive", lambda node: False)  # the node went
    p.revive()
    assert p.free_slots == [("pg", 0), ("pg", 1)] and p.draining == [] and p.lost == []


def test_slots_beyond_what_the_job_may_grow_into_are_given_back(monkeypatch):
    """A drained node's workers were replaced (a replace-then-move): once the node is gone
    their one-bundle groups, which Ray re-reserves elsewhere where it can, are free slots
    the job at its size cannot use; ``trim_slots(0)`` gives them back, those Ray could not
    re-reserve first, and keeps a group a worker uses (a gang's). Was: held idle for the
    rest of the run, a device no other job on the cluster could have."""
    from elastic.control import calls
    from elastic.control.group import WorkerRec

    p = _placement(monkeypatch, alive=False, draining={})
    p.draining = [("solo-ready", 0, "nodeA"), ("solo-pending", 0, "nodeA"),
                  ("gang", 2, "nodeA")]
    p.lost = []
    sizes = {"solo-ready": 1, "solo-pending": 1, "gang": 3}
    monkeypatch.setattr(calls, "bundle_count", lambda pg: sizes[pg])
    monkeypatch.setattr(calls, "pg_ready", lambda pg: pg != "solo-pending")
    removed: list[str] = []
    monkeypatch.setattr(calls, "remove_bundle", removed.append)
    group = calls.PlacementCalls()
    group.placement = p
    group.workers = [WorkerRec(None, 0, pg="gang", slot=0), WorkerRec(None, 1, pg="gang",
                                                                      slot=1)]
    assert group.trim_slots(2) == 1  # two kept for growth: the pending one goes first
    assert removed == ["solo-pending"] and p.draining == []
    assert p.free_slots == [("solo-ready", 0), ("gang", 2)]
    assert group.trim_slots(0) == 1 and removed == ["solo-pending", "solo-ready"]
    assert p.free_slots == [("gang", 2)]  # (Ray frees no single bundle of a group)
    assert group.trim_slots(0) == 0
