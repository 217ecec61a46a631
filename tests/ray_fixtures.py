"""Ray fixtures.

``ray_local``: a private local Ray instance (4 logical CPUs), started on first use and shared by
the following tests, with a warm ``WorkerPool`` made the default pool of the tests' jobs (a
worker process costs ~3.5 s of CPU to start, torch and DDP's imports, more than most of these
jobs' training: the integration layer took 2.9x as long without it); a test marked
``cold_workers`` gets no pool and an empty cluster (one that checks the cluster's resources
or its workers' processes, or brings its own pool); ``ray_cluster``: a real multi-node ``ray.cluster_utils.Cluster`` (separate
raylets) whose nodes tests remove and add.

A test's cluster is kept for the next one when the test passed: the next ``ray_cluster(n)``
reconnects the driver, waits until nothing of the earlier job is left (no live actor, every CPU
free, no node draining), and adds or removes worker nodes until there are ``n``: a fresh head and
nodes cost 5-15 s here, more than many of these tests' jobs. Each test still gets its own job,
processes and group on real nodes, and every node a test removed is gone (a new one replaces
it), as on a real cluster where jobs come and go (``bench/stress_node_loss.py`` reuses clusters
the same way). A cluster that is not idle in time, or whose test failed, is shut down and a new
one made. A module's kept cluster serves the next module's first ``ray_cluster`` too (the
chaos modules follow each other), unless it holds a warm pool. Whatever a fixture starts is
stopped: a kept cluster when a ``ray_local`` test comes or at the end of the session, the
local instance at the end of the session.

A ``ray_cluster`` test marked ``warm_workers`` runs its jobs on a warm ``WorkerPool`` kept
with the cluster (the scheduler's configuration: per-worker bundles, processes handed from
job to job), so it pays no cold start for the workers an earlier test left; the driver then
stays attached between tests, and the next one's check that nothing of the earlier job is left
allows only the pool's idle workers. The others start their workers cold in one gang group,
as ``elastic run`` does (the pool is closed first). Warm tests run first in their module
(``conftest.py``), so the pool is not closed and rebuilt between them.
"""

from __future__ import annotations

import pytest

_POOL: list = []  # the warm pool of the ray_local tests (see ``ray_local``)
_SESSION_KEPT: list = []  # a module's kept cluster, for the next module (no pool, detached)


def _close_pool() -> None:
    while _POOL:
        _POOL.pop().close()


def _shutdown() -> None:
    import sys

    _close_pool()
    ray = sys.modules.get("ray")  # a run that never used Ray (the unit layer) never imports it
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def _drop_session_kept() -> None:
    while _SESSION_KEPT:
        _SESSION_KEPT.pop().shutdown()


@pytest.fixture(scope="session", autouse=True)
def _ray_session_guard():
    yield
    _drop_session_kept()
    _shutdown()


def _stop_left_jobs() -> None:
    """Stop, through their mailboxes, the jobs a test left running on the cluster (one that
    failed before its own ``stop()``): a job of 100,000 steps would hold the next tests'
    CPUs until the suite's end."""
    import sys
    import time

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from elastic.control import mailbox

    left = mailbox.list_jobs()
    for job in left:
        try:
            mailbox.ask(job, "stop", reason="its test ended", timeout_s=60)
        except Exception as e:  # noqa: BLE001 - the test's own failure is the one to read
            print(f"job {job!r}, left running by the test, did not stop: {e!r}",
                  file=sys.stderr)
    deadline = time.monotonic() + 60  # each ends at its boundary: its mailbox goes with it
    while left and set(left) & set(mailbox.list_jobs()) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture
def ray_local(request):
    import ray

    _drop_session_kept()  # a multi-node cluster kept for the next chaos module is not needed
    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            logging_level="ERROR",
            log_to_driver=False,
        )
    if request.node.get_closest_marker("cold_workers") is not None:
        _close_pool()  # its idle workers' bundles are freed: the test sees an empty cluster
    elif not _POOL:
        from elastic.control.pool import WorkerPool

        _POOL.append(WorkerPool(0, max_idle=4).make_default())
    yield ray
    _stop_left_jobs()


# Ray Data's detached actors (0 CPUs), which outlive the driver that ran a pipeline
RAY_DATA_ACTORS = ("_StatsActor", "_AutoscalingCoordinatorActor", "_UsageCollectionActor")


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
                    "health_check_initial_delay_ms": 0,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        self._raylets: set[int] = set()  # of the nodes removed (``_drop``)
        self._node_ids: set[str] = set()
        self._session_dir = self.cluster.head_node.get_session_dir_path()
        self.nodes = [self.add_node() for _ in range(n_nodes)]
        self.pool = None  # the warm_workers tests' pool (see the module's docstring)

    def set_warm(self, warm: bool) -> None:
        """Jobs on the cluster's warm pool (made when missing), or cold (the pool closed:
        its idle workers end and free their CPUs)."""
        if warm and self.pool is None:
            from elastic.control.pool import WorkerPool

            self.pool = WorkerPool(0, max_idle=8).make_default()
        elif not warm and self.pool is not None:
            self.pool.close()
            self.pool = None

    def add_node(self):
        node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        return node

    def reuse(self, n_nodes: int, timeout_s: float = 10.0) -> bool:
        """Make this cluster, kept from an earlier test, ready for a new one with ``n_nodes``
        worker nodes (see the module's docstring); False when it cannot be (the caller shuts
        it down)."""
        import time

        import ray

        from elastic.ray_connect import draining_nodes

        head = self.cluster.head_node
        if head is None or not head.remaining_processes_alive():
            return False
        for node in list(self.cluster.worker_nodes):
            if not node.remaining_processes_alive():
                self._drop(node)
        if self.pool is None:  # with a pool, the driver that owns its workers stays
            _shutdown()
            self.cluster.connected = False
            self.cluster.connect()
        draining = draining_nodes()
        for node in list(self.cluster.worker_nodes):  # a drained node is on its way out
            if node.node_id in draining:
                self._drop(node)
        while len(self.cluster.worker_nodes) > n_nodes:
            self._drop(next(iter(self.cluster.worker_nodes)))
        while len(self.cluster.worker_nodes) < n_nodes:
            self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        self.nodes = list(self.cluster.worker_nodes)
        if self.pool is not None:  # a ping of each idle worker: the dead ones leave the books
            self.pool.take(self.pool.key, 0, 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [a for a in ray._private.state.actors().values()
                     if a.get("State") not in ("DEAD", 4)
                     and a.get("ActorClassName") not in RAY_DATA_ACTORS]
            free = ray.available_resources().get("CPU", 0.0)
            # nothing of the earlier job: no live actor but the pool's idle workers, each
            # holding its 1 CPU, and every other CPU free
            idle = set(self.pool.info()["idle_pids"]) if self.pool is not None else set()
            if ({a.get("Pid") for a in alive} == idle and len(alive) == len(idle)
                    and free + len(idle) == n_nodes == ray.cluster_resources().get("CPU", 0.0)):
                return True
            time.sleep(0.1)
        import sys

        print(f"ray_cluster: not reused: {len(alive)} live actor(s) "
              f"{sorted(a.get('ActorClassName') or '?' for a in alive)}, {len(idle)} idle in the pool, "
              f"{free} of {ray.cluster_resources().get('CPU', 0.0)} CPUs free, want {n_nodes}",
              file=sys.stderr)
        return False

    def _drop(self, node) -> None:
        """Remove ``node`` (SIGKILL, as a lost node), remembering its raylet: the agents it
        started outlive it, adopted by init (a node removed mid-test left its dashboard and
        runtime-env agents running after the suite), and ``shutdown`` ends them."""
        self._raylets.update(info.process.pid for info in node.all_processes.get("raylet", ()))
        self._node_ids.add(node.node_id)
        self.cluster.remove_node(node, allow_graceful=False)

    def node_of(self, node_id: str):
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(node_id)

    def remove(self, node_id: str) -> None:
        node = self.node_of(node_id)
        self._drop(node)
        self.nodes.remove(node)

    def shutdown(self) -> None:
        """Disconnect, then stop every node at once (SIGKILL, as a lost node): a graceful stop
        waits for each raylet in turn (14-18 s a cluster), and nothing of a test's cluster
        needs to outlive it."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        _shutdown()
        for node in list(self.cluster.worker_nodes):
            self._drop(node)
        if self.cluster.head_node is not None:
            try:
                self._drop(self.cluster.head_node)
            except ValueError:  # the driver was still attached (after a failed test):
                # cluster_utils disconnected it before refusing; the head can go now
                self._drop(self.cluster.head_node)
        self.cluster.shutdown()
        # every node went through ``_drop``
        _end_orphans(self._raylets, self._node_ids, self._session_dir)


def _end_orphans(raylets: set[int], node_ids: set[str] | frozenset[str] = frozenset(),
                 session_dir: str = "") -> None:
    """Kill what the killed raylets had started and left behind (their dashboard and
    runtime-env agents, adopted by init): an agent whose raylet died reports it to the GCS,
    which is gone too, and lingered ~2 min after the suite (seen here). Each is known by its
    raylet's pid in its environment or, for the dashboard agent, which has none there, by
    its node's id (one was left running 6 min after a whole ``.ci/run``), or by a file it
    holds open in the cluster's session directory (its logs): a runtime-env agent whose
    environment and command line read empty (Ray's setproctitle wrote over them) outlived a
    run of the chaos module alone."""
    import os
    import signal

    def holds_file_in_session(pid: str) -> bool:
        if not session_dir:
            return False
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            try:
                if os.readlink(f"{fds}/{fd}").startswith(session_dir + "/"):
                    return True
            except OSError:
                continue
        return False

    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if ppid != 1:
                continue
            ours = (int(env.get(b"RAY_RAYLET_PID", b"0")) in raylets
                    or env.get(b"RAY_NODE_ID", b"").decode() in node_ids
                    or holds_file_in_session(pid))
            if ours:
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # gone meanwhile, not ours, not Linux
            continue


@pytest.fixture(scope="module")
def _kept_cluster():
    """The cluster kept between one module's tests (``ray_cluster``). At the module's end it
    is kept on for the next module's ``ray_cluster`` (the chaos modules follow each other;
    a fresh head and nodes cost ~10 s) unless it holds a warm pool (its driver stays attached
    for it) or a ``ray_local`` test comes first (``_drop_session_kept``); the session's end
    shuts it down."""
    kept: list[ChaosCluster] = []
    yield kept
    for c in kept:
        if c.pool is None:
            _SESSION_KEPT.append(c)
        else:
            c.shutdown()


@pytest.fixture
def ray_cluster(request, _kept_cluster):
    made: list[ChaosCluster] = []

    warm = request.node.get_closest_marker("warm_workers") is not None

    def make(n_nodes: int) -> ChaosCluster:
        c = None
        if not _kept_cluster and _SESSION_KEPT and not made:
            _kept_cluster.append(_SESSION_KEPT.pop())  # the last module's
        if _kept_cluster and not made:
            c = _kept_cluster.pop()
            try:
                reused = c.reuse(n_nodes)
            except BaseException:
                c.shutdown()
                raise
            if not reused:
                c.shutdown()
                c = None
        if c is None:
            c = ChaosCluster(n_nodes)
        c.set_warm(warm)
        made.append(c)
        return c

    yield make
    _stop_left_jobs()
    report = getattr(request.node, "rep_call", None)
    passed = report is not None and report.passed
    for c in made[:-1]:
        c.shutdown()  # disconnects the driver: a warm pool of the last one went with it
    if made:
        if passed and (len(made) == 1 or made[-1].pool is None):
            if made[-1].pool is None:
                _shutdown()  # the driver leaves: its job's actors and reservations go with it
            _kept_cluster.append(made[-1])
        else:
            made[-1].shutdown()
