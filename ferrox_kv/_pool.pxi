# The C pool: arenas, block ids, reference counts, the check/apply pair that
# moves them, fork handling. KvBlockPool (_pool_class.pxi) sits on top.
#
# Moving ids. Every request for blocks (take, share, give back) goes through
# one check/apply pair under the pool lock: _req_check (changes nothing;
# refuses the whole BlockReq) then _req_apply (built on _hold, _unhold and
# _take). pools_update is that pair for requests alone, over one or several
# pools; pool_reserve (_prefix.pxi), pool_export and pool_import_reserve
# (_prefix_io.pxi) call it inside their own locked step, after a lookup in
# the prefix index. Outside the pair ids move in three places only, each
# ending something the pair began or the index owns: pool_import_publish
# lets go of what its reservation held (_unhold), pool_import_abort undoes
# its reservation (_untake), and eviction (_unlink) frees cached blocks no
# one holds. A block joins the free list only through _push_free.
#
# Counting. A block is used (it has holders: table entries of caches, or one
# raw allocation), cached (published in the prefix index and held by no one;
# evictable) or on the free list (given back, or never handed out: ids from
# next_fresh up). free_blocks = total - used counts what a request can get,
# cached blocks included: free list + cached + used = total.

cdef Pool* _registry_head = NULL


cdef Pool* pool_new(Py_ssize_t block_size, Py_ssize_t total, int nh, int hd, int vhd,
                    int dtype, bint prefix_cache) noexcept nogil:
    """Allocate a pool; NULL when memory is short. Sizes are pre-validated.

    Creation is O(1) in resident memory: the arenas (fx_big_alloc) and the
    per-block arrays are allocated, not written, so only the pages that
    blocks touch become resident (the free list is written only as blocks
    come back)."""
    global _registry_head
    cdef Pool* p = <Pool*>calloc(1, sizeof(Pool))
    cdef size_t n_k, n_v
    cdef size_t nb = <size_t>total if total > 0 else 1
    cdef Pool* prev
    cdef Pool* cur
    if p == NULL:
        return NULL
    p.block_size = block_size
    p.total = total
    p.kw = <Py_ssize_t>nh * hd
    p.vw = <Py_ssize_t>nh * vhd
    p.dtype = dtype
    p.nh = nh
    p.hd = hd
    p.vhd = vhd
    p.k_row = _row_bytes(nh, hd, dtype)
    p.v_row = _row_bytes(nh, vhd, dtype)
    p.k_block = <size_t>block_size * p.k_row
    p.v_block = <size_t>block_size * p.v_row
    n_k = <size_t>total * p.k_block
    n_v = <size_t>total * p.v_block
    p.k_arena = <char*>fx_big_alloc(n_k, True)
    p.v_arena = <char*>fx_big_alloc(n_v, True)
    p.free_stack = <int32_t*>malloc(nb * sizeof(int32_t))
    p.refs = <int32_t*>calloc(nb, sizeof(int32_t))
    p.owner = <unsigned char*>calloc(nb, 1)
    p.delta = <int32_t*>calloc(nb, sizeof(int32_t))
    if prefix_cache:
        p.prefix = prefix_new(total, block_size)
    if (p.k_arena == NULL or p.v_arena == NULL or p.free_stack == NULL
            or p.refs == NULL or p.owner == NULL or p.delta == NULL
            or (prefix_cache and p.prefix == NULL)):
        _pool_free_memory(p)
        return NULL
    pthread_mutex_init(&p.lock, NULL)
    p.refcnt = 1
    # the registry stays in address order: the order pools are locked in
    pthread_mutex_lock(&fx_registry_lock)
    prev = NULL
    cur = _registry_head
    while cur != NULL and <size_t>cur < <size_t>p:
        prev = cur
        cur = cur.reg_next
    p.reg_prev = prev
    p.reg_next = cur
    if prev != NULL:
        prev.reg_next = p
    else:
        _registry_head = p
    if cur != NULL:
        cur.reg_prev = p
    pthread_mutex_unlock(&fx_registry_lock)
    return p


cdef void _pool_free_memory(Pool* p) noexcept nogil:
    fx_big_free(p.k_arena, <size_t>p.total * p.k_block)
    fx_big_free(p.v_arena, <size_t>p.total * p.v_block)
    free(p.free_stack)
    free(p.refs)
    free(p.owner)
    free(p.delta)
    prefix_free(p.prefix)
    free(p)


cdef void pool_incref(Pool* p) noexcept nogil:
    fx_incref(&p.refcnt)


cdef void pool_decref(Pool* p) noexcept nogil:
    global _registry_head
    if p == NULL or fx_decref(&p.refcnt) != 0:
        return
    pthread_mutex_lock(&fx_registry_lock)
    if p.reg_prev != NULL:
        p.reg_prev.reg_next = p.reg_next
    else:
        _registry_head = p.reg_next
    if p.reg_next != NULL:
        p.reg_next.reg_prev = p.reg_prev
    pthread_mutex_unlock(&fx_registry_lock)
    pthread_mutex_destroy(&p.lock)
    _pool_free_memory(p)


# -- reference counts (pool lock held) ----------------------------------------

cdef inline bint _published(Pool* p, int32_t b) noexcept nogil:
    return p.prefix != NULL and p.prefix.blk_entry[b] != 0


cdef inline void _hold(Pool* p, int32_t b) noexcept nogil:
    """One more holder of block b, which is held or cached."""
    cdef int32_t r = p.refs[b]
    if r == 0:                     # a cached block comes back into use
        p.n_used += 1
        p.acquired += 1
        prefix_held(p, b)
    fx_store(&p.refs[b], r + 1)


cdef inline void _push_free(Pool* p, int32_t b) noexcept nogil:
    """Block b, held by no one and unpublished, goes onto the free list."""
    p.owner[b] = OWNER_FREE
    p.free_stack[p.n_stack] = b
    p.n_stack += 1


cdef inline void _unhold(Pool* p, int32_t b) noexcept nogil:
    """One holder fewer; at none the block is cached (if published) or free."""
    cdef int32_t r = p.refs[b] - 1
    fx_store(&p.refs[b], r)
    if r != 0:
        return
    p.n_used -= 1
    p.released += 1
    if _published(p, b):
        prefix_unheld(p, b)
    else:
        _push_free(p, b)


cdef inline int32_t _take(Pool* p, int owner) noexcept nogil:
    """A block for a new holder: a given-back one first (its pages are
    resident), then a never-used id, then an evicted cached block. One must be
    free (the caller checked)."""
    cdef int32_t b
    if p.n_stack == 0 and p.next_fresh == p.total and p.prefix != NULL:
        prefix_evict(p)            # moves cached blocks onto the free list
    if p.n_stack > 0:
        p.n_stack -= 1
        b = p.free_stack[p.n_stack]
    else:
        b = <int32_t>p.next_fresh
        p.next_fresh += 1
    p.owner[b] = <unsigned char>owner
    fx_store(&p.refs[b], 1)
    p.n_used += 1
    p.acquired += 1
    return b


cdef inline void _untake(Pool* p, int32_t b) noexcept nogil:
    """Undo _take of block b (its one holder the taker, nothing written to
    it that counts): back onto the free list, uncounted in ``acquired``."""
    fx_store(&p.refs[b], 0)
    p.n_used -= 1
    p.acquired -= 1
    _push_free(p, b)


cdef int _req_check(BlockReq* r) noexcept nogil:
    """0 if ``r`` can be applied as a whole, else FX_EXHAUSTED (``r.needed``
    and ``r.free_seen`` set) or FX_BAD_IDS. Pool lock held; changes nothing."""
    cdef Pool* p = r.pool
    cdef Py_ssize_t i, revived = 0, freed = 0, avail
    cdef int32_t b, now, after
    cdef int rc = 0
    for i in range(r.n_share):     # shared blocks: held or cached, by caches
        b = r.share[i]
        if (b < 0 or b >= p.total or p.owner[b] != OWNER_CACHE
                or (p.refs[b] == 0 and not _published(p, b))):
            return FX_BAD_IDS
    for i in range(r.n_drop):
        b = r.drop[i]
        if b < 0 or b >= p.total or p.owner[b] != r.owner or p.refs[b] <= 0:
            return FX_BAD_IDS
    for i in range(r.n_share):
        p.delta[r.share[i]] += 1
    for i in range(r.n_drop):
        p.delta[r.drop[i]] -= 1
    # each touched id once: evaluate where delta is set, then clear it
    for i in range(r.n_share + r.n_drop):
        b = r.share[i] if i < r.n_share else r.drop[i - r.n_share]
        if p.delta[b] == 0:
            continue
        now = p.refs[b]
        after = now + p.delta[b]
        p.delta[b] = 0
        if after < 0:
            rc = FX_BAD_IDS        # named more often than it is held
        elif now == 0 and after > 0:
            revived += 1
        elif now > 0 and after == 0:
            freed += 1
    if rc != 0:
        return rc
    avail = p.total - p.n_used
    if r.n_fresh + revived > avail + freed:
        r.needed = r.n_fresh + revived - freed
        r.free_seen = avail
        return FX_EXHAUSTED
    return 0


cdef void _req_apply(BlockReq* r) noexcept nogil:
    """Apply a checked request: shares, then drops, then fresh blocks (which
    may reuse what the drops gave back). Pool lock held. Drops go last to
    first, so that a sequence's first blocks are the most recently used of
    the prefix cache's LRU: a chain loses its tail before its head."""
    cdef Pool* p = r.pool
    cdef Py_ssize_t i
    cdef uint64_t released = p.released
    for i in range(r.n_share):
        _hold(p, r.share[i])
    for i in range(r.n_drop - 1, -1, -1):
        _unhold(p, r.drop[i])
    if r.window_drops:             # the blocks those drops took out of use
        p.window_freed += p.released - released
    for i in range(r.n_fresh):
        r.fresh[i] = _take(p, r.owner)
    if p.n_used > p.high_water:
        p.high_water = p.n_used


cdef int pools_update(BlockReq* reqs, Py_ssize_t n, Py_ssize_t* failed) noexcept nogil:
    """Apply ``n`` requests on distinct pools, given in address order, as one
    change: every pool's or none. Returns 0, or FX_EXHAUSTED / FX_BAD_IDS with
    ``failed[0]`` the index of the request refused (only its pool counts the
    refusal). Every pool's lock is held only while its ids move."""
    cdef Py_ssize_t i
    cdef int rc = 0
    for i in range(n):
        pthread_mutex_lock(&reqs[i].pool.lock)
    for i in range(n):
        rc = _req_check(&reqs[i])
        if rc != 0:
            failed[0] = i
            if rc == FX_EXHAUSTED:
                reqs[i].pool.refused += 1
            break
    if rc == 0:
        for i in range(n):
            _req_apply(&reqs[i])
    for i in range(n - 1, -1, -1):
        pthread_mutex_unlock(&reqs[i].pool.lock)
    return rc


cdef int pool_drop(Pool* p, const int32_t* ids, Py_ssize_t n) noexcept nogil:
    """A cache lets go of blocks it holds (cannot be refused)."""
    cdef BlockReq r
    cdef Py_ssize_t failed
    if n == 0:
        return 0
    memset(&r, 0, sizeof(BlockReq))
    r.pool = p
    r.drop = ids
    r.n_drop = n
    r.owner = OWNER_CACHE
    return pools_update(&r, 1, &failed)


cdef int pool_take(Pool* p, Py_ssize_t n, int32_t* out, int owner, BlockReq* r) noexcept nogil:
    """Take ``n`` fresh blocks into ``out`` (``r`` receives the outcome)."""
    cdef Py_ssize_t failed
    memset(r, 0, sizeof(BlockReq))
    r.pool = p
    r.fresh = out
    r.n_fresh = n
    r.owner = owner
    return pools_update(r, 1, &failed)


cdef Py_ssize_t pool_free_count(Pool* p) noexcept nogil:
    """free_blocks, read under the lock."""
    cdef Py_ssize_t n
    pthread_mutex_lock(&p.lock)
    n = p.total - p.n_used
    pthread_mutex_unlock(&p.lock)
    return n


cdef Py_ssize_t pool_refuse(Pool* p) noexcept nogil:
    """Count a refusal decided without taking blocks; returns free_blocks."""
    cdef Py_ssize_t n
    pthread_mutex_lock(&p.lock)
    p.refused += 1
    n = p.total - p.n_used
    pthread_mutex_unlock(&p.lock)
    return n


# -- the pool's caches, and check() ----------------------------------------------

cdef void pool_link(Pool* p, Cache** cs, Py_ssize_t n) noexcept nogil:
    """Attach ``n`` caches that now hold references to ``p`` (each holds one
    on the pool struct) to its list of caches."""
    cdef Py_ssize_t i
    pthread_mutex_lock(&p.lock)
    for i in range(n):
        cs[i].pool_prev = NULL
        cs[i].pool_next = p.caches
        if p.caches != NULL:
            (<Cache*>p.caches).pool_prev = cs[i]
        p.caches = cs[i]
    pthread_mutex_unlock(&p.lock)


cdef void _pool_unlink(Pool* p, Cache* c) noexcept nogil:
    pthread_mutex_lock(&p.lock)
    if c.pool_prev != NULL:
        (<Cache*>c.pool_prev).pool_next = c.pool_next
    else:
        p.caches = c.pool_next
    if c.pool_next != NULL:
        (<Cache*>c.pool_next).pool_prev = c.pool_prev
    c.pool_prev = NULL
    c.pool_next = NULL
    pthread_mutex_unlock(&p.lock)


# -- fork -------------------------------------------------------------------
# pthread_atfork runs these inside fork() itself, after every Python-level
# hook: no Python code runs between taking the locks and letting them go. A
# thread that holds a pool lock never waits for the GIL, so the forking
# thread (which holds the GIL) always gets every lock.

cdef void _fork_prepare() noexcept nogil:
    cdef Pool* p
    pthread_mutex_lock(&fx_registry_lock)
    p = _registry_head
    while p != NULL:               # address order, as every multi-pool call
        pthread_mutex_lock(&p.lock)
        p = p.reg_next


cdef void _fork_release() noexcept nogil:
    # in the child this thread is the one that took the locks, so it may
    # release them; the free lists are consistent because no thread was
    # inside a locked region when the locks were taken
    cdef Pool* p = _registry_head
    while p != NULL:
        pthread_mutex_unlock(&p.lock)
        p = p.reg_next
    pthread_mutex_unlock(&fx_registry_lock)


pthread_atfork(_fork_prepare, _fork_release, _fork_release)
