"""Group pool: taking and giving back blocks, from C and from Python, on one
and two threads."""
from ferrox_kv import KvBlockPool, KvCache, _core
from ferrox_kv.bench.common import BLOCK_SIZE, Group, log
from ferrox_kv.bench.harness import best_of, run_threads


def bench_pool(res, reps, iters):
    h, d = 8, 128
    pool = KvBlockPool(BLOCK_SIZE, 4096, h, d)
    g = "pool"

    def py_take_give(_):
        alloc, free = pool.allocate, pool.free
        for _ in range(iters):
            free(alloc(1))

    def cache_cycle(_):
        for _ in range(iters // 4):
            KvCache.with_pool(h, d, pool, BLOCK_SIZE).close()

    best = best_of([("c1", lambda: None, lambda _: _core._take_give_loop(pool, iters, 1)),
                    ("py", lambda: None, py_take_give),
                    ("cache", lambda: None, cache_cycle)], reps)
    c1 = best["c1"] / iters * 1e9
    res.add(g, "-", "pool.c_loop", "take+give 1 block, C loop, 1 thread", c1, "ns/block")
    two = min(run_threads(2, lambda i: _core._take_give_loop(pool, iters, 1))
              for _ in range(reps))
    res.add(g, "-", "pool.c_loop_2threads", "take+give 1 block, C loop, 2 threads",
            two / (2 * iters) * 1e9, "ns/block", (two / (2 * iters) * 1e9) / c1, "1 thread")
    res.add(g, "-", "pool.python", "allocate(1)+free from Python", best["py"] / iters * 1e9,
            "ns/block", best["py"] / best["c1"], "C loop")
    res.add(g, "-", "pool.cache_cycle", "with_pool + close (one block), Python",
            best["cache"] / (iters // 4) * 1e9, "ns/cache")
    py2 = min(run_threads(2, lambda i: py_take_give(None)) for _ in range(reps))
    res.add(g, "-", "pool.python_2threads", "allocate(1)+free, 2 Python threads",
            py2 / (2 * iters) * 1e9, "ns/block", py2 / 2 / best["py"], "1 thread")
    assert pool.free_blocks == pool.total_blocks


def run(r):
    log("pool")
    bench_pool(r.res, r.reps, 20_000 if r.quick else 200_000)


GROUP = Group("pool", "taking and giving back blocks", run)
