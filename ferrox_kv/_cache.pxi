# Row storage, the row copies, and KvCache.

@cython.final
@cython.no_gc
cdef class _Rows:
    """One buffer (``fx_big_alloc``): ``cap`` K rows followed by ``cap`` V
    rows. Views of a contiguous cache keep exactly the buffer they show alive."""

    def __cinit__(self):
        self.k = NULL
        self.v = NULL
        self.cap = 0
        self.nbytes = 0

    def __dealloc__(self):
        fx_big_free(self.k, self.nbytes)
        self.k = NULL
        self.v = NULL


cdef _Rows _rows_new(Py_ssize_t cap, Cache* c):
    """A buffer of ``cap`` rows of ``c``'s stored format."""
    cdef size_t nbytes
    if (fx_mul(<size_t>cap, c.k_row + c.v_row, &nbytes) or nbytes > _MAX_BYTES):
        raise ValueError(f"capacity {cap} x {c.k_row + c.v_row} bytes overflows the byte count")
    cdef _Rows r = _Rows.__new__(_Rows)
    r.k = <char*>fx_big_alloc(nbytes, False)
    if r.k == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes for {cap} KV rows")
    r.nbytes = nbytes
    r.v = r.k + <size_t>cap * c.k_row
    r.cap = cap
    return r


# -- where rows live ------------------------------------------------------------
#
# Rows are numbered by position. A cache holds positions base..len-1 (base is
# 0 unless a sliding window gave earlier rows back, _window.pxi): row r lives
# at k + (r - base) * k_row, or in block table[(r - base) // block_size].

cdef inline char* _k_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.k + <size_t>(r - c.base) * c.k_row
    return (p.k_arena + <size_t>c.table[(r - c.base) // p.block_size] * p.k_block
            + <size_t>(r % p.block_size) * c.k_row)


cdef inline char* _v_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.v + <size_t>(r - c.base) * c.v_row
    return (p.v_arena + <size_t>c.table[(r - c.base) // p.block_size] * p.v_block
            + <size_t>(r % p.block_size) * c.v_row)


cdef inline Py_ssize_t _run(Cache* c, Py_ssize_t r, Py_ssize_t end) noexcept nogil:
    """How many rows from ``r`` (before ``end``) are contiguous in memory."""
    cdef Py_ssize_t n
    if c.pool == NULL:
        return end - r
    n = c.pool.block_size - r % c.pool.block_size
    return n if n < end - r else end - r


cdef inline bint _private_at(Cache* c, Py_ssize_t r) noexcept nogil:
    """Whether row ``r`` lies in a block only this cache holds (always for a
    contiguous cache): a write there needs no copy-on-write."""
    return c.shared_upto == 0 or r - c.base >= c.shared_upto * c.pool.block_size


cdef inline bint _aliases(Cache* c, const void* src, size_t nbytes) noexcept nogil:
    """Whether ``src`` overlaps memory that a write into ``c`` may touch: its
    buffer, or its pool's arenas (a source there is copied first)."""
    cdef Pool* p = c.pool
    if p == NULL:
        return fx_overlap(src, nbytes, c.k, <size_t>(c.cap - c.base) * (c.k_row + c.v_row))
    return (fx_overlap(src, nbytes, p.k_arena, <size_t>p.total * p.k_block)
            or fx_overlap(src, nbytes, p.v_arena, <size_t>p.total * p.v_block))


cdef inline void _write_run(Cache* c, char* dst, size_t dst_row, const void* src, int nh,
                            int d, Py_ssize_t m, int kind) noexcept nogil:
    """m rows of ``kind`` (FX_F32 / FX_F16 / FX_BF16 values, or SRC_STORED
    rows of c's own format) into stored rows at ``dst``; NULL: zeros."""
    cdef size_t w = <size_t>nh * <size_t>d
    if src == NULL:
        memset(dst, 0, <size_t>m * dst_row)
    elif kind == SRC_STORED or (kind == c.dtype and kind != FX_I8):
        memcpy(dst, src, <size_t>m * dst_row)
    elif kind == FX_F32:
        fx_rows_from_f32(dst, dst_row, <const float*>src, w, m, nh, d, c.dtype)
    else:
        fx_rows_from_half(dst, dst_row, <const uint16_t*>src, w, m, nh, d, kind, c.dtype)


cdef inline size_t _src_row(Cache* c, Py_ssize_t w, size_t stored, int kind) noexcept nogil:
    """Bytes between source rows of ``kind`` (``stored``: c's own row)."""
    if kind == SRC_STORED:
        return stored
    return <size_t>w * (4 if kind == FX_F32 else 2)


cdef void cache_write(Cache* c, Py_ssize_t start, Py_ssize_t n,
                      const void* k, const void* v, int src) noexcept nogil:
    """Write ``n`` K and V rows (row-major, ``src``: FX_F32 / FX_F16 /
    FX_BF16 values converted to the cache's dtype in the copy loop, or
    SRC_STORED rows in its own format) into positions start..start+n; NULL
    sources write zeros. Sources never overlap the destination (callers copy
    aliasing sources first)."""
    cdef Py_ssize_t r = start, end = start + n, m
    cdef size_t ks = _src_row(c, c.kw, c.k_row, src), vs = _src_row(c, c.vw, c.v_row, src)
    while r < end:
        m = _run(c, r, end)
        _write_run(c, _k_row(c, r), c.k_row, k, c.nh, c.hd, m, src)
        _write_run(c, _v_row(c, r), c.v_row, v, c.nh, c.vhd, m, src)
        if k != NULL:
            k = <const char*>k + <size_t>m * ks
            v = <const char*>v + <size_t>m * vs
        r += m


cdef void cache_gather(Cache* c, Py_ssize_t start, Py_ssize_t n,
                       void* k_out, void* v_out, bint to_f32) noexcept nogil:
    """Copy positions start..start+n into contiguous K and V outputs: the
    stored rows as they are, or with ``to_f32`` their float32 values.
    Either output may be NULL to skip it."""
    cdef Py_ssize_t r = start, end = start + n, m
    cdef char* ko = <char*>k_out
    cdef char* vo = <char*>v_out
    while r < end:
        m = _run(c, r, end)
        if ko != NULL:
            if to_f32:
                fx_rows_to_f32(<float*>ko, <size_t>c.kw, _k_row(c, r), c.k_row, m, c.nh, c.hd,
                               c.dtype)
                ko += <size_t>m * <size_t>c.kw * sizeof(float)
            else:
                memcpy(ko, _k_row(c, r), <size_t>m * c.k_row)
                ko += <size_t>m * c.k_row
        if vo != NULL:
            if to_f32:
                fx_rows_to_f32(<float*>vo, <size_t>c.vw, _v_row(c, r), c.v_row, m, c.nh, c.vhd,
                               c.dtype)
                vo += <size_t>m * <size_t>c.vw * sizeof(float)
            else:
                memcpy(vo, _v_row(c, r), <size_t>m * c.v_row)
                vo += <size_t>m * c.v_row
        r += m


cdef void _gather_rows(Cache* c, Py_ssize_t n, void* k_out, void* v_out,
                       bint to_f32=False) noexcept:
    """The first n rows held (from position ``base``) into contiguous outputs
    (either may be NULL), without the GIL when the bytes pay for it."""
    cdef size_t width = (c.k_row if k_out != NULL else 0) + (c.v_row if v_out != NULL else 0)
    if _release_pays(n * <Py_ssize_t>width):
        with nogil:
            cache_gather(c, c.base, n, k_out, v_out, to_f32)
    else:
        cache_gather(c, c.base, n, k_out, v_out, to_f32)


cdef void cache_detach(Cache* c) noexcept nogil:
    """Give every block back and drop the pool reference (pooled caches)."""
    if c.pool != NULL:
        _pool_unlink(c.pool, c)
        pool_drop(c.pool, c.table, c.n_blocks)
        pool_decref(c.pool)
        c.pool = NULL
    free(c.table)
    c.table = NULL
    c.n_blocks = 0
    c.table_cap = 0
    c.shared_upto = 0


cdef int _reserve_table(Cache* c, Py_ssize_t n) except -1:
    """Make room in the block table for ``n`` more ids (MemoryError if not)."""
    cdef Py_ssize_t want = c.n_blocks + n, new_cap
    cdef int32_t* t
    if want <= c.table_cap:
        return 0
    new_cap = c.table_cap * 2
    if new_cap < want:
        new_cap = want
    t = <int32_t*>realloc(c.table, <size_t>new_cap * sizeof(int32_t))
    if t == NULL:
        raise MemoryError("cannot grow the block table")
    c.table = t
    c.table_cap = new_cap
    return 0


cdef inline Py_ssize_t _blocks_for(Py_ssize_t rows, Py_ssize_t bs) noexcept nogil:
    return (rows + bs - 1) // bs


# -- claiming a cache for one call ----------------------------------------------

cdef str _BUSY = ("KvCache is in use by another thread; a cache must not be "
                  "used from two threads at once (guard it with a lock)")
cdef str _NEW = ("KvCache was never initialised: its __init__ did not run (a "
                 "subclass's __init__ must call super().__init__(n_kv_heads, "
                 "head_dim, ...)); use KvCache(...), with_capacity or with_pool")
cdef str _CLOSED = "KvCache is closed"


cdef inline int _enter(KvCache self) except -1:
    """Claim an open cache for this call: ``RuntimeError`` while another
    thread is in a call on it, ``ValueError`` when it is closed or was never
    initialised. Pair with ``_leave`` in a ``finally``."""
    if not fx_try_claim(&self.c.busy):
        raise RuntimeError(_BUSY)
    if self.c.state != STATE_OPEN:
        fx_unclaim(&self.c.busy)
        raise ValueError(_CLOSED if self.c.state == STATE_CLOSED else _NEW)
    return 0


cdef inline void _leave(KvCache self) noexcept:
    fx_unclaim(&self.c.busy)


cdef int _check_pool_geometry(KvCache c, KvBlockPool pool) except -1:
    if c.c.dtype != pool.p.dtype:
        raise ValueError(f"dtype={_dtype_label(c.c.dtype)!r} does not match the pool's dtype "
                         f"{_dtype_label(pool.p.dtype)!r}: a pooled cache stores what its pool "
                         "stores (leave dtype out to take the pool's)")
    if (c.n_kv_heads, c.head_dim, c.v_head_dim) != (
            pool.n_kv_heads, pool.head_dim, pool.v_head_dim):
        raise ValueError(
            f"cache geometry (n_kv_heads={c.n_kv_heads}, head_dim={c.head_dim}, "
            f"v_head_dim={c.v_head_dim}) does not match the pool's "
            f"(n_kv_heads={pool.n_kv_heads}, head_dim={pool.head_dim}, "
            f"v_head_dim={pool.v_head_dim})")
    return 0


# -- pooled caches of one sequence, reserved at once (with_pool, with_pool_many) ------

cdef list _new_pooled(Py_ssize_t count, n_kv_heads, head_dim, v_head_dim,
                      KvBlockPool pool, max_seq_len, tokens=None, salt=None, dtype=None,
                      window=None, max_chunk=None):
    """``count`` pooled caches of one geometry (one sequence's layers), each
    reserving max(1, ceil(max_seq_len / block_size)) blocks, in one
    acquisition; with a ``window`` (one for all, or one entry per cache:
    _window_each), a windowed cache at most what its window needs
    (_window.pxi). With ``tokens``, the longest published prefix of them
    (whole blocks, at most len(tokens) - 1 positions, this salt and layer
    count) is shared instead of reserved anew, and the caches start holding
    it."""
    cdef KvCache proto = KvCache.__new__(KvCache)
    proto._set_geometry(n_kv_heads, head_dim, v_head_dim,
                        pool.dtype if dtype is None else dtype)
    if proto.c.dtype == FX_I4H and pool.p.dtype == FX_I4:
        proto.c.dtype = FX_I4      # "int4" takes the pool's rotate= (the same row bytes)
    cdef Py_ssize_t max_len = _count(max_seq_len, "max_seq_len", 0)
    _check_pool_geometry(proto, pool)
    cdef Pool* p = pool.p
    cdef Py_ssize_t bs = p.block_size, full = max(_blocks_for(max_len, bs), 1), i, m_max = 0
    cdef Py_ssize_t m = 0, nb, per, each, total = 0, at = 0, win = 0, mc
    cdef list wins = _window_each(window, count, max_chunk, tokens)
    if wins is None:
        win = _window_arg(window, max_chunk, tokens, bs)
    elif count and all(w == wins[0] for w in wins):
        win = wins[0]                  # one window for all: the uniform path below
        wins = None
    mc = _count(max_chunk, "max_chunk", 1) if max_chunk is not None else bs
    # uniform (every cache the same window: ``each`` blocks, nothing sized
    # by count before the pool says it fits) keeps the prefix lookup's
    # layout, one stride per cache; else ``pers``, each cache's blocks
    cdef bint uniform = wins is None
    each = _reserved_blocks(full, win, mc, bs)
    cdef list pers = None if uniform else [_reserved_blocks(full, w, mc, bs) for w in wins]
    cdef int32_t salt_id = 0
    cdef list out = []
    cdef KvCache c
    cdef Cache* cc
    cdef int32_t* ids = NULL
    cdef int32_t* scratch = NULL
    cdef uint64_t* keys = NULL
    cdef const int32_t* tp = NULL
    cdef BlockReq r
    cdef int rc
    cdef cnp.ndarray toks = None
    cdef bint lookup = tokens is not None   # a hit or a miss, even of 0 whole blocks
    if tokens is not None:
        if p.prefix == NULL:
            raise ValueError("tokens= needs a pool with a prefix cache: "
                             "KvBlockPool(..., prefix_cache=True)")
        toks = _token_ids(tokens, "tokens")
        salt_id = pool._salt_id(salt)
        m_max = max(len(toks) - 1, 0) // bs
        tp = <const int32_t*>cnp.PyArray_DATA(toks)
    elif salt is not None:
        raise ValueError("salt= goes with tokens=")
    if count == 0:
        return out
    # before sizing memory, before any store read
    if uniform:
        if count > p.total // each:
            raise KvPoolExhausted(each * <object>count, pool_refuse(p))
        total = each * count
    else:
        for i in range(count):
            total += <Py_ssize_t>pers[i]
            if total > p.total:
                raise KvPoolExhausted(sum(pers), pool_refuse(p))
    # blocks missing here are read through the store only while the whole
    # reservation fits in the free blocks without counting any sharing: a
    # request refused (for good or for now) never fetched, imported or evicted
    store = pool._store                    # read once: another thread may detach it
    if m_max and store is not None and pool_free_count(p) >= total:
        store.before_lookup(pool, toks[:min(m_max, p.total) * bs], salt, count)
    if m_max > p.total:
        m_max = p.total
    nb = max(each, m_max)
    for i in range(count):                 # tables first: only MemoryError can fail
        c = KvCache.__new__(KvCache)
        c._copy_geometry(proto)
        _reserve_table(&c.c, nb if uniform else <Py_ssize_t>pers[i])
        out.append(c)
    try:
        # uniform: cache i's ids at i * nb; else one run of ``total`` fresh
        # blocks, cache after cache
        ids = <int32_t*>malloc(<size_t>(nb * count if uniform else total) * sizeof(int32_t))
        scratch = <int32_t*>malloc(<size_t>((m_max * (count + 1) + count * nb) if uniform
                                            else total) * sizeof(int32_t) + sizeof(int32_t))
        keys = <uint64_t*>malloc(<size_t>(m_max + 1) * sizeof(uint64_t))
        if ids == NULL or scratch == NULL or keys == NULL:
            raise MemoryError()
        with nogil:
            if m_max:
                prefix_keys(tp, m_max, bs, <int32_t>count, salt_id, keys)
            if uniform:
                rc = pool_reserve(p, keys if lookup else NULL, tp, m_max, <int32_t>count,
                                  salt_id, each, ids, nb, scratch, &m, &r)
            else:
                rc = pool_reserve(p, NULL, NULL, 0, 1, 0, total, ids, total, scratch, &m, &r)
        if rc == FX_EXHAUSTED:
            raise KvPoolExhausted(r.needed, r.free_seen)
        if rc != 0:
            raise RuntimeError("ferrox_kv: the prefix index names a block it does not hold")
        for i in range(count):
            c = <KvCache>out[i]
            if uniform:
                per = max(each, m)
                memcpy(c.c.table, ids + i * nb, <size_t>per * sizeof(int32_t))
                c.c.len = m * bs
                c.c.shared_upto = m
            else:
                per = pers[i]
                memcpy(c.c.table, ids + at, <size_t>per * sizeof(int32_t))
                at += per
            pool_incref(p)
            c.c.pool = p
            c.c.n_blocks = per
            c.c.cap = per * bs
            c.c.window = win if uniform else <Py_ssize_t>wins[i]
            c.c.resv = per if c.c.window else 0
            cc = &c.c
            pool_link(p, &cc, 1)
    finally:
        free(ids)
        free(scratch)
        free(keys)
    return out
