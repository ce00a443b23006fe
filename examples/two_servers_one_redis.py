"""Two server processes share a system prompt's K/V through one Redis.

    python examples/two_servers_one_redis.py [redis://127.0.0.1:6379/0]
    python examples/two_servers_one_redis.py --help

Each process has its own pool with a RedisPrefixStore attached. The first
prefills the system prompt plus its user's question and publishes it
(written through to Redis); the second, a different process with an empty
pool, gets the same system prompt with another question: its lookup reads the
system prompt's blocks through Redis (verified: fingerprint, geometry, salt,
token ids, checksum) and it prefills only its own tail. Without a reachable
Redis the second process simply prefills everything (a counted miss).
Needs ``pip install '.[redis]'``.
"""
import multiprocessing as mp
import sys

import numpy as np

BLOCK, HEADS, DIM, LAYERS = 16, 2, 64, 4
SYSTEM = list(range(1000, 1000 + 96))            # a 96-token system prompt


def serve(url, question, seed, out):
    from ferrox_kv import KvBlockPool, KvCache
    from ferrox_kv.store import RedisPrefixStore

    pool = KvBlockPool(BLOCK, 256, HEADS, DIM, prefix_cache=True)
    pool.attach(RedisPrefixStore(url, namespace="example", fingerprint="tiny-model@1",
                                 timeout=0.5))
    tokens = SYSTEM + question
    layers = KvCache.with_pool_many(LAYERS, HEADS, DIM, pool, len(tokens) + 16,
                                    tokens=tokens, salt="tenant-a")
    reused = layers[0].seq_len
    rng = np.random.default_rng(seed)            # stands in for the model's prefill
    todo = len(tokens) - reused
    for c in layers:
        c.extend(rng.standard_normal((todo, HEADS, DIM), np.float32),
                 rng.standard_normal((todo, HEADS, DIM), np.float32))
    pool.publish(layers, tokens, salt="tenant-a")
    s = pool.stats()
    out.put((reused, todo, s["store_hits"], s["store_entries_written"], s["store_errors"]))
    for c in layers:
        c.close()
    pool.check()


def main(url):
    import queue
    ctx = mp.get_context("spawn")
    for name, question, seed in (("first", [1, 2, 3, 4, 5], 1), ("second", [7, 8, 9], 2)):
        out = ctx.Queue()
        p = ctx.Process(target=serve, args=(url, question, seed, out))
        p.start()
        while True:                 # a child that fails says so at once, not after a timeout
            try:
                reused, todo, hits, written, errors = out.get(timeout=0.2)
                break
            except queue.Empty:
                if not p.is_alive():
                    p.join()
                    return f"the {name} server failed (exit status {p.exitcode}); see above"
        p.join()
        print(f"{name} server: reused {reused} positions, prefilled {todo}; "
              f"store hits {hits}, entries written {written}, errors {errors}")
    return 0


def parse(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " (see the module "
                                 "docstring).")
    ap.add_argument("url", nargs="?", default="redis://127.0.0.1:6379/0",
                    help="the Redis URL (default redis://127.0.0.1:6379/0)")
    args = ap.parse_args(argv)
    if not args.url.startswith(("redis://", "rediss://", "unix://")):
        ap.error(f"not a Redis URL: {args.url!r} (redis://host:port/db)")
    return args


if __name__ == "__main__":
    sys.exit(main(parse().url))
