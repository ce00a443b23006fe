"""The store groundwork's costs, as ratios within one run (best of --repeat):

1. a prefix file of --tokens tokens x --layers layers (8 KV heads x 128,
   block 16, float32): load_file (read from the page cache, every checksum,
   key and link verified) and decode_file of bytes already in memory, each
   against `extend` of the same rows into pooled caches (what the load's copy
   into blocks will cost once the pool is wired); save_file against extend.
2. with --redis-port (a running redis-server on loopback): get_chain of a
   2048-token prefix of the hf bench model's geometry (2 layers, 8 x 128)
   against a raw redis-py pipelined GET of the same keys (bytes/s ratio).

    python benchmarks/store_groundwork.py --tokens 4096 --layers 8
    python benchmarks/store_groundwork.py --redis-port 6390
"""
import argparse
import os
import tempfile
import time

import numpy as np

from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.store import (Geometry, RedisPrefixStore, decode_file, entries_from_rows,
                             load_file, save_file)


def best(fn, repeat):
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def rows(n, layers, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal((n, 8, 128), np.float32) for _ in range(layers)],
            [rng.standard_normal((n, 8, 128), np.float32) for _ in range(layers)])


def files(args):
    n, layers = args.tokens, args.layers
    k, v = rows(n, layers)
    pool = KvBlockPool(16, 2 * layers * (n // 16 + 1), 8, 128)
    g = Geometry.of_pool(pool, layers)
    entries = entries_from_rows(g, np.arange(n), k, v, salt="s")

    def extend():
        caches = KvCache.with_pool_many(layers, 8, 128, pool, n)
        for c, a, b in zip(caches, k, v):
            c.extend(a, b)                     # the caches give their blocks back on return

    path = os.path.join(tempfile.mkdtemp(), "p.fxkv")
    t_save = best(lambda: save_file(path, g, "m", entries), args.repeat)
    data = open(path, "rb").read()
    t_load = best(lambda: load_file(path, geometry=g, fingerprint="m"), args.repeat)
    t_decode = best(lambda: decode_file(data, geometry=g, fingerprint="m"), args.repeat)
    t_ext = best(extend, args.repeat)
    mib = len(data) / 2**20
    print(f"file: {n} tokens x {layers} layers, {mib:.0f} MiB; extend {t_ext * 1e3:.1f} ms")
    print(f"  load_file / extend   {t_load / t_ext:.2f}x  ({mib / t_load:.0f} MiB/s)")
    print(f"  decode_file / extend {t_decode / t_ext:.2f}x  ({mib / t_decode:.0f} MiB/s)")
    print(f"  save_file / extend   {t_save / t_ext:.2f}x  (includes fsync)")
    os.unlink(path)


def remote(args):
    import redis
    client = redis.Redis(port=args.redis_port, socket_timeout=30)
    g = Geometry(16, 2, 8, 128, 128)
    n = 2048
    k, v = rows(n, 2, seed=1)
    tokens = np.arange(n)
    entries = entries_from_rows(g, tokens, k, v)
    store = RedisPrefixStore(client, namespace="bench", fingerprint="m")
    client.delete(*[store.key(g, e.key) for e in entries])
    store.put_chain(g, entries)
    keys = [store.key(g, e.key) for e in entries]

    def raw():
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return pipe.execute()

    nbytes = sum(len(x) for x in raw())
    assert len(store.get_chain(g, tokens)) == len(entries)
    t_store = best(lambda: store.get_chain(g, tokens), args.repeat)
    t_raw = best(raw, args.repeat)
    print(f"redis: 2048 tokens, 2 layers, {nbytes / 2**20:.0f} MiB in {len(keys)} values")
    print(f"  store get_chain {nbytes / t_store / 2**20:.0f} MiB/s, raw pipelined GET "
          f"{nbytes / t_raw / 2**20:.0f} MiB/s: store / raw bytes/s = {t_raw / t_store:.2f}x")
    client.delete(*keys)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis-port", type=int)
    a = ap.parse_args()
    if a.redis_port:
        remote(a)
    else:
        files(a)
