# The invariant checker behind KvBlockPool.check(): walks the free list, every
# cache's block table, every block's holders and the prefix index under the
# pool lock, counting with a mark array of its own (calloc'd per call), and
# returns the first broken rule as a CHECK_* code (messages below).
# what pool_check found broken; messages in KvBlockPool.check
cdef enum:
    CHECK_COUNTS = 1, CHECK_STACK_ID, CHECK_STACK_TWICE, CHECK_STACK_HELD, CHECK_TABLE_ID,
    CHECK_REFS, CHECK_RAW, CHECK_FREE_HELD, CHECK_CACHE_SHAPE, CHECK_PRIVATE,
    CHECK_ENTRY_BLOCKS, CHECK_ENTRY_HELD, CHECK_ENTRY_LRU, CHECK_ENTRY_KEY,
    CHECK_ENTRY_INDEX, CHECK_CACHED, CHECK_LOST, CHECK_NO_MEMORY


cdef int pool_check(Pool* p, Py_ssize_t* where) noexcept nogil:
    """Walk every invariant of the pool under its lock; 0, or the first
    broken one (``where``: the block, cache position or entry). Meant for a
    pool whose caches no other thread is changing. CHECK_NO_MEMORY when its
    mark array (one count per block, zeroed) cannot be allocated."""
    cdef int rc = 0
    cdef int32_t* mark = <int32_t*>calloc(<size_t>p.total if p.total > 0 else 1,
                                          sizeof(int32_t))
    if mark == NULL:
        return CHECK_NO_MEMORY
    pthread_mutex_lock(&p.lock)
    rc = _check_locked(p, mark, where)
    pthread_mutex_unlock(&p.lock)
    free(mark)
    return rc


cdef int _check_locked(Pool* p, int32_t* mark, Py_ssize_t* where) noexcept nogil:
    """pool_check under the lock. ``mark`` (zero, one per block) counts the
    free-list entries (-1) and the table entries naming each block."""
    cdef Prefix* x = p.prefix
    cdef Py_ssize_t i, j, used = 0, cached = 0, n_cache = 0, stacked = 0
    cdef int32_t b, e, held
    cdef Cache* c
    cdef int rc = 0
    # 1. the free list: ids handed out before, each once, held by no one
    for i in range(p.n_stack):
        b = p.free_stack[i]
        if b < 0 or b >= p.next_fresh:
            where[0] = i
            rc = CHECK_STACK_ID
            break
        if mark[b] != 0:
            where[0] = b
            rc = CHECK_STACK_TWICE
            break
        mark[b] = -1
        if p.refs[b] != 0 or p.owner[b] != OWNER_FREE or _published(p, b):
            where[0] = b
            rc = CHECK_STACK_HELD
            break
    for i in range(p.n_stack):         # clear the free list's marks
        b = p.free_stack[i]
        if 0 <= b < p.total:
            mark[b] = 0
    if rc:
        return rc
    # 2. every table entry of every cache counts once
    c = <Cache*>p.caches
    while c != NULL and rc == 0:
        if (c.cap != c.base + c.n_blocks * p.block_size or c.len > c.cap
                or c.shared_upto > c.n_blocks or c.base % p.block_size != 0 or c.len < c.base
                or (c.window == 0 and c.base != 0)
                or (c.window != 0 and c.base > max(c.len - c.window + 1, 0))):
            where[0] = n_cache
            rc = CHECK_CACHE_SHAPE
        for j in range(c.n_blocks):
            b = c.table[j]
            if b < 0 or b >= p.next_fresh:
                where[0] = n_cache
                rc = CHECK_TABLE_ID
                break
            mark[b] += 1
            if j >= c.shared_upto and (p.refs[b] != 1 or _published(p, b)):
                where[0] = b
                rc = CHECK_PRIVATE     # a write there would not copy it first
                break
        n_cache += 1
        c = <Cache*>c.pool_next
    # 3. each block's holders: table entries, or one raw allocation
    for i in range(p.next_fresh):
        b = <int32_t>i
        if rc == 0:
            if p.refs[b] > 0:
                used += 1
            if p.owner[b] == OWNER_RAW:
                if p.refs[b] != 1 or mark[b] != 0:
                    where[0] = b
                    rc = CHECK_RAW
            elif p.owner[b] == OWNER_CACHE:
                if p.refs[b] != mark[b]:
                    where[0] = b
                    rc = CHECK_REFS
                elif p.refs[b] == 0:
                    if not _published(p, b):
                        where[0] = b
                        rc = CHECK_LOST    # no holder, not cached, not on the free list
                    else:
                        cached += 1
            elif p.refs[b] != 0 or mark[b] != 0:
                where[0] = b
                rc = CHECK_FREE_HELD
            else:
                stacked += 1
        mark[b] = 0
    if rc:
        return rc
    if (used != p.n_used or stacked != p.n_stack
            or p.n_stack + (p.total - p.next_fresh) + cached + used != p.total
            or (x != NULL and cached != x.n_cached) or (x == NULL and cached != 0)):
        where[0] = 0
        return CHECK_COUNTS
    if x == NULL:
        return 0
    # 4. the prefix index: entries own their blocks, are findable, and are in
    #    the LRU list exactly when a block of theirs has no holder
    for e in range(1, x.next_entry):
        if x.e_layers[e] == 0:
            continue                   # on the entry free list
        held = 0
        j = 0
        b = x.e_first[e]
        while True:
            if x.blk_entry[b] != e:
                where[0] = e
                return CHECK_ENTRY_BLOCKS
            held += p.refs[b] > 0
            j += 1
            if x.blk_next[b] == 0:
                break
            b = x.blk_next[b] - 1
        if j != x.e_layers[e]:
            where[0] = e
            return CHECK_ENTRY_BLOCKS
        if held != x.e_held[e]:
            where[0] = e
            return CHECK_ENTRY_HELD
        if x.e_key[e] != fx_block_key(x.e_key[x.e_parent[e]] if x.e_parent[e] else 0,
                                      x.e_tokens + <size_t>e * <size_t>p.block_size,
                                      p.block_size, <uint64_t>x.e_layers[e],
                                      <uint64_t>x.e_salt[e]):
            where[0] = e
            return CHECK_ENTRY_KEY     # the key is not that of the tokens it stores
        if _find(p, x.e_key[e], x.e_parent[e], x.e_salt[e], x.e_layers[e],
                 x.e_tokens + <size_t>e * <size_t>p.block_size) != e:
            where[0] = e
            return CHECK_ENTRY_INDEX
    j = 0
    e = x.lru_head
    while e != 0:
        if not _in_lru(x, e) or x.e_layers[e] == 0:
            where[0] = e
            return CHECK_ENTRY_LRU
        j += 1
        e = x.e_lru_next[e]
    for e in range(1, x.next_entry):
        if x.e_layers[e] != 0 and _in_lru(x, e):
            j -= 1
    if j != 0:
        where[0] = 0
        return CHECK_ENTRY_LRU
    return 0


_CHECK_MESSAGES = {
    CHECK_COUNTS: "free list + cached + used != total blocks, or a count drifted",
    CHECK_STACK_ID: "the free list holds an id never handed out",
    CHECK_STACK_TWICE: "a block is on the free list twice",
    CHECK_STACK_HELD: "a block on the free list has holders or is published",
    CHECK_TABLE_ID: "a cache's block table names an id never handed out",
    CHECK_REFS: "a block's reference count differs from the table entries naming it",
    CHECK_RAW: "a block from allocate() is named by a cache or held twice",
    CHECK_FREE_HELD: "a free block has holders",
    CHECK_CACHE_SHAPE: ("a cache's capacity, length, shared prefix or first position "
                        "disagrees with its table or its window"),
    CHECK_PRIVATE: "a block a cache may write in place is shared or published",
    CHECK_ENTRY_BLOCKS: "a prefix-cache entry does not own exactly its blocks",
    CHECK_ENTRY_HELD: "a prefix-cache entry miscounts its held blocks",
    CHECK_ENTRY_LRU: "the LRU list and the entries with unheld blocks differ",
    CHECK_ENTRY_KEY: "a prefix-cache entry's key is not that of the tokens it stores",
    CHECK_ENTRY_INDEX: "a prefix-cache entry is not found under its key",
    CHECK_CACHED: "a cached block is miscounted",
    CHECK_LOST: "a block has no holder and is neither free nor cached",
    CHECK_NO_MEMORY: "no memory for the checker's marks",
}
