import numpy as np
import pytest

import ferrox_kv


def pytest_report_header(config):
    return f"ferrox_kv {ferrox_kv.__version__} from {ferrox_kv.__file__}"


def rows(n, width, seed=0, scale=1.0):
    """Deterministic, distinct float32 rows (never zeros)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, width)) * scale + 0.5).astype(np.float32)


class ArrayHook:
    """An array-like whose conversion runs ``effect`` first (hostile-input
    tests: conversion is user code that may close caches or empty lists)."""

    def __init__(self, value, effect):
        self.value, self.effect = value, effect

    def __array__(self, dtype=None, copy=None):
        self.effect()
        return np.asarray(self.value, dtype=dtype)


@pytest.fixture
def make_rows():
    return rows


def pytest_configure(config):
    # CI runs the suite against the installed package, never the source tree.
    import os
    if os.environ.get("FERROX_KV_REQUIRE_INSTALLED") == "1":
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        src = os.path.join(here, "ferrox_kv")
        if os.path.dirname(os.path.abspath(ferrox_kv.__file__)) == src:
            raise RuntimeError(f"tests imported ferrox_kv from the source tree ({src})")


# -- reduced-precision storage: what a cache of each dtype stores --------------

DTYPES = ("float32", "float16", "bfloat16", "int8")
REDUCED = ("float16", "bfloat16", "int8")


def bf16_round(x):
    """float32 -> bfloat16 (as float32 values): round to nearest even on the
    top 16 bits; NaN stays NaN (quiet)."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
    nan = np.isnan(x)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint32)
    return (r << 16).astype(np.uint32).view(np.float32).reshape(x.shape)


def q8_round(x, head_dim):
    """The int8 storage contract over rows of float32 values (last axis:
    heads of ``head_dim``): groups of 32 dims per head, scale amax/127 as
    float16 (rounded up when rounding down would push |x|/s past 127),
    q = clamp(rint(x/s), -127, 127), dequantised q * s. Returns
    (dequantised float32 values, int8 values, float16 scales)."""
    x = np.ascontiguousarray(x, np.float32)
    lead, w = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, w // head_dim, head_dim)
    n_groups = -(-head_dim // 32)
    q = np.zeros(rows.shape, np.int8)
    scales = np.zeros(rows.shape[:2] + (n_groups,), np.float16)
    out = np.zeros(rows.shape, np.float32)
    with np.errstate(all="ignore"):
        for j in range(n_groups):
            g = rows[:, :, j * 32:(j + 1) * 32]
            a = np.abs(g)
            amax = np.where(np.isnan(a).any(-1), np.float32(np.nan), np.nanmax(a, -1, initial=0))
            amax = amax.astype(np.float32)
            s = (amax / np.float32(127)).astype(np.float16)
            s = np.where(np.isfinite(amax) & (amax != 0)
                         & (amax / s.astype(np.float32) > np.float32(127)),
                         np.nextafter(s, np.float16(np.inf)), s)
            sf = s.astype(np.float32)[..., None]
            v = np.where((sf != 0) & ~np.isnan(sf), np.rint(g / sf), 0)
            v = np.clip(np.nan_to_num(v, nan=0.0), -127, 127).astype(np.int8)
            q[:, :, j * 32:(j + 1) * 32] = v
            scales[:, :, j] = s
            out[:, :, j * 32:(j + 1) * 32] = v.astype(np.float32) * sf
    return (out.reshape(x.shape), q.reshape(x.shape),
            scales.reshape(lead + ((w // head_dim) * n_groups,)))


def stored(x, dtype, head_dim):
    """The float32 values a cache of ``dtype`` gives back for float32 input
    ``x`` (last axis: heads of ``head_dim``, flat)."""
    x = np.asarray(x, np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_round(x)
    return q8_round(x, head_dim)[0]


def values(a):
    """A cache's .k / .v as float32 (float16 views widened)."""
    return np.asarray(a, np.float32)


# -- prefix entries beyond one process (ferrox_kv.store) ----------------------

STORE_FP = "model@1"
STORE_HEADS, STORE_DIM = 2, 32      # int8 rows: one scale group per head


def store_pool(total=64, dtype="float32", block_size=4, **kw):
    """A prefix-cache pool of the store tests' geometry."""
    return ferrox_kv.KvBlockPool(block_size, total, STORE_HEADS, STORE_DIM, prefix_cache=True,
                                 dtype=dtype, **kw)


def publish_seq(pool, tokens, n_layers=2, salt=None, seed=0, release=True):
    """Prefill ``n_layers`` caches of ``pool`` with rows made from ``seed`` for
    ``tokens`` and publish them; returns the stored rows of the published
    positions per layer ([(k, v)] as bytes), and the caches unless released."""
    tokens = np.asarray(tokens, np.int32)
    caches = ferrox_kv.KvCache.with_pool_many(n_layers, STORE_HEADS, STORE_DIM, pool,
                                              len(tokens))
    w = STORE_HEADS * STORE_DIM
    for j, c in enumerate(caches):
        c.extend(rows(len(tokens), w, seed * 100 + 2 * j), rows(len(tokens), w, seed * 100 + 2 * j + 1))
    done = pool.publish(caches, tokens, salt=salt)
    out = [tuple(a[:done] for a in c._stored()) for c in caches]
    if release:
        for c in caches:
            c.close()
        return out
    return out, caches


def pool_counts(pool):
    """What a refused load must leave exactly as it was."""
    s = pool.stats()
    return {k: s[k] for k in ("free_blocks", "used_blocks", "cached_blocks", "acquired",
                              "released", "prefix_hits", "prefix_misses", "evictions")}


def lookup_rows(pool, tokens, n_layers=2, salt=None):
    """The stored rows a fresh lookup of ``tokens`` starts with (and how many)."""
    caches = ferrox_kv.KvCache.with_pool_many(n_layers, STORE_HEADS, STORE_DIM, pool,
                                              len(tokens), tokens=tokens, salt=salt)
    try:
        return caches[0].seq_len, [c._stored() for c in caches]
    finally:
        for c in caches:
            c.close()


def require_store():
    """ferrox_kv.store needs xxhash: a store test module is skipped without
    it, except in CI (CI=true), where the missing extra fails it."""
    import os
    if os.environ.get("CI") == "true":
        import xxhash  # noqa: F401  (CI installs the [redis] extra, which brings it)
    else:
        pytest.importorskip("xxhash", reason="ferrox_kv.store needs pip install '.[store]'")


# -- a real redis-server for the store tests (Debian's package) --------------------

def _redis_missing():
    """Why the Redis tests cannot run here, or None."""
    import shutil
    if shutil.which("redis-server") is None:
        return "no redis-server binary on PATH (apt-get install redis-server)"
    try:
        import redis  # noqa: F401
        import xxhash  # noqa: F401
    except ModuleNotFoundError as e:
        return f"the redis extra is not installed ({e.name}): pip install '.[redis]'"
    return None


def require_redis():
    """The redis module, for a test module that needs a redis-server; the
    module is skipped with the reason where there is none, except in CI
    (CI=true), where that fails it."""
    import os
    why = _redis_missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"CI must run the Redis tests, but {why}")
        pytest.skip(why, allow_module_level=True)
    import redis
    return redis


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_port_with_bus():
    """A free port whose cluster bus port (port + 10000) is free too."""
    import random
    import socket
    for _ in range(200):
        port = random.randint(20000, 29999)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One redis-server on 127.0.0.1, no persistence, DEBUG allowed (for
    DEBUG SLEEP); stopped with SIGTERM (then SIGKILL)."""

    # what this server runs with beyond the port, the folder and no persistence
    extra = ("--enable-debug-command", "yes")

    def __init__(self, folder, port=None):
        import os
        self.folder, self.port, self.proc = str(folder), port, None
        # the environment of the server: not the suite's ASan preload
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("LD_PRELOAD", "ASAN_OPTIONS")}

    def _port(self):
        return self.port or _free_port()

    def start(self):
        import os
        import shutil
        import subprocess
        import time

        import redis
        for _ in range(20):
            port = self._port()
            self.proc = subprocess.Popen(
                [shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                 "--dir", self.folder, "--save", "", "--appendonly", "no", *self.extra,
                 "--daemonize", "no", "--logfile", os.path.join(self.folder, "redis.log")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    redis.Redis(port=port, socket_timeout=1).ping()
                    self.port = port
                    return self
                except redis.RedisError:
                    time.sleep(0.02)
            self.stop()
            if self.port:                           # a fixed port: no other to try
                break
        raise RuntimeError(f"redis-server did not start (see {self.folder}/redis.log)")

    def stop(self):
        import subprocess
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kw):
        import redis
        return redis.Redis(port=self.port, socket_timeout=10, **kw)


class ClusterNode(RedisServer):
    extra = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf")

    def _port(self):
        return _free_port_with_bus()


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
    """A three-node Redis Cluster on loopback (no replicas), made with
    redis-cli --cluster create."""
    import os
    import shutil
    import subprocess
    import time

    import redis
    cli = shutil.which("redis-cli")
    if cli is None:
        if os.environ.get("CI") == "true":
            raise RuntimeError("CI must run the cluster test, but redis-cli is missing "
                               "(Debian's redis-tools, which redis-server depends on)")
        pytest.skip("no redis-cli binary (apt-get install redis-tools)")
    nodes = []
    try:
        for i in range(3):
            folder = tmp_path / f"node{i}"
            folder.mkdir()
            nodes.append(ClusterNode(folder).start())
        out = subprocess.run([cli, "--cluster", "create",
                              *[f"127.0.0.1:{n.port}" for n in nodes],
                              "--cluster-replicas", "0", "--cluster-yes"],
                             capture_output=True, text=True, timeout=60, env=nodes[0].env)
        assert out.returncode == 0, out.stdout + out.stderr
        # every node must see the whole cluster (all slots, three nodes), not
        # only the one that ran the create: a client that asks another one
        # too early is told CLUSTERDOWN
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [redis.Redis(port=n.port).execute_command("CLUSTER", "INFO") for n in nodes]
            if all(b"cluster_state:ok" in i and b"cluster_known_nodes:3" in i
                   and b"cluster_slots_ok:16384" in i for i in infos):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the cluster did not reach cluster_state:ok on every node")
        yield nodes
    finally:
        for n in nodes:
            n.stop()


def run_threads(n, work, timeout=120):
    """Run ``work(i)`` on ``n`` threads started together; returns what they
    raised (a list, empty when every one finished cleanly)."""
    import threading
    errors = []
    barrier = threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as e:      # pragma: no cover - reported by the caller
            errors.append(e)
    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors
