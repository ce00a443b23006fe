# The C pool: arenas, block ids, reference counts, the one all-or-nothing
# path that moves them, fork handling; KvBlockPool on top.
#
# Counting. A block is used (it has holders: table entries of caches, or one
# raw allocation), cached (published in the prefix index and held by no one;
# evictable) or on the free list (given back, or never handed out: ids from
# next_fresh up). free_blocks = total - used counts what a request can get,
# cached blocks included: free list + cached + used = total.

cdef extern from "<pthread.h>" nogil:
    ctypedef void (*fx_fork_fn)() noexcept nogil
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_atfork(fx_fork_fn prepare, fx_fork_fn parent, fx_fork_fn child)

cdef Pool* _registry_head = NULL


cdef Pool* pool_new(Py_ssize_t block_size, Py_ssize_t total, int nh, int hd, int vhd,
                    int dtype, bint prefix_cache) noexcept nogil:
    """Allocate a pool; NULL when memory is short. Sizes are pre-validated.

    Creation is O(1) in resident memory: the arenas and per-block arrays are
    calloc'd or malloc'd and only the pages that blocks touch become resident
    (the free list is written only as blocks come back)."""
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
    p.k_arena = <char*>calloc(n_k if n_k > 0 else 1, 1)
    p.v_arena = <char*>calloc(n_v if n_v > 0 else 1, 1)
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
    fx_advise_huge(p.k_arena, n_k)
    fx_advise_huge(p.v_arena, n_v)
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
    free(p.k_arena)
    free(p.v_arena)
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
        p.owner[b] = OWNER_FREE
        p.free_stack[p.n_stack] = b
        p.n_stack += 1


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
    for i in range(r.n_share):
        _hold(p, r.share[i])
    for i in range(r.n_drop - 1, -1, -1):
        _unhold(p, r.drop[i])
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


# what pool_check found broken; messages in KvBlockPool.check
cdef enum:
    CHECK_COUNTS = 1, CHECK_STACK_ID, CHECK_STACK_TWICE, CHECK_STACK_HELD, CHECK_TABLE_ID,
    CHECK_REFS, CHECK_RAW, CHECK_FREE_HELD, CHECK_CACHE_SHAPE, CHECK_PRIVATE,
    CHECK_ENTRY_BLOCKS, CHECK_ENTRY_HELD, CHECK_ENTRY_LRU, CHECK_ENTRY_KEY,
    CHECK_ENTRY_INDEX, CHECK_CACHED, CHECK_LOST


cdef int pool_check(Pool* p, Py_ssize_t* where) noexcept nogil:
    """Walk every invariant of the pool under its lock; 0, or the first
    broken one (``where``: the block, cache position or entry). Meant for a
    pool whose caches no other thread is changing."""
    cdef int rc = 0
    pthread_mutex_lock(&p.lock)
    rc = _check_locked(p, where)
    pthread_mutex_unlock(&p.lock)
    return rc


cdef int _check_locked(Pool* p, Py_ssize_t* where) noexcept nogil:
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
        if p.delta[b] != 0:
            where[0] = b
            rc = CHECK_STACK_TWICE
            break
        p.delta[b] = -1
        if p.refs[b] != 0 or p.owner[b] != OWNER_FREE or _published(p, b):
            where[0] = b
            rc = CHECK_STACK_HELD
            break
    for i in range(p.n_stack):         # clear the marks
        b = p.free_stack[i]
        if 0 <= b < p.total:
            p.delta[b] = 0
    if rc:
        return rc
    # 2. every table entry of every cache counts once
    c = <Cache*>p.caches
    while c != NULL and rc == 0:
        if c.cap != c.n_blocks * p.block_size or c.len > c.cap or c.shared_upto > c.n_blocks:
            where[0] = n_cache
            rc = CHECK_CACHE_SHAPE
        for j in range(c.n_blocks):
            b = c.table[j]
            if b < 0 or b >= p.next_fresh:
                where[0] = n_cache
                rc = CHECK_TABLE_ID
                break
            p.delta[b] += 1
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
                if p.refs[b] != 1 or p.delta[b] != 0:
                    where[0] = b
                    rc = CHECK_RAW
            elif p.owner[b] == OWNER_CACHE:
                if p.refs[b] != p.delta[b]:
                    where[0] = b
                    rc = CHECK_REFS
                elif p.refs[b] == 0:
                    if not _published(p, b):
                        where[0] = b
                        rc = CHECK_LOST    # no holder, not cached, not on the free list
                    else:
                        cached += 1
            elif p.refs[b] != 0 or p.delta[b] != 0:
                where[0] = b
                rc = CHECK_FREE_HELD
            else:
                stacked += 1
        p.delta[b] = 0
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

_CHECK_MESSAGES = {
    CHECK_COUNTS: "free list + cached + used != total blocks, or a count drifted",
    CHECK_STACK_ID: "the free list holds an id never handed out",
    CHECK_STACK_TWICE: "a block is on the free list twice",
    CHECK_STACK_HELD: "a block on the free list has holders or is published",
    CHECK_TABLE_ID: "a cache's block table names an id never handed out",
    CHECK_REFS: "a block's reference count differs from the table entries naming it",
    CHECK_RAW: "a block from allocate() is named by a cache or held twice",
    CHECK_FREE_HELD: "a free block has holders",
    CHECK_CACHE_SHAPE: "a cache's capacity, length or shared prefix disagrees with its table",
    CHECK_PRIVATE: "a block a cache may write in place is shared or published",
    CHECK_ENTRY_BLOCKS: "a prefix-cache entry does not own exactly its blocks",
    CHECK_ENTRY_HELD: "a prefix-cache entry miscounts its held blocks",
    CHECK_ENTRY_LRU: "the LRU list and the entries with unheld blocks differ",
    CHECK_ENTRY_KEY: "a prefix-cache entry's key is not that of the tokens it stores",
    CHECK_ENTRY_INDEX: "a prefix-cache entry is not found under its key",
    CHECK_CACHED: "a cached block is miscounted",
    CHECK_LOST: "a block has no holder and is neither free nor cached",
}


# ---------------------------------------------------------------------------
# KvBlockPool
# ---------------------------------------------------------------------------

@cython.final
cdef _import_rows(k, v, Py_ssize_t i, int32_t layers, Py_ssize_t bs, size_t k_row,
                  size_t v_row):
    """Entry i's stored rows for _import_prefixes: C-contiguous uint8 arrays
    of shape (layers, bs, row bytes), or ValueError naming them."""
    for name, a, row in (("ks", k, k_row), ("vs", v, v_row)):
        if (not isinstance(a, np.ndarray) or a.dtype != np.uint8
                or a.shape != (layers, bs, row) or not a.flags.c_contiguous):
            raise ValueError(f"{name}[{i}] must be C-contiguous uint8 of shape "
                             f"{(layers, bs, row)}")


cdef class KvBlockPool:
    """KvBlockPool(block_size, total_blocks, n_kv_heads, head_dim, *, v_head_dim=None, prefix_cache=False, dtype="float32")
--

A bounded pool of fixed-size KV blocks shared by every cache of a process.

    A block holds ``block_size`` positions of one layer's K rows
    (``n_kv_heads * head_dim`` values each) and V rows
    (``n_kv_heads * v_head_dim``), stored as ``dtype``: ``"float32"`` (the
    default), ``"float16"``, ``"bfloat16"`` or ``"int8"`` (with one float16
    scale per 32 values of each head, inside the row; see the README's
    "Precision"). The pool owns one K arena and one V arena of
    ``total_blocks`` blocks, allocated so that untouched blocks cost no
    physical memory. Block ids and their reference counts move under one
    native mutex, held only while ids move. ``free_blocks`` is the
    admission-control signal.

    All methods are safe to call from many threads at once.
    """

    def __cinit__(self, block_size=_MISSING, total_blocks=_MISSING, n_kv_heads=_MISSING,
                  head_dim=_MISSING, *, v_head_dim=None, prefix_cache=False,
                  dtype="float32"):
        self.p = NULL
        _require("KvBlockPool", ("block_size", "total_blocks", "n_kv_heads", "head_dim"),
                 (block_size, total_blocks, n_kv_heads, head_dim))
        self._salts = {None: 0}
        cdef Py_ssize_t bs = _count(block_size, "block_size", 1)
        cdef Py_ssize_t total = _count(total_blocks, "total_blocks", 0)
        cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
        cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
        cdef Py_ssize_t vd = d if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        cdef bint with_prefix = bool(prefix_cache)
        cdef int code = _dtype_code(dtype, "dtype")
        if total > INT32_MAX:
            raise ValueError(f"total_blocks must be <= {INT32_MAX}, got {total}")
        _checked_bytes("block_size * n_kv_heads * head_dim", bs, h, d)
        _checked_bytes("block_size * n_kv_heads * v_head_dim", bs, h, vd)
        _checked_bytes("total_blocks * block_size * K row", total, bs, h * d)
        _checked_bytes("total_blocks * block_size * V row", total, bs, h * vd)
        if with_prefix:
            _checked_bytes("total_blocks * block_size token ids", total, bs, 1)
        if h > INT32_MAX or d > INT32_MAX or vd > INT32_MAX:
            raise ValueError("n_kv_heads, head_dim and v_head_dim must be < 2**31")
        self.n_kv_heads = h
        self.head_dim = d
        self.v_head_dim = vd
        with nogil:
            self.p = pool_new(bs, total, <int>h, <int>d, <int>vd, code, with_prefix)
        if self.p == NULL:
            raise MemoryError(f"cannot allocate a pool of {total} blocks of {bs} positions")

    def __init__(self, block_size=_MISSING, total_blocks=_MISSING, n_kv_heads=_MISSING,
                 head_dim=_MISSING, *, v_head_dim=None, prefix_cache=False,
                 dtype="float32"):
        pass    # all done in __cinit__; here so that the signature is introspectable

    def __reduce__(self):
        raise TypeError(
            "KvBlockPool objects cannot be pickled: its blocks are this process's "
            "memory, held by its caches. Make a pool where it is needed with the same "
            "arguments (KvBlockPool(block_size, total_blocks, n_kv_heads, head_dim, "
            "...)); a child made by os.fork() inherits the pool")

    def __dealloc__(self):
        pool_decref(self.p)
        self.p = NULL

    @property
    def block_size(self):
        """Positions per block."""
        return self.p.block_size

    @property
    def total_blocks(self):
        """Blocks in the pool."""
        return self.p.total

    @property
    def free_blocks(self):
        """Blocks a request can get right now: never used, given back, or
        cached by the prefix cache and held by no one (a snapshot)."""
        return pool_free_count(self.p)

    @property
    def used_blocks(self):
        """Blocks held by caches (or by ``allocate``) right now."""
        return self.p.total - pool_free_count(self.p)

    @property
    def cached_blocks(self):
        """Published prefix-cache blocks that no cache holds (evictable; they
        count as free)."""
        return self.stats()["cached_blocks"]

    @property
    def prefix_cache(self):
        """Whether this pool keeps a prefix cache."""
        return self.p.prefix != NULL

    @property
    def block_bytes(self):
        """Bytes of one block, K and V together, as stored (int8: scales
        included)."""
        return self.p.k_block + self.p.v_block

    @property
    def dtype(self):
        """The storage dtype, as a name: ``"float32"``, ``"float16"``,
        ``"bfloat16"`` or ``"int8"``."""
        return DTYPES[self.p.dtype]

    def stats(self):
        """A consistent snapshot of the pool's counters, as a dict.

        ``total_blocks``, ``free_blocks``, ``used_blocks``, ``cached_blocks``
        (published, held by no one; part of ``free_blocks``), ``high_water``
        (most blocks used at once), ``acquired`` and ``released`` (blocks that
        came into use and went out of use), ``refused`` (requests refused for
        lack of blocks), ``block_size``, ``block_bytes``, and for the prefix
        cache ``prefix_hits`` and ``prefix_misses`` (lookups that reused at
        least one block, or none: every reservation with ``tokens=`` is one
        lookup, one of the two; tokens shorter than a block are a miss),
        ``hit_tokens`` (positions reused) and ``evictions`` (cached blocks
        given to other requests). With a store attached (``attach``), its
        ``stats()`` too, each key prefixed ``store_``.
        """
        cdef Pool* p = self.p
        cdef Py_ssize_t used, high, cached = 0
        cdef uint64_t acq, rel, ref, hits = 0, misses = 0, toks = 0, ev = 0
        with nogil:
            pthread_mutex_lock(&p.lock)
            used = p.n_used
            high = p.high_water
            acq = p.acquired
            rel = p.released
            ref = p.refused
            if p.prefix != NULL:
                cached = p.prefix.n_cached
                hits = p.prefix.hits
                misses = p.prefix.misses
                toks = p.prefix.hit_tokens
                ev = p.prefix.evictions
            pthread_mutex_unlock(&p.lock)
        out = {
            "total_blocks": p.total,
            "free_blocks": p.total - used,
            "used_blocks": used,
            "cached_blocks": cached,
            "high_water": high,
            "acquired": acq,
            "released": rel,
            "refused": ref,
            "block_size": p.block_size,
            "block_bytes": self.block_bytes,
            "prefix_hits": hits,
            "prefix_misses": misses,
            "hit_tokens": toks,
            "evictions": ev,
        }
        if self._store is not None:
            for name, value in self._store.stats().items():
                out["store_" + name] = value
        return out

    cdef object _arena_view(self, char* base, Py_ssize_t dim, size_t row, bint scales):
        """A read-only view of an arena (keeps the pool alive): the values,
        shape (total_blocks, block_size, n_kv_heads, dim), or with ``scales``
        an int8 arena's scales, (total_blocks, block_size, n_kv_heads,
        ceil(dim / 32)) float16. Strided: rows are ``row`` bytes apart."""
        cdef Pool* p = self.p
        cdef int typ = (cnp.NPY_FLOAT32, cnp.NPY_FLOAT16, cnp.NPY_UINT16, cnp.NPY_INT8)[p.dtype]
        cdef Py_ssize_t item = 4 if p.dtype == FX_F32 else (1 if p.dtype == FX_I8 else 2)
        cdef Py_ssize_t last = dim
        cdef char* data = base
        if scales:
            typ = cnp.NPY_FLOAT16
            item = 2
            last = (dim + 31) // 32
            data = base + <size_t>p.nh * <size_t>dim
        cdef cnp.npy_intp n = <cnp.npy_intp>(<size_t>p.total * p.block_size * row)
        cdef cnp.ndarray raw = cnp.PyArray_SimpleNewFromData(1, &n, cnp.NPY_UINT8, base)
        cnp.set_array_base(raw, self)          # the view keeps the pool alive
        cnp.PyArray_CLEARFLAGS(raw, cnp.NPY_ARRAY_WRITEABLE)
        shape = (p.total, p.block_size, self.n_kv_heads, last)
        strides = (<Py_ssize_t>(p.block_size * row), <Py_ssize_t>row, last * item, item)
        # a pool of no blocks: an empty view at offset 0 (past a 0-byte buffer
        # numpy refuses any offset)
        return np.ndarray(shape, cnp.PyArray_DescrFromType(typ), buffer=raw,
                          offset=<Py_ssize_t>(data - base) if p.total else 0, strides=strides)

    @property
    def key_blocks(self):
        """Read-only zero-copy view of the K arena's values,
        shape ``(total_blocks, block_size, n_kv_heads, head_dim)``; it keeps the
        arena alive. Row ``r`` of a pooled cache lives at
        ``key_blocks[cache.block_table[r // block_size], r % block_size]``.
        Its dtype: float32 / float16 for those pools, ``uint16`` (the raw
        bfloat16 bits: ``(x.astype(np.uint32) << 16).view(np.float32)``) for
        bfloat16, int8 for int8 (dequantise with ``key_scales``)."""
        return self._arena_view(self.p.k_arena, self.head_dim, self.p.k_row, False)

    @property
    def value_blocks(self):
        """Read-only zero-copy view of the V arena's values,
        shape ``(total_blocks, block_size, n_kv_heads, v_head_dim)``."""
        return self._arena_view(self.p.v_arena, self.v_head_dim, self.p.v_row, False)

    @property
    def key_scales(self):
        """An int8 pool's K scales, read-only float16 view shaped
        ``(total_blocks, block_size, n_kv_heads, ceil(head_dim / 32))``: value
        ``i`` of a head is ``key_blocks[..., i] * key_scales[..., i // 32]``.
        None for the other dtypes."""
        if self.p.dtype != FX_I8:
            return None
        return self._arena_view(self.p.k_arena, self.head_dim, self.p.k_row, True)

    @property
    def value_scales(self):
        """An int8 pool's V scales (as ``key_scales``); None otherwise."""
        if self.p.dtype != FX_I8:
            return None
        return self._arena_view(self.p.v_arena, self.v_head_dim, self.p.v_row, True)

    def allocate(self, n):
        """Take ``n`` blocks, all or nothing, and return their ids (int32 array).

        For block managers that keep their own tables (e.g. a GPU server's
        Python scheduler). Raises ``KvPoolExhausted`` with nothing taken when
        fewer than ``n`` are free. Give them back with ``free(ids)``.
        """
        cdef Py_ssize_t count = _count(n, "n", 0)
        cdef BlockReq r
        if count > self.p.total:       # refused before any memory is sized by n
            raise KvPoolExhausted(count, pool_refuse(self.p))
        cdef cnp.npy_intp dim = count
        cdef cnp.ndarray ids = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
        if pool_take(self.p, count, <int32_t*>cnp.PyArray_DATA(ids), OWNER_RAW, &r) != 0:
            raise KvPoolExhausted(r.needed, r.free_seen)
        return ids

    def free(self, block_ids):
        """Give back blocks taken with ``allocate``.

        All or nothing: if any id is out of range or not currently held from
        ``allocate`` (or is named more often than it is held), ``ValueError``
        and nothing changes.
        """
        cdef cnp.ndarray ids
        cdef BlockReq r
        cdef Py_ssize_t failed
        cdef int rc
        if (cnp.PyArray_Check(block_ids)
                and cnp.PyArray_TYPE(<cnp.ndarray>block_ids) == cnp.NPY_INT32
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>block_ids)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>block_ids)):
            ids = <cnp.ndarray>block_ids      # what allocate() returned: no copy
        else:
            wide = np.asarray(block_ids)
            if wide.dtype.kind not in "iu":
                if wide.size == 0:
                    return
                raise TypeError(f"block_ids must be integers, got dtype {wide.dtype}")
            wide = wide.astype(np.int64).ravel()
            if wide.size and (wide.min() < 0 or wide.max() >= self.p.total):
                raise ValueError(f"block id out of range 0..{self.p.total - 1}")
            ids = wide.astype(np.int32)
        memset(&r, 0, sizeof(BlockReq))
        r.pool = self.p
        r.drop = <int32_t*>cnp.PyArray_DATA(ids)
        r.n_drop = cnp.PyArray_SIZE(ids)
        r.owner = OWNER_RAW
        rc = pools_update(&r, 1, &failed)
        if rc != 0:
            raise ValueError("block_ids names a block that is not held from allocate() "
                             f"(out of range 0..{self.p.total - 1}, a double free, or a "
                             "block a cache holds); nothing was given back")

    cdef int32_t _salt_id(self, salt) except -1:
        """A small id per distinct salt (None is 0), kept for the pool's life:
        entries compare salt ids exactly. Salts are None, str, bytes or int,
        whose hashing runs no Python code."""
        if salt is not None and type(salt) not in (str, bytes, int):
            raise TypeError(f"salt must be None, str, bytes or int, got {type(salt).__name__}")
        sid = self._salts.get(salt)
        if sid is None:
            sid = len(self._salts)
            if sid > INT32_MAX:
                raise ValueError("too many distinct salts")
            self._salts[salt] = sid
        return sid

    def publish(self, caches, tokens, *, salt=None):
        """Register the full blocks of one sequence in the prefix cache.

        ``caches`` are the sequence's layers (one or more pooled caches of
        this pool, of equal length); ``tokens`` the token ids of the
        positions whose K/V they hold (at most ``seq_len`` of them: the last
        sampled token of a generation has no K/V yet). Each full block of
        ``tokens`` is keyed by a chained hash over its parent's key, its token
        ids, the layer count and the salt, and stores the token ids to verify
        every later hit. A block position that is already published keeps the
        existing blocks (this sequence's copies stay private and are freed
        when it lets go). Published blocks are immutable: a cache that writes
        into one (after ``truncate``) copies it first. Returns the number of
        positions now published along this sequence's chain.
        """
        cdef tuple cl = tuple(caches)
        cdef Py_ssize_t n = len(cl), i, n_full, done
        cdef Cache** cs
        cdef int32_t** tables = NULL
        cdef uint64_t* keys = NULL
        cdef int32_t salt_id
        cdef Pool* p = self.p
        cdef cnp.ndarray toks = _token_ids(tokens, "tokens")
        cdef const int32_t* tp = <const int32_t*>cnp.PyArray_DATA(toks)
        if p.prefix == NULL:
            raise ValueError("this pool has no prefix cache: KvBlockPool(..., prefix_cache=True)")
        salt_id = self._salt_id(salt)
        if n == 0:
            raise ValueError("caches is empty")
        cs = _claim_all(cl, "caches")
        try:
            _check_same_geometry(cl, "caches")
            for i in range(n):
                if cs[i].pool != p:
                    raise ValueError(f"caches[{i}] is not a pooled cache of this pool")
                if cs[i].len != cs[0].len:
                    raise ValueError(f"caches[{i}] holds {cs[i].len} positions, caches[0] "
                                     f"{cs[0].len}: one sequence's layers have one length")
            if len(toks) > cs[0].len:
                raise ValueError(f"tokens has {len(toks)} ids for caches holding "
                                 f"{cs[0].len} positions")
            n_full = len(toks) // p.block_size
            tables = <int32_t**>malloc(<size_t>n * sizeof(int32_t*))
            keys = <uint64_t*>malloc(<size_t>(n_full + 1) * sizeof(uint64_t))
            if tables == NULL or keys == NULL:
                raise MemoryError()
            for i in range(n):
                tables[i] = cs[i].table
            with nogil:
                prefix_keys(tp, n_full, p.block_size, <int32_t>n, salt_id, keys)
                done = pool_publish(p, tables, <int32_t>n, keys, tp, n_full, salt_id)
            for i in range(n):
                if done > cs[i].shared_upto:
                    cs[i].shared_upto = done      # published: a write there copies first
        finally:
            free(tables)
            free(keys)
            _release_all(cs, n)
        if self._store is not None and done:
            from ferrox_kv.store._pool import write_through
            write_through(self, cl, toks[:done * p.block_size], salt)
        return done * p.block_size

    def _export_prefixes(self, n_layers=0):
        """Every published prefix entry of ``n_layers`` layers (0: the one
        layer count all entries have; ``ValueError`` when they have several),
        parents first: ``(n_layers, salts, parents, depths, tokens, k, v)``
        with ``parents[i] < i`` the index of entry i's parent (-1 at depth 0),
        ``tokens`` int32 ``(n, block_size)``, ``k``/``v`` uint8 ``(n,
        n_layers, block_size, row_bytes)``: the stored rows, copied into
        private buffers without the GIL while the pool lock is not held (the
        blocks are held meanwhile, so no entry is evicted or rewritten)."""
        cdef Pool* p = self.p
        cdef int32_t layers = <int32_t>_count(n_layers, "n_layers", 0)
        cdef Py_ssize_t n = 0, cap = p.total if p.total > 0 else 1
        cdef int32_t* order = NULL
        cdef int32_t* salt = NULL
        cdef int32_t* par = NULL
        cdef int32_t* dep = NULL
        cdef int32_t* tok = NULL
        cdef int32_t* ids = NULL
        cdef bint held = False
        cdef cnp.ndarray k, v, toks, parents, depths
        if p.prefix == NULL:
            raise ValueError("this pool has no prefix cache: KvBlockPool(..., prefix_cache=True)")
        try:
            order = <int32_t*>malloc(<size_t>cap * sizeof(int32_t))
            salt = <int32_t*>malloc(<size_t>cap * sizeof(int32_t))
            par = <int32_t*>malloc(<size_t>cap * sizeof(int32_t))
            dep = <int32_t*>malloc(<size_t>cap * sizeof(int32_t))
            tok = <int32_t*>malloc(<size_t>cap * <size_t>p.block_size * sizeof(int32_t))
            ids = <int32_t*>malloc(<size_t>cap * sizeof(int32_t))
            if not (order and salt and par and dep and tok and ids):
                raise MemoryError()
            with nogil:
                n = pool_export(p, &layers, order, salt, par, dep, tok, ids)
            if n < 0:
                raise ValueError("this pool's prefix entries were published with different "
                                 "layer counts: pass n_layers= to choose one")
            held = True
            if layers == 0:
                layers = 1              # an empty export
            toks = np.empty((n, p.block_size), np.int32)
            parents = np.empty(n, np.int32)
            depths = np.empty(n, np.int32)
            k = np.empty((n, layers, p.block_size, p.k_row), np.uint8)
            v = np.empty((n, layers, p.block_size, p.v_row), np.uint8)
            if n:
                memcpy(cnp.PyArray_DATA(toks), tok, <size_t>(n * p.block_size) * sizeof(int32_t))
                memcpy(cnp.PyArray_DATA(parents), par, <size_t>n * sizeof(int32_t))
                memcpy(cnp.PyArray_DATA(depths), dep, <size_t>n * sizeof(int32_t))
            with nogil:
                fx_copy_blocks(p.k_arena, p.k_block, ids, n * layers, 1,
                               <char*>cnp.PyArray_DATA(k), False)
                fx_copy_blocks(p.v_arena, p.v_block, ids, n * layers, 1,
                               <char*>cnp.PyArray_DATA(v), False)
            names = {sid: s for s, sid in self._salts.items()}
            salts = [names[salt[i]] for i in range(n)]
        finally:
            if held:
                with nogil:
                    pool_drop(p, ids, n * layers)
            free(order); free(salt); free(par); free(dep); free(tok); free(ids)
        return layers, salts, parents, depths, toks, k, v

    def _import_prefixes(self, n_layers, tokens, salts, parents, ks, vs=None, *,
                         bint fit=False):
        """Publish verified entries (``ferrox_kv.store``): entry i has token
        ids ``tokens[i]`` (int32 ``(n, block_size)``), salt ``salts[i]``,
        parent index ``parents[i] < i`` (-1 at depth 0) and stored rows
        ``ks[i]``/``vs[i]`` (C-contiguous uint8 ``(n_layers, block_size,
        row_bytes)``). Every block is reserved first: all or nothing
        (``KvPoolExhausted``, nothing changed), or with ``fit`` the leading
        entries that fit; an entry already published is kept, not
        duplicated. Rows are copied without the GIL, outside the lock.
        Returns ``(added, present, left_out)``.

        ``ks`` may instead be a callable (``vs`` None) that reads and
        verifies the rows: ``ks(i)`` returns entry i's ``(k, v)`` (views
        that may reuse the previous call's buffer), called once per entry
        in order after the blocks are reserved and before anything is
        published. Only a pool that can take every block from its free
        list, none of the entries published yet, is filled that way; else
        the result is None and nothing changed (read the rows first and pass
        them as arrays). An exception from ``ks`` gives back what was
        reserved, exactly (``stats()`` as before), and propagates."""
        cdef Pool* p = self.p
        cdef int32_t layers = <int32_t>_count(n_layers, "n_layers", 1)
        cdef Py_ssize_t n = len(salts), i, m = 0, nn = 0, bs = p.block_size, added = 0
        cdef cnp.ndarray toks, par
        cdef const int32_t* tp
        cdef const int32_t* pp
        cdef int32_t* sid = NULL
        cdef int32_t* ent = NULL
        cdef int32_t* slot = NULL
        cdef int32_t* share = NULL
        cdef int32_t* fresh = NULL
        cdef int32_t** tables = NULL
        cdef uint64_t* keys = NULL
        cdef char** kp = NULL
        cdef char** vp = NULL
        cdef char* kr
        cdef char* vr
        cdef BlockReq r
        cdef int rc
        cdef bint fill = callable(ks) and vs is None
        cdef Py_ssize_t high_water = 0
        if p.prefix == NULL:
            raise ValueError("this pool has no prefix cache: KvBlockPool(..., prefix_cache=True)")
        if layers < 1:
            raise ValueError("n_layers must be at least 1")
        toks = np.ascontiguousarray(tokens, np.int32)
        par = np.ascontiguousarray(parents, np.int32)
        if toks.ndim != 2 or toks.shape[0] != n or toks.shape[1] != bs:
            raise ValueError(f"tokens must be ({n}, {bs}) token ids, got shape {np.shape(toks)}")
        if par.ndim != 1 or par.shape[0] != n or (not fill and (len(ks) != n or len(vs) != n)):
            raise ValueError("tokens, salts, parents, ks and vs must have one item per entry")
        for i in range(n):
            if not -1 <= par[i] < i:
                raise ValueError(f"parents[{i}] = {par[i]}: a parent comes before its child")
            if not fill:
                _import_rows(ks[i], vs[i], i, layers, bs, p.k_row, p.v_row)
        if n == 0:
            return 0, 0, 0
        tp = <const int32_t*>cnp.PyArray_DATA(toks)
        pp = <const int32_t*>cnp.PyArray_DATA(par)
        try:
            sid = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
            ent = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
            slot = <int32_t*>malloc(<size_t>n * sizeof(int32_t))
            share = <int32_t*>malloc(<size_t>(n * layers) * sizeof(int32_t))
            fresh = <int32_t*>malloc(<size_t>(n * layers) * sizeof(int32_t))
            tables = <int32_t**>malloc(<size_t>layers * sizeof(int32_t*))
            keys = <uint64_t*>malloc(<size_t>n * sizeof(uint64_t))
            kp = <char**>malloc(<size_t>n * sizeof(char*))
            vp = <char**>malloc(<size_t>n * sizeof(char*))
            if not (sid and ent and slot and share and fresh and tables and keys and kp and vp):
                raise MemoryError()
            for i in range(n):
                sid[i] = self._salt_id(salts[i])
                if not fill:
                    kp[i] = <char*>cnp.PyArray_DATA(<cnp.ndarray>ks[i])
                    vp[i] = <char*>cnp.PyArray_DATA(<cnp.ndarray>vs[i])
            with nogil:
                for i in range(n):
                    keys[i] = fx_block_key(0 if pp[i] < 0 else keys[pp[i]], tp + i * bs, bs,
                                           <uint64_t>layers, <uint64_t>sid[i])
                rc = pool_import_reserve(p, layers, n, keys, tp, sid, pp, fit, ent, slot,
                                         share, fresh, &m, &nn, &r, fill, &high_water)
            if rc == FX_NOT_FREE:
                return None
            if rc == FX_EXHAUSTED:
                raise KvPoolExhausted(r.needed, r.free_seen)
            if rc != 0:
                raise RuntimeError("ferrox_kv: the prefix index names a block it does not hold")
            if fill:
                try:
                    for i in range(n):
                        pair = ks(i)
                        if type(pair) is not tuple or len(pair) != 2:
                            raise TypeError(f"the rows of entry {i} must be a (k, v) tuple")
                        k, v = pair
                        _import_rows(k, v, i, layers, bs, p.k_row, p.v_row)
                        if i < m and slot[i] >= 0:
                            kr = <char*>cnp.PyArray_DATA(<cnp.ndarray>k)
                            vr = <char*>cnp.PyArray_DATA(<cnp.ndarray>v)
                            with nogil:
                                fx_copy_blocks(p.k_arena, p.k_block, fresh + slot[i], layers,
                                               nn, kr, True)
                                fx_copy_blocks(p.v_arena, p.v_block, fresh + slot[i], layers,
                                               nn, vr, True)
                        del pair, k, v
                except BaseException:
                    with nogil:
                        pool_import_abort(p, fresh, nn * layers, high_water)
                    raise
            with nogil:
                if not fill:
                    for i in range(m):
                        if slot[i] >= 0:
                            fx_copy_blocks(p.k_arena, p.k_block, fresh + slot[i], layers, nn,
                                           kp[i], True)
                            fx_copy_blocks(p.v_arena, p.v_block, fresh + slot[i], layers, nn,
                                           vp[i], True)
                added = pool_import_publish(p, layers, m, nn, keys, tp, sid, pp, ent, slot,
                                            fresh, tables)
        finally:
            free(sid); free(ent); free(slot); free(share); free(fresh); free(tables)
            free(keys); free(kp); free(vp)
        return added, m - nn, n - m

    def _prefix_match(self, tokens, salt=None, n_layers=1):
        """How many leading full blocks of ``tokens`` are published under
        ``salt`` for ``n_layers`` layers (counts no hit or miss)."""
        cdef Pool* p = self.p
        cdef cnp.ndarray toks = _token_ids(tokens, "tokens")
        cdef int32_t layers = <int32_t>_count(n_layers, "n_layers", 1)
        cdef int32_t sid
        cdef Py_ssize_t nb = len(toks) // p.block_size, m = 0
        cdef const int32_t* tp = <const int32_t*>cnp.PyArray_DATA(toks)
        cdef uint64_t* keys = NULL
        cdef int32_t* out = NULL
        if p.prefix == NULL:
            raise ValueError("this pool has no prefix cache: KvBlockPool(..., prefix_cache=True)")
        sid = self._salt_id(salt)
        if nb == 0:
            return 0
        keys = <uint64_t*>malloc(<size_t>nb * sizeof(uint64_t))
        out = <int32_t*>malloc(<size_t>nb * sizeof(int32_t))
        try:
            if keys == NULL or out == NULL:
                raise MemoryError()
            with nogil:
                prefix_keys(tp, nb, p.block_size, layers, sid, keys)
                pthread_mutex_lock(&p.lock)
                m = prefix_match(p, keys, tp, nb, layers, sid, out)
                pthread_mutex_unlock(&p.lock)
        finally:
            free(keys)
            free(out)
        return m

    def save_prefixes(self, path, *, fingerprint, n_layers=None):
        """Write every published prefix entry to the prefix file ``path``
        (FORMAT.md), atomically; see ``ferrox_kv.store.save_prefixes``."""
        from ferrox_kv.store._pool import save_prefixes
        return save_prefixes(self, path, fingerprint=fingerprint, n_layers=n_layers)

    def load_prefixes(self, path, *, fingerprint):
        """Publish the entries of the prefix file ``path``, verified first;
        see ``ferrox_kv.store.load_prefixes``."""
        from ferrox_kv.store._pool import load_prefixes
        return load_prefixes(self, path, fingerprint=fingerprint)

    def attach(self, store):
        """Attach a prefix store (``ferrox_kv.store.RedisPrefixStore``), or
        detach with None: ``publish`` writes through to it, and a lookup with
        ``tokens=`` (``KvCache.with_pool``, ``with_pool_many``) reads the
        blocks missing locally through it first. Store faults are counted
        misses, never exceptions; ``stats()`` adds the store's counters under
        ``store_``."""
        from ferrox_kv.store._pool import check_store
        if self.p.prefix == NULL:
            raise ValueError("a store needs a pool with a prefix cache: "
                             "KvBlockPool(..., prefix_cache=True)")
        check_store(store)
        self._store = store

    @property
    def store(self):
        """The attached prefix store, or None."""
        return self._store

    def check(self):
        """Walk every invariant of the pool and raise ``RuntimeError`` naming
        the first broken one (a debugging aid; the tests call it after every
        step). Free list + cached + used = total; each block's reference
        count equals the number of cache table entries naming it (a raw
        allocation: exactly one); no id is on the free list twice; every
        prefix-cache entry owns its blocks, is found under its key, its key
        is that of the token ids it stores, and it is in the LRU list exactly
        when a block of its has no holder. Call it while no other thread is
        changing this pool's caches."""
        cdef Py_ssize_t where = 0
        cdef int rc
        with nogil:
            rc = pool_check(self.p, &where)
        if rc:
            raise RuntimeError(f"KvBlockPool.check: {_CHECK_MESSAGES[rc]} (at {where})")

    def __repr__(self):
        return (f"KvBlockPool(block_size={self.p.block_size}, "
                f"total_blocks={self.p.total}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}"
                f"{', prefix_cache=True' if self.p.prefix != NULL else ''}"
                f"{'' if self.p.dtype == FX_F32 else ', dtype=%r' % self.dtype}, "
                f"free_blocks={self.free_blocks})")
