"""The core's batch reorder and block assignment, without torch.

``_core._assign(caches, sources)`` is what ``FerroxCache.reorder_cache``
(beam search), batch selection and forks call: cache i takes the rows of
cache ``sources[i]``, every source read as it was before the call. On a pool
(``_assign_blocks``) the full blocks are shared and the partly filled tail
copied into a block of the target's own, in one all-or-nothing change of the
pool. ``_core._extend_each`` is the batch write path (``_make_room_each``):
every sequence of a batch gets its positions, or none does."""
import numpy as np
import pytest

from ferrox_kv import KvBlockPool, KvCache, KvPoolExhausted, _core

H, D, BS = 2, 8, 4


def rows(t, seed):
    r = np.random.default_rng(seed)
    return (r.standard_normal((t, H, D)).astype(np.float32),
            r.standard_normal((t, H, D)).astype(np.float32))


def filled(pool, lengths, max_len=16):
    """Pooled caches holding ``lengths[i]`` positions of rows seeded by i."""
    caches = KvCache.with_pool_many(len(lengths), H, D, pool, max_len) if pool else [
        KvCache.with_capacity(H, D, max_len) for _ in lengths]
    for i, (c, n) in enumerate(zip(caches, lengths)):
        if n:
            c.extend(*rows(n, i))
    return caches


def snapshot(caches):
    return [(c.k.copy(), c.v.copy()) for c in caches]


def assert_rows(caches, expected):
    for c, (k, v) in zip(caches, expected):
        np.testing.assert_array_equal(c.k, k)
        np.testing.assert_array_equal(c.v, v)


@pytest.mark.parametrize("pooled", [True, False])
def test_a_beam_reorder_gives_each_cache_its_source_rows(pooled):
    pool = KvBlockPool(BS, 64, H, D) if pooled else None
    caches = filled(pool, [10, 10, 10, 10])
    before = snapshot(caches)
    sources = [2, 2, 0, 1]                  # beam 3 dropped, beam 2 doubled
    _core._assign(caches, sources)
    assert_rows(caches, [before[s] for s in sources])
    assert [len(c) for c in caches] == [10] * 4
    if pooled:
        pool.check()


def test_pooled_targets_share_the_full_blocks_and_own_their_tail():
    pool = KvBlockPool(BS, 64, H, D)
    a, b = filled(pool, [10, 3])            # a: 2 full blocks and a tail of 2 rows
    used = pool.used_blocks
    src_table = a.block_table.copy()
    _core._assign([a, b], [0, 0])
    assert list(b.block_table[:2]) == list(src_table[:2])   # shared, not copied
    assert b.block_table[2] != src_table[2]                  # the tail: its own block
    assert list(a.block_table) == list(src_table)            # the source keeps its own
    # b let go of its 4 blocks; it holds 4 again (its reservation), 2 of them a's
    assert b.blocks_held == a.blocks_held == 4
    assert pool.used_blocks == used - 2
    pool.check()
    # a write into the target's tail leaves the source's rows alone
    keep = snapshot([a])
    b.push(*[x[0] for x in rows(1, 99)])
    assert_rows([a], keep)
    assert len(b) == 11 and len(a) == 10
    pool.check()


def test_an_identity_order_changes_nothing():
    pool = KvBlockPool(BS, 32, H, D)
    caches = filled(pool, [5, 9])
    tables = [c.block_table.copy() for c in caches]
    before, stats = snapshot(caches), pool.stats()
    _core._assign(caches, [0, 1])
    assert [list(c.block_table) for c in caches] == [list(t) for t in tables]
    assert_rows(caches, before)
    assert pool.stats() == stats
    pool.check()


def test_layers_reorder_together_as_hf_flattens_them():
    # FerroxCache._reorder_layers: layer li's sequence b at li * n + b takes li * n + order[b]
    pool = KvBlockPool(BS, 128, H, D)
    n_layers, n = 3, 3
    flat = filled(pool, [7] * (n_layers * n))
    before = snapshot(flat)
    order = [1, 1, 0]
    sources = [li * n + order[b] for li in range(n_layers) for b in range(n)]
    _core._assign(flat, sources)
    assert_rows(flat, [before[s] for s in sources])
    pool.check()


def test_a_reorder_the_pool_cannot_supply_changes_nothing():
    # the source reserves 4 blocks (2 full, a tail, one more); each target
    # holds 1, and would share 2 and need 2 of its own: one more than it lets go
    pool = KvBlockPool(BS, 10, H, D)
    caches = filled(pool, [10], max_len=16) + filled(pool, [1, 1, 1], max_len=4)
    assert pool.used_blocks == 7
    spare = pool.allocate(pool.free_blocks)                  # nothing free
    tables = [c.block_table.copy() for c in caches]
    before, stats = snapshot(caches), pool.stats()
    with pytest.raises(KvPoolExhausted):
        _core._assign(caches, [0, 0, 0, 0])
    assert [list(c.block_table) for c in caches] == [list(t) for t in tables]
    assert_rows(caches, before)
    after = pool.stats()
    assert after["refused"] == stats["refused"] + 1
    assert {k: v for k, v in after.items() if k != "refused"} == {
        k: v for k, v in stats.items() if k != "refused"}
    pool.check()
    pool.free(spare)                                         # the 3 blocks it lacked
    _core._assign(caches, [0, 0, 0, 0])
    assert_rows(caches, [before[0]] * 4)
    pool.check()


@pytest.mark.parametrize("sources, message", [
    ([0], "sources has 1 entries for 2 caches"),
    ([0, 2], r"sources\[1\] = 2 is out of range"),
    ([0, -1], r"sources\[1\] = -1 is out of range"),
])
def test_bad_sources_raise_and_change_nothing(sources, message):
    pool = KvBlockPool(BS, 16, H, D)
    caches = filled(pool, [5, 6])
    before, stats = snapshot(caches), pool.stats()
    with pytest.raises(ValueError, match=message):
        _core._assign(caches, sources)
    assert_rows(caches, before)
    assert pool.stats() == stats
    pool.check()


def test_caches_of_two_pools_or_mixed_kinds_are_refused():
    p1, p2 = KvBlockPool(BS, 16, H, D), KvBlockPool(BS, 16, H, D)
    a, b = filled(p1, [5]), filled(p2, [5])
    c = filled(None, [5])
    for pair in ((a[0], b[0]), (a[0], c[0])):
        before = snapshot(pair)
        with pytest.raises(ValueError, match="all be contiguous or all on one pool"):
            _core._assign(pair, [1, 0])
        assert_rows(pair, before)
    p1.check()
    p2.check()


def test_a_batch_extend_is_all_or_nothing_across_the_batch():
    # _make_room_each: sequence 1 needs a new block, the pool has none
    pool = KvBlockPool(BS, 4, H, D)
    caches = filled(pool, [3, 4], max_len=4)                 # one block each
    spare = pool.allocate(pool.free_blocks)
    before, stats = snapshot(caches), pool.stats()
    k = np.ones((2, 1, H, D), np.float32)
    with pytest.raises(KvPoolExhausted):
        _core._extend_each(caches, k, k)
    assert [len(c) for c in caches] == [3, 4]
    assert_rows(caches, before)
    assert pool.stats()["used_blocks"] == stats["used_blocks"]
    pool.check()
    pool.free(spare)
    _core._extend_each(caches, k, k)
    assert [len(c) for c in caches] == [4, 5]
    for c, (bk, _) in zip(caches, before):
        np.testing.assert_array_equal(c.k[:len(bk)], bk)
        np.testing.assert_array_equal(c.k[-1], k[0, 0])
    pool.check()


def test_grown_batch_starts_as_copies_of_one_sequence():
    # FerroxCache._grow_from: blanks from _blank, then one _assign
    pool = KvBlockPool(BS, 32, H, D)
    (seq,) = filled(pool, [6])
    new = seq._blank(2)
    assert [len(c) for c in new] == [0, 0]
    before = snapshot([seq])
    _core._assign([seq] + new, [0, 0, 0])
    assert_rows([seq] + new, before * 3)
    pool.check()
    for c in new:
        c.close()
    seq.close()
    assert pool.used_blocks == 0
    pool.check()
