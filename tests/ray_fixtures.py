"""Ray fixtures.

``ray_local``: a private local Ray instance (4 logical CPUs), started on first use and shared by
the following tests; ``ray_cluster``: a real multi-node ``ray.cluster_utils.Cluster`` (separate
raylets) whose nodes tests remove and add. Whatever a fixture starts is stopped: the cluster at
the end of its test, the local instance at the end of the session.
"""

from __future__ import annotations

import pytest


def _shutdown() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _ray_session_guard():
    yield
    _shutdown()


@pytest.fixture
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
        )
    return ray


class ChaosCluster:
    """A head with no CPUs (the driver attaches to it) plus worker nodes of 1 CPU each."""

    def __init__(self, n_nodes: int) -> None:
        from ray.cluster_utils import Cluster

        _shutdown()
        self.cluster = Cluster(
            initialize_head=True,
            connect=True,
            head_node_args={
                "num_cpus": 0,
                "include_dashboard": False,
                "_system_config": {
                    "health_check_period_ms": 500,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self.nodes = [self.add_node() for _ in range(n_nodes)]

    def add_node(self):
        node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        return node

    def node_of(self, node_id: str):
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    def remove(self, node_id: str) -> None:
        node = self.node_of(node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def shutdown(self) -> None:
        """Disconnect, then stop every node at once (SIGKILL, as a lost node): a graceful stop
        waits for each raylet in turn (14-18 s a cluster), and nothing of a test's cluster
        needs to outlive it."""
        _shutdown()
        for node in list(self.cluster.worker_nodes):
            self.cluster.remove_node(node, allow_graceful=False)
        if self.cluster.head_node is not None:
            self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
        self.cluster.shutdown()


@pytest.fixture
def ray_cluster():
    clusters: list[ChaosCluster] = []

    def make(n_nodes: int) -> ChaosCluster:
        c = ChaosCluster(n_nodes)
        clusters.append(c)
        return c

    yield make
    for c in clusters:
        c.shutdown()
