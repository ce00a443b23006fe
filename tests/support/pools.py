"""Prefix entries beyond one process (``ferrox_kv.store``): pools of the
store tests' geometry, published sequences, and the counts a refused load
must leave exactly as they were."""
import os

import numpy as np
import pytest

import ferrox_kv
from support.numerics import rows

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
    if os.environ.get("CI") == "true":
        import xxhash  # noqa: F401  (CI installs the [redis] extra, which brings it)
    else:
        pytest.importorskip("xxhash", reason="ferrox_kv.store needs pip install '.[store]'")
