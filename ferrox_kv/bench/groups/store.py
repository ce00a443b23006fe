"""Group store: prefixes beyond one process. A prefix file loaded into a fresh
pool vs extend of the same rows; a read-through of a prefix from Redis
(fetch, verify, import) vs extend, and vs the hf bench model's prefill of the
same tokens; the store's fetch rate vs a raw pipelined GET loop; what a miss
costs with a store attached; the time to first token of
``examples/threaded_generate.py`` run as two processes sharing one Redis.
Redis rows need a ``redis-server`` binary and the ``[redis]`` extra (started
here on a free loopback port); without them they are skipped with one line."""
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import (BLOCK_SIZE, HF_INSTALL, REDIS_INSTALL, STORE_INSTALL, Group,
                                    Torch1, log, try_import)
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
        return None, f"the redis extra is not installed ({REDIS_INSTALL})"
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


def bench_hf(res, quick, reps, url):
    """A remote hit of a prefix for the hf bench model (``FerroxCache(...,
    tokens=)`` on a fresh pool: fetch, verify, import) vs that model's
    prefill of the same tokens into a FerroxCache; and the store's fetch of
    those values vs a raw redis-py pipelined GET of the same keys."""
    import redis
    import torch

    from ferrox_kv.bench.llama import make_model
    from ferrox_kv.hf import FerroxCache, kv_geometry
    from ferrox_kv.store import Geometry, RedisPrefixStore, chain_keys

    n_tok = 512 if quick else 2048
    cfg, model = make_model(n_tok + 1)
    layers, n_kv, hd = kv_geometry(cfg)
    ids = torch.randint(1, cfg.vocab_size, (1, n_tok + 1),
                        generator=torch.Generator().manual_seed(7))
    total = layers * (-(-(n_tok + 1) // BLOCK_SIZE) + 1)
    store = RedisPrefixStore(url, namespace="bench-hf", fingerprint="bench-llama",
                             timeout=5)

    def fresh(attached):
        def setup():
            p = KvBlockPool(BLOCK_SIZE, total, n_kv, hd, prefix_cache=True)
            if attached:
                p.attach(store)
            return p
        return setup

    def prefill(p):
        cache = FerroxCache(cfg, pool=p, max_seq_len=n_tok + 1)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")          # sdpa gathers the pool's rows: said once
            model(input_ids=ids[:, :n_tok], cache=cache, use_cache=True)
        return cache

    def hit(p):
        cache = FerroxCache(cfg, pool=p, max_seq_len=n_tok + 1, tokens=ids[0])
        assert cache.get_seq_length() == n_tok, cache.get_seq_length()
        cache.close()

    with Torch1():
        writer = fresh(True)()
        cache = prefill(writer)                   # published: written through to Redis
        assert cache.publish(ids[0, :n_tok]) == n_tok
        cache.close()
        assert store.stats()["entries_written"] == n_tok // BLOCK_SIZE
        best = best_of([("hit", fresh(True), hit),
                        ("prefill", fresh(False), lambda p: prefill(p).close())], reps)
    res.add("store", "hf-2x8x128", "store.redis_hit_vs_prefill",
            f"remote hit of {n_tok} tokens for the hf bench model ({layers} layers, "
            f"FerroxCache(tokens=) on a fresh pool)", best["hit"] * 1e3, "ms",
            best["hit"] / best["prefill"], f"the model's prefill of the {n_tok} tokens",
            layers=layers, tokens=n_tok)

    # the same values, fetched by the store (verified) vs by a raw pipelined GET loop
    g = Geometry.of_pool(writer, layers)
    keys = [store.key(g, k) for k in chain_keys(ids[0, :n_tok].numpy(), BLOCK_SIZE)]
    raw = redis.Redis.from_url(url, socket_timeout=5)
    got = {}

    def by_store(_):
        got["store"] = store.stats()["bytes_fetched"]
        assert len(store.get_chain(g, ids[0, :n_tok].numpy())) == len(keys)
        got["store"] = store.stats()["bytes_fetched"] - got["store"]

    def by_get(_):
        pipe = raw.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        got["raw"] = sum(len(v) for v in pipe.execute())
    best = best_of([("store", lambda: None, by_store), ("raw", lambda: None, by_get)], reps)
    raw.close()
    assert got["store"] == got["raw"], got
    rate = got["store"] / best["store"]
    res.add("store", "hf-2x8x128", "store.fetch_rate",
            f"bytes/s fetched by get_chain ({len(keys)} values of {got['raw'] // len(keys)} "
            "bytes, verified)", rate / 2**20, "MiB/s", rate / (got["raw"] / best["raw"]),
            "a raw redis-py pipelined GET of the same keys", better="higher", tokens=n_tok)
    store.close()


def _example():
    """examples/threaded_generate.py of a source checkout (the package's
    parent, or the working directory), or None."""
    import ferrox_kv
    here = os.path.dirname(os.path.dirname(os.path.abspath(ferrox_kv.__file__)))
    for root in (here, os.getcwd()):
        path = os.path.join(root, "examples", "threaded_generate.py")
        if os.path.isfile(path):
            return path
    return None


FIRST = re.compile(r"first request: time to first token ([0-9.]+) ms, (\d+) prompt positions")


def bench_ttft(res, quick, reps, url):
    """examples/threaded_generate.py --redis URL as two processes, one after
    the other, on an emptied Redis: the first request's time to first token
    (its prefix-cache run) in the second process vs the first. Best of
    ``reps`` pairs (one in a quick run: each process loads torch and the
    model, some seconds)."""
    import redis
    path = _example()
    if path is None:
        log("store: the two-process row skipped: no examples/threaded_generate.py here "
            "(run the bench from a source checkout)")
        return
    cmd = [sys.executable, path, "--threads", "2", "--new-tokens", "4", "--redis", url]
    best = {"first": float("inf"), "second": float("inf")}
    reused = {}
    client = redis.Redis.from_url(url, socket_timeout=5)
    pairs = 1 if quick else max(1, min(reps, 3))
    for pair in range(pairs):
        client.flushdb()
        for name in ("first", "second"):
            log(f"store: two processes, pair {pair + 1} of {pairs}: the {name}")
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise RuntimeError(f"{path} failed: {out.stderr[-2000:]}")
            ms, n = FIRST.findall(out.stdout)[-1]          # the prefix-cache run's
            best[name] = min(best[name], float(ms))
            reused[name] = int(n)
    client.close()
    res.add("store", "tiny-4L", "store.ttft_two_processes",
            f"first request's time to first token, second process (reused "
            f"{reused['second']} positions from Redis)", best["second"], "ms",
            best["second"] / best["first"], f"the first process (reused {reused['first']})",
            better="lower")


def run(r):
    log("store: prefix files, a Redis store")
    try:
        import xxhash  # noqa: F401
    except ModuleNotFoundError:
        log(f"store: skipped: ferrox_kv.store needs xxhash: {STORE_INSTALL}")
        return
    log("store: a prefix file loaded vs extend")
    bench_file(r.res, r.quick, r.reps)
    server, why = _redis_server()
    if server is None:
        log(f"store: Redis rows skipped: {why}")
        return
    proc, folder, url = server
    try:
        log("store: a Redis hit and a miss vs extend")
        bench_redis(r.res, r.quick, r.reps, url)
        if r.hf_ok:
            log("store: a Redis hit vs the hf model's prefill; the fetch rate")
            bench_hf(r.res, r.quick, r.reps, url)
            log("store: time to first token of two processes sharing one Redis")
            bench_ttft(r.res, r.quick, r.reps, url)
        else:
            log(f"store: the hf model's rows skipped: {HF_INSTALL}")
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
    Target("a remote hit of a 2048-token prefix vs the hf bench model's prefill of it",
           "store.redis_hit_vs_prefill", "<=", 0.05),
    Target("bytes/s fetched by the store vs a raw pipelined GET loop of the same values",
           "store.fetch_rate", ">=", 0.7),
    Target("time to first token of threaded_generate.py, second process vs first (one Redis)",
           "store.ttft_two_processes", "info", None),
]

def missing():
    """What of the group this environment skips, and how to get it."""
    if try_import("xxhash") is None:
        return f"the store group (ferrox_kv.store needs xxhash: {STORE_INSTALL})"
    if try_import("redis") is None:
        return f"the store group's Redis rows ({REDIS_INSTALL})"
    if shutil.which("redis-server") is None:
        return ("the store group's Redis rows (no redis-server binary on PATH: "
                "apt-get install redis-server)")
    return None


GROUP = Group("store", "prefix files and a shared Redis store", run,
              targets=lambda res: TARGETS, missing=missing,
              hf_rows="the store group's hf-model rows (remote hit vs prefill, the store's "
                      "fetch rate, two processes' time to first token)")
