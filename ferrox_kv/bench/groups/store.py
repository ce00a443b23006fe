"""Group store: prefixes beyond one process. A prefix file loaded into a fresh
pool vs extend of the same rows; a read-through of a prefix from Redis
(fetch, verify, import) vs extend; what a miss costs with a store attached.
Redis rows need a ``redis-server`` binary and the ``[redis]`` extra (started
here on a free loopback port); without them they are skipped with one line."""
import os
import shutil
import socket
import subprocess
import tempfile
import time

from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import BLOCK_SIZE, Group, log
from ferrox_kv.bench.harness import best_of, rows
from ferrox_kv.bench.targets import Target

H, D = 8, 128                     # llama-8B KV geometry


def _published(layers, n_tok, seed):
    """A pool holding one published sequence of ``n_tok`` tokens over ``layers``
    caches, the token ids, and its (k, v) rows."""
    per = -(-n_tok // BLOCK_SIZE) + 1
    pool = KvBlockPool(BLOCK_SIZE, 2 * layers * per, H, D, prefix_cache=True)
    ks, vs = rows(n_tok, H * D, seed), rows(n_tok, H * D, seed + 1)
    toks = list(range(1000, 1000 + n_tok))
    caches = KvCache.with_pool_many(layers, H, D, pool, n_tok)
    for c in caches:
        c.extend(ks, vs)
    pool.publish(caches, toks)
    for c in caches:
        c.close()
    return pool, toks, ks, vs, per


def _extend(layers, n_tok, per, ks, vs):
    """setup/run of the baseline: extend ``n_tok`` rows into ``layers`` caches
    of a fresh pool."""
    def setup():
        return KvBlockPool(BLOCK_SIZE, 2 * layers * per, H, D, prefix_cache=True)

    def run(pool):
        got = KvCache.with_pool_many(layers, H, D, pool, n_tok + 1)
        for c in got:
            c.extend(ks, vs)
    return setup, run


def bench_file(res, quick, reps):
    layers, n_tok = (8, 1024) if quick else (32, 4096)
    pool, _, ks, vs, per = _published(layers, n_tok, 40)
    folder = tempfile.mkdtemp(prefix="ferrox_kv-bench-")
    path = os.path.join(folder, "prefixes.fxkv")
    try:
        pool.save_prefixes(path, fingerprint="bench")
        size = os.path.getsize(path)

        def fresh():
            return KvBlockPool(BLOCK_SIZE, 2 * layers * per, H, D, prefix_cache=True)

        def load(p):
            assert p.load_prefixes(path, fingerprint="bench")["entries"] == n_tok // BLOCK_SIZE
        setup, extend = _extend(layers, n_tok, per, ks, vs)
        best = best_of([("load", fresh, load), ("extend", setup, extend)], reps)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    res.add("store", "llama8b", "store.file_load", f"load_prefixes of {n_tok} tokens x "
            f"{layers} layers ({size >> 20} MiB, page cache)", best["load"] * 1e3, "ms",
            best["load"] / best["extend"], f"extend of the rows into {layers} layers",
            layers=layers, tokens=n_tok)


def _redis_server():
    """A redis-server on a free loopback port, or (None, why)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None, "no redis-server binary on PATH (apt-get install redis-server)"
    try:
        import redis
    except ModuleNotFoundError:
        return None, "the redis extra is not installed (pip install 'ferrox_kv[redis]')"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="ferrox_kv-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder,
                             "--save", "", "--appendonly", "no", "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            redis.Redis(port=port, socket_timeout=1).ping()
            return (proc, folder, f"redis://127.0.0.1:{port}/0"), None
        except redis.RedisError:
            time.sleep(0.02)
    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)
    return None, "redis-server did not start"


def bench_redis(res, quick, reps, url):
    from ferrox_kv.store import RedisPrefixStore

    shared = RedisPrefixStore(url, namespace="bench", fingerprint="bench", timeout=5)

    def store():                    # one client: its connection is made once, untimed
        return shared

    # 1. a remote hit: fetch + verify + import of a prefix vs extend of its rows
    layers, n_tok = (2, 1024) if quick else (2, 2048)
    pool, toks, ks, vs, per = _published(layers, n_tok, 50)
    pool.attach(store())
    hold = KvCache.with_pool_many(layers, H, D, pool, n_tok, tokens=toks + [0])
    pool.publish(hold, toks)                # a full local hit: written through to Redis
    for c in hold:
        c.close()

    def fresh():
        p = KvBlockPool(BLOCK_SIZE, 2 * layers * per, H, D, prefix_cache=True)
        p.attach(store())
        return p

    def hit(p):
        got = KvCache.with_pool_many(layers, H, D, p, n_tok + 1, tokens=toks + [0])
        assert got[0].seq_len == n_tok
    setup, extend = _extend(layers, n_tok, per, ks, vs)
    best = best_of([("hit", fresh, hit), ("extend", setup, extend)], reps)
    res.add("store", "hf-2x8x128", "store.redis_hit", f"read-through of {n_tok} tokens x "
            f"{layers} layers from Redis (fetch, verify, import)", best["hit"] * 1e3, "ms",
            best["hit"] / best["extend"], f"extend of the rows into {layers} layers",
            layers=layers, tokens=n_tok)

    # 2. a miss: a 512-token lookup with the store attached vs without
    n_miss, layers = 512, 8
    seeds = iter(range(10**6))

    def lookup(p):
        base = 10**6 * (next(seeds) + 1)
        got = KvCache.with_pool_many(layers, H, D, p, n_miss + 1,
                                     tokens=list(range(base, base + n_miss + 1)))
        for c in got:
            c.close()

    def with_store():
        p = KvBlockPool(BLOCK_SIZE, layers * (n_miss // BLOCK_SIZE + 2), H, D, prefix_cache=True)
        p.attach(store())
        return p

    def without():
        return KvBlockPool(BLOCK_SIZE, layers * (n_miss // BLOCK_SIZE + 2), H, D,
                           prefix_cache=True)
    best = best_of([("store", with_store, lookup), ("plain", without, lookup)], reps)
    res.add("store", "8x128", "store.miss_cost", f"a {n_miss}-token lookup that misses, "
            f"{layers} layers, store attached", best["store"] * 1e6, "us",
            best["store"] / best["plain"], "no store", better="lower", tokens=n_miss)


def run(r):
    log("store: prefix files, a Redis store")
    try:
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        log("store: skipped: ferrox_kv.store needs pip install 'ferrox_kv[store]'")
        return
    bench_file(r.res, r.quick, r.reps)
    server, why = _redis_server()
    if server is None:
        log(f"store: Redis rows skipped: {why}")
        return
    proc, folder, url = server
    try:
        bench_redis(r.res, r.quick, r.reps, url)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


TARGETS = [
    Target("load of a saved prefix file vs extend of the same rows", "store.file_load",
           "<=", 1.5),
    Target("a remote hit (Redis fetch + verify + import) vs extend of the rows",
           "store.redis_hit", "info", None),
    Target("a 512-token miss with a store attached vs no store", "store.miss_cost",
           "info", None),
]

GROUP = Group("store", "prefix files and a shared Redis store", run,
              targets=lambda res: TARGETS)
