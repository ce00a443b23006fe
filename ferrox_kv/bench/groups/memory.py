"""Group memory: what a pool costs in resident memory, and what a cache
reports as allocated."""
from ferrox_kv import KvBlockPool, KvCache
from ferrox_kv.bench.common import BLOCK_SIZE, GEOMETRIES, Group, log
from ferrox_kv.bench.harness import rss


def bench_memory(res, geo):
    h, d, layers = GEOMETRIES[geo]
    g = "memory"
    total = 8192
    rss0 = rss()
    pool = KvBlockPool(BLOCK_SIZE, total, h, d)
    arena = pool.total_blocks * pool.block_bytes
    rss1 = rss()
    caches = [KvCache.with_pool(h, d, pool, 1000) for _ in range(layers)]
    for c in caches:
        c.advance_len(1000)
    used = sum(c.blocks_held for c in caches) * pool.block_bytes
    rss2 = rss()
    res.add(g, geo, "memory.arena", "pool arena (K+V) reserved", arena / 2**20, "MiB")
    if rss0 is not None:
        res.add(g, geo, "memory.resident_new_pool", "resident after creating the pool",
                (rss1 - rss0) / 2**20, "MiB", (rss1 - rss0) / arena, "arena")
        res.add(g, geo, "memory.resident_vs_used", f"resident after {layers} layers x 1000 pos",
                (rss2 - rss0) / 2**20, "MiB", (rss2 - rss0) / used, "blocks used")
    c = caches[0]
    row_bytes = 2 * h * d * 4
    res.add(g, geo, "memory.pooled_allocated", "allocated_bytes, 1000-pos pooled cache",
            c.allocated_bytes(), "B", c.allocated_bytes() / (1000 * row_bytes), "bytes stored")
    grow = KvCache(h, d)
    grow.advance_len(1000)
    res.add(g, geo, "memory.growable_allocated", "allocated_bytes, 1000-pos growable cache",
            grow.allocated_bytes(), "B", grow.allocated_bytes() / (1000 * row_bytes),
            "bytes stored")
    for c in caches:
        c.close()


def run(r):
    log("memory")
    bench_memory(r.res, r.geos[0])


GROUP = Group("memory", "what a pool costs in resident memory", run)
