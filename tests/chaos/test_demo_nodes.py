"""The chaos demo's nodes (``elastic.ray_connect.LocalNodes``): a node taken away, as the demo
does to show a loss without notice, is not reported to the driver as a crash."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.chaos


def test_a_node_taken_away_is_not_reported_as_a_crash(capfd):
    """Its Ray agents outlived its raylet and told the driver "Raylet is terminated.
    Termination is unexpected ..." with the raylet's last 20 log lines, which `elastic demo
    --chaos` printed under its summary."""
    import ray

    from elastic.ray_connect import LocalNodes
    from tests.ray_fixtures import _shutdown

    _shutdown()  # this test runs its own nodes (the suite's local Ray is started again later)
    nodes = LocalNodes(1)
    try:
        node = nodes.nodes[-1]
        nodes.remove(node.node_id)
        deadline = time.time() + 20
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            assert time.time() < deadline, "the node was not marked dead"
            time.sleep(0.2)
        time.sleep(1.5)  # an agent's report reached the driver within a second of the loss
        out, err = capfd.readouterr()
        assert "Termination is unexpected" not in out + err, (out + err)[-2000:]
    finally:
        nodes.shutdown()
