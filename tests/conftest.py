"""The suite's fixtures. The helpers the tests share are modules of
``tests/support/`` (see its ``__init__``), importable as ``support.X``: this
file puts ``tests/`` on ``sys.path`` (``tests/`` is not a package, and the
tests import the installed ``ferrox_kv``, never the source tree)."""
import gc
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

import ferrox_kv  # noqa: E402
from support.numerics import rows  # noqa: E402
from support.redis_server import RedisServer, cluster as start_cluster  # noqa: E402


def pytest_report_header(config):
    return f"ferrox_kv {ferrox_kv.__version__} from {ferrox_kv.__file__}"


def pytest_configure(config):
    # CI runs the suite against the installed package, never the source tree.
    if os.environ.get("FERROX_KV_REQUIRE_INSTALLED") == "1":
        src = os.path.join(os.path.dirname(TESTS), "ferrox_kv")
        if os.path.dirname(os.path.abspath(ferrox_kv.__file__)) == src:
            raise RuntimeError(f"tests imported ferrox_kv from the source tree ({src})")


def pytest_collection_modifyitems(session, config, items):
    """Tests marked ``long`` (tens of seconds each) run first, so that xdist
    hands them out while the short ones still fill the other workers,
    instead of one of them running alone at the end. (Their modules'
    fixtures are then made twice on a worker: seconds, against minutes.)"""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(autouse=True)
def pool_on_the_main_thread():
    """The tests' split calls run on ferrox_kv's worker pool from every
    thread. Once torch is imported, the main thread's would run on torch's
    OpenMP team instead; tests/test_openmp_route.py turns that back on
    (``main_routes``) where it tests it."""
    from ferrox_kv import _core
    old = _core._set_route_main(False)
    yield
    _core._set_route_main(old)


@pytest.fixture
def make_rows():
    return rows


@pytest.fixture
def young_gc():
    """``gc.collect()`` in the test scans only what the test made: what
    existed before it (torch, transformers, earlier tests' objects) is
    frozen (``gc.freeze``) until the test ends, after one full collection.
    Cyclic garbage the test makes is collected exactly as before; a cycle
    through an older object waits for a collection after the test. For
    tests that collect after every step (fuzz programs, state machines),
    where a full collection of a process holding torch costs 0.1 s."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


# -- a real redis-server for the store tests (support.redis_server) -------------

@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def server(shared_server):
    """The module's redis-server, emptied for this test."""
    shared_server.client().flushall()
    return shared_server


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, which the test may stop and restart."""
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


@pytest.fixture
def cluster(tmp_path):
    """A three-node Redis Cluster on loopback (no replicas)."""
    with start_cluster(tmp_path) as nodes:
        yield nodes
