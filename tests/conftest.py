"""Shared fixtures. Fixture modules live beside this file and are pulled in here."""

import os
import shutil
import tempfile

import pytest

pytest_plugins = [m for m in ("tests.s3_server", "tests.ray_fixtures") if os.path.exists(
    os.path.join(os.path.dirname(__file__), m.split(".")[1] + ".py"))]


_LAYERS = ("unit", "integration", "chaos")
_MADE: list[str] = []  # the temporary folders this run made (removed at its end)


def _mkdtemp(prefix: str, parent: str = "/tmp") -> str:
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    _MADE.append(path)
    return path


def pytest_collection_finish(session):
    """mypy (``tests/integration/test_lint.py``) starts now, beside the tests before it."""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(it.nodeid.endswith("test_lint.py::test_clean[mypy]") for it in session.items):
        from tests.integration.test_lint import start_early

        start_early()


def pytest_sessionfinish(session, exitstatus):
    """Runs after the session's fixtures are torn down (every Ray instance and server is
    stopped by then): the run's Ray and cache folders go with it, and a mypy started early
    that no test collected."""
    import sys

    lint = sys.modules.get("tests.integration.test_lint")
    if lint is not None:
        lint.stop_early()
    for path in _MADE:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Each test carries its layer's marker (its folder): `pytest -m unit` runs the unit layer.
    In each layer, the modules whose tests make multi-node clusters (``ray_cluster``) run
    after the others: a cluster shuts the local Ray instance down, and starting it again
    with its warm pool cost ~8 s. In each module, the ``warm_workers`` tests run first (in
    their order), so the warm pool their cluster keeps is not closed by a cold test between
    them (``tests/ray_fixtures.py``)."""
    for item in items:
        layer = os.path.basename(os.path.dirname(str(item.fspath)))
        if layer in _LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
    first: dict[str, int] = {}
    layer_of: dict[str, int] = {}
    clusters: set[str] = set()
    for i, item in enumerate(items):
        path = str(item.fspath)
        first.setdefault(path, i)
        layer_of.setdefault(os.path.dirname(path), i)
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            clusters.add(path)
    items[:] = sorted(items, key=lambda it: (
        layer_of[os.path.dirname(str(it.fspath))], str(it.fspath) in clusters,
        first[str(it.fspath)], it.get_closest_marker("warm_workers") is None))


# The tests that start no Ray (the unit layer, process groups, lint). With pytest-xdist,
# `pytest -n 2 --dist loadgroup` runs them in one stream beside a second that runs every
# other test in order, one Ray instance at a time (README: what it gains, why it is not the
# default). A file missing here only runs in the Ray stream.
NO_RAY = ("tests/unit/", "tests/chaos/test_leave.py", "tests/integration/test_checkpoint.py",
          "tests/integration/test_checkpoint_safety.py", "tests/integration/test_lint.py",
          "tests/integration/test_peer_copies.py", "tests/integration/test_strategies.py",
          "tests/integration/test_strategies_buckets.py",
          "tests/integration/test_strategies_gpu.py",
          "tests/integration/test_strategies_nonfinite.py")


def _no_ray(nodeid: str) -> bool:
    return nodeid.startswith(NO_RAY)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: two groups, the tests of ``NO_RAY`` and the others, each run in
    order by one worker. (xdist's own loadgroup reads ``xdist_group`` marks through a node id
    that pytest 9 no longer lets it change.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TwoStreams(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "noray" if _no_ray(nodeid) else "ray"

    return TwoStreams(config, log)


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item):
    """Under ``-n 2 --dist loadgroup`` a ``NO_RAY`` test runs beside the Ray tests, in a
    worker of its own: it must not start Ray. (In one stream the Ray tests before it leave
    the shared local instance up.)"""
    import sys

    if not getattr(item.config.option, "loadgroup", False):
        return
    ray = sys.modules.get("ray")
    if _no_ray(item.nodeid) and ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail(f"{item.nodeid} is listed in conftest.NO_RAY but started Ray")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on its test (``item.rep_call``): a fixture's teardown can tell
    whether the test passed (``ray_cluster`` keeps only a passing test's cluster)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture(autouse=True, scope="session")
def _private_ray_tmpdir():
    """Each test run gets its own RAY_TMPDIR so it never attaches to someone else's cluster."""
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = _mkdtemp("ray-elastic-")
    elif os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n: one per worker process
        os.environ["RAY_TMPDIR"] = _mkdtemp("w", os.environ["RAY_TMPDIR"])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's own metrics exporter: a driver's ray.shutdown() waited 20-27 s on it after a test's
    # cluster lost nodes (it retries a dead metrics agent); nothing here reads Ray's metrics
    os.environ.setdefault("RAY_enable_metrics_collection", "0")
    # no Ray worker process imports torch before it takes an actor, as on a cluster the user
    # started (elastic.ray_connect preloads torch only on the local clusters it starts itself).
    # With the preload, every process paid ~1.7-3 s of CPU for it, also each job's mailbox
    # actor, Ray's job supervisors and workers never used: a quarter of the suite's CPU (1520
    # -> 1154 CPU-s, 16.2 -> 14.6 min on 2 cores, session 14); the tests' warm pools keep
    # their workers' start fast without it
    os.environ.setdefault("RAY_preload_python_modules", "")
    # measured speeds are cached per machine; tests start from an empty cache
    os.environ["ELASTIC_CACHE_DIR"] = _mkdtemp("elastic-cache-")
    yield
