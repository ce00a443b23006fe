# Calls over several caches at once: claiming them, the one write path that
# every append goes through, push_layers and the batch helper of
# ferrox_kv.hf.
#
# Hostile callers: a call first takes a private tuple of the caches it was
# given (another thread may mutate the caller's list), converts every array
# (which can run user code through __array__), and only then claims the
# caches and validates. The tuple keeps every cache alive while the GIL is
# released, and the claims keep any other call off them.

cdef Cache** _claim_all(tuple cl, str what) except NULL:
    """Claim every cache of ``cl`` for one call (``what`` empty: ``cl`` is the
    one cache a method was called on). ``TypeError`` for an item
    that is not a KvCache, ``ValueError`` for a cache named twice, closed or
    never initialised, ``RuntimeError`` when another thread is in a call on
    one. Returns their C structs; give them back with ``_release_all``."""
    cdef Py_ssize_t n = len(cl), i = 0, j
    cdef Cache** cs
    cdef KvCache x
    for j in range(n):
        if not isinstance(cl[j], KvCache):
            raise TypeError(f"{what}[{j}] is {type(cl[j]).__name__}, not KvCache")
    if not what:                       # a method of one cache: its own messages
        x = <KvCache>cl[0]
        _enter(x)
        cs = <Cache**>malloc(sizeof(Cache*))
        if cs == NULL:
            _leave(x)
            raise MemoryError()
        cs[0] = &x.c
        return cs
    cs = <Cache**>malloc(<size_t>(n if n > 0 else 1) * sizeof(Cache*))
    if cs == NULL:
        raise MemoryError()
    try:
        while i < n:
            x = <KvCache>cl[i]
            if not fx_try_claim(&x.c.busy):
                for j in range(i):
                    if cs[j] == &x.c:
                        raise ValueError(f"{what}[{i}] appears more than once in {what}")
                raise RuntimeError(_BUSY)
            cs[i] = &x.c
            i += 1
            if x.c.state != STATE_OPEN:
                raise ValueError(
                    f"{what}[{i - 1}]: {_CLOSED if x.c.state == STATE_CLOSED else _NEW}")
    except BaseException:
        for j in range(i):
            fx_unclaim(&cs[j].busy)
        free(cs)
        raise
    return cs


cdef void _release_all(Cache** cs, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        fx_unclaim(&cs[i].busy)
    free(cs)


cdef int _check_same_geometry(tuple cl, str what) except -1:
    cdef KvCache c0 = <KvCache>cl[0], ci
    cdef Py_ssize_t i
    for i in range(1, len(cl)):
        ci = <KvCache>cl[i]
        if ci.c.kw != c0.c.kw or ci.c.vw != c0.c.vw or ci.head_dim != c0.head_dim:
            raise ValueError(f"{what}[{i}] has another geometry than {what}[0]")
        if ci.c.dtype != c0.c.dtype:
            raise ValueError(f"{what}[{i}] stores {_dtype_label(ci.c.dtype)} and {what}[0] stores "
                             f"{_dtype_label(c0.c.dtype)}: one call takes caches of one dtype "
                             "(split the call by dtype)")
    return 0


# -- the write path ---------------------------------------------------------------

cdef int _append_each(tuple owners, Cache** cs, Py_ssize_t n, Py_ssize_t t,
                      const void* k_src, const void* v_src, int src) except -1:
    """Append ``t`` rows to each of ``n`` claimed, open caches of one geometry
    and dtype (``owners[i]`` is the KvCache of ``cs[i]``): rows ``i*t ..
    i*t+t-1`` of ``k_src``/``v_src`` (values of ``src``: FX_F32 / FX_F16 /
    FX_BF16) go to cache i, converted to its dtype, or SRC_STORED rows in
    the caches' own format; NULL sources append zeros. All or nothing:
    every buffer and block any cache needs is obtained before a row is
    written. The copies run in one loop, without
    the GIL when they pay."""
    cdef Py_ssize_t i
    cdef size_t item = _src_size(src)
    cdef size_t kw = <size_t>cs[0].kw * item, vw = <size_t>cs[0].vw * item   # bytes per row
    if src == SRC_STORED:
        kw = cs[0].k_row
        vw = cs[0].v_row
    cdef size_t kbytes = <size_t>(n * t) * kw
    cdef size_t vbytes = <size_t>(n * t) * vw
    cdef const char* kp = <const char*>k_src
    cdef const char* vp = <const char*>v_src
    cdef char* own = NULL
    if t == 0:
        return 0
    try:
        if kp != NULL:
            for i in range(n):
                if _aliases(cs[i], kp, kbytes) or _aliases(cs[i], vp, vbytes):
                    # the source is (or may be) the caches' own memory: copy it first
                    own = <char*>malloc(kbytes + vbytes)
                    if own == NULL:
                        raise MemoryError()
                    memcpy(own, kp, kbytes)
                    memcpy(own + kbytes, vp, vbytes)
                    kp = own
                    vp = own + kbytes
                    break
        for i in range(n):
            if (cs[i].len + t > cs[i].cap or not _private_at(cs[i], cs[i].len)
                    or _trim_due(cs[i])):
                _make_room_each(owners, cs, n, t)
                break
        if _release_pays(<Py_ssize_t>(kbytes + vbytes)):
            with nogil:
                for i in range(n):
                    cache_write(cs[i], cs[i].len, t, kp + i * t * kw if kp else NULL,
                                vp + i * t * vw if vp else NULL, src)
        else:
            for i in range(n):
                cache_write(cs[i], cs[i].len, t, kp + i * t * kw if kp else NULL,
                            vp + i * t * vw if vp else NULL, src)
        for i in range(n):
            cs[i].len += t
    finally:
        free(own)
    return 0


cdef Py_ssize_t _add_pool(BlockReq* reqs, Py_ssize_t n, Pool* p) noexcept:
    """Add ``p`` to the ``n`` requests (distinct pools, kept in address order:
    the order their locks are taken in) unless it is there; the new count."""
    cdef Py_ssize_t j
    for j in range(n):
        if reqs[j].pool == p:
            return n
    j = n
    while j > 0 and <size_t>reqs[j - 1].pool > <size_t>p:
        reqs[j] = reqs[j - 1]
        j -= 1
    memset(&reqs[j], 0, sizeof(BlockReq))
    reqs[j].pool = p
    reqs[j].owner = OWNER_CACHE
    return n + 1


cdef int _make_room_each(tuple owners, Cache** cs, Py_ssize_t n, Py_ssize_t t) except -1:
    """Make room for ``t`` more rows in each cache, and give each cache blocks
    of its own wherever its write range lies in blocks it shares (copy-on-
    write), all or nothing: new contiguous buffers are allocated and every
    pool's blocks taken in one acquisition (all pools or none) before
    anything changes. Contiguous caches grow to max(2 * cap, needed, 4).
    Windowed caches give back the blocks that left the window in the same
    acquisition, and grow to hold their reservation again (_window.pxi)."""
    cdef Py_ssize_t i, j, bs, lo, hi, need, n_cow = 0, n_pools = 0, n_fresh = 0, at
    cdef Py_ssize_t n_trim = 0, held
    cdef Py_ssize_t* grow = NULL       # per cache: blocks appended
    cdef Py_ssize_t* trim = NULL       # per cache: leading blocks (contiguous: rows) given
    #                                    back (windows)
    cdef int32_t* dropped = NULL       # those blocks, pool after pool
    cdef Py_ssize_t* cows = NULL       # per cache: table indices to copy-on-write
    cdef int32_t* cow_at = NULL        # those indices, cache after cache
    cdef int32_t* fresh = NULL
    cdef int32_t* old = NULL
    cdef Py_ssize_t* pool_of = NULL    # per cache: index into reqs
    cdef BlockReq* reqs = NULL
    cdef Py_ssize_t failed = 0
    cdef Cache* c
    cdef Pool* p
    cdef int32_t b
    cdef list rows = [None] * n
    try:
        grow = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        trim = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        cows = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        pool_of = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        reqs = <BlockReq*>calloc(<size_t>n, sizeof(BlockReq))
        if grow == NULL or trim == NULL or cows == NULL or pool_of == NULL or reqs == NULL:
            raise MemoryError()
        for i in range(n):             # bound the copy-on-write list
            c = cs[i]
            if not _private_at(c, c.len):
                n_cow += c.shared_upto - (c.len - c.base) // c.pool.block_size
        cow_at = <int32_t*>malloc(<size_t>(n_cow if n_cow > 0 else 1) * sizeof(int32_t))
        if cow_at == NULL:
            raise MemoryError()
        n_cow = 0
        # 1. plan each cache; contiguous buffers and block tables are allocated
        #    here (MemoryError leaves every cache as it was)
        for i in range(n):
            c = cs[i]
            need = c.len + t
            p = c.pool
            if p == NULL:
                if need > c.cap and c.window:      # the rows before the window stay behind
                    trim[i] = _trim_to(c, c.len) - c.base
                    rows[i] = _rows_new(max(2 * (need - c.base - trim[i]), 4), c)
                elif need > c.cap:
                    rows[i] = _rows_new(max(2 * (c.cap - c.base), need - c.base, 4), c)
                continue
            bs = p.block_size
            if c.window and (need > c.cap or _trim_due(c) or not _private_at(c, c.len)):
                # the blocks before the window go back
                trim[i] = (_trim_to(c, c.len) - c.base) // bs
                n_trim += trim[i]
                held = max(_blocks_for(need - c.base, bs), trim[i] + c.resv)
                grow[i] = max(held - c.n_blocks, 0)
            elif need > c.cap:
                grow[i] = _blocks_for(need - c.cap, bs)
            if grow[i]:
                if grow[i] - trim[i] > p.total:
                    raise KvPoolExhausted(grow[i] - trim[i], pool_refuse(p))
                _reserve_table(c, grow[i])
            if not _private_at(c, c.len):
                lo = (c.len - c.base) // bs
                hi = min(c.shared_upto, _blocks_for(need - c.base, bs), c.n_blocks)
                for j in range(lo, hi):
                    b = c.table[j]
                    if fx_load(&p.refs[b]) > 1 or (
                            p.prefix != NULL and fx_load(&p.prefix.blk_entry[b]) != 0):
                        cow_at[n_cow] = <int32_t>j
                        n_cow += 1
                        cows[i] += 1
            n_pools = _add_pool(reqs, n_pools, p)
        for i in range(n):             # each pooled cache's request, and its fresh blocks
            if cs[i].pool != NULL:
                for j in range(n_pools):
                    if reqs[j].pool == cs[i].pool:
                        pool_of[i] = j
                reqs[pool_of[i]].n_fresh += grow[i] + cows[i]
                reqs[pool_of[i]].n_drop += trim[i]
                reqs[pool_of[i]].window_drops = True     # its only drops: trims
                n_fresh += grow[i] + cows[i]
        # 2. every pool's blocks at once
        if n_pools:
            fresh = <int32_t*>malloc(<size_t>(n_fresh if n_fresh > 0 else 1) * sizeof(int32_t))
            old = <int32_t*>malloc(<size_t>(n_cow if n_cow > 0 else 1) * sizeof(int32_t))
            dropped = <int32_t*>malloc(<size_t>(n_trim if n_trim > 0 else 1) * sizeof(int32_t))
            if fresh == NULL or old == NULL or dropped == NULL:
                raise MemoryError()
            at = 0
            for j in range(n_pools):
                reqs[j].fresh = fresh + at
                at += reqs[j].n_fresh
            at = 0
            for j in range(n_pools):   # the blocks that left a window, pool after pool
                reqs[j].drop = dropped + at
                for i in range(n):
                    if trim[i] and cs[i].pool != NULL and pool_of[i] == j:
                        memcpy(dropped + at, cs[i].table, <size_t>trim[i] * sizeof(int32_t))
                        at += trim[i]
            with nogil:
                at = pools_update(reqs, n_pools, &failed)
            if at == FX_EXHAUSTED:
                raise KvPoolExhausted(reqs[failed].needed, reqs[failed].free_seen)
            if at != 0:
                raise RuntimeError("ferrox_kv: a pool refused ids it handed out")
        # 3. nothing below can fail
        for j in range(n_pools):
            reqs[j].n_fresh = 0        # cursor into reqs[j].fresh
        n_cow = 0
        at = 0                         # cursor into old
        for i in range(n):
            c = cs[i]
            if c.pool == NULL:
                if rows[i] is not None:
                    if c.len > c.base + trim[i]:
                        cache_gather(c, c.base + trim[i], c.len - c.base - trim[i],
                                     (<_Rows>rows[i]).k, (<_Rows>rows[i]).v, False)
                    c.base += trim[i]
                    (<KvCache>owners[i])._set_rows(<_Rows>rows[i])
                continue
            p = c.pool
            bs = p.block_size
            for j in range(cows[i]):
                lo = cow_at[n_cow]
                n_cow += 1
                b = reqs[pool_of[i]].fresh[reqs[pool_of[i]].n_fresh]
                reqs[pool_of[i]].n_fresh += 1
                if c.base + lo * bs < c.len:   # the rows kept before the write position
                    memcpy(p.k_arena + <size_t>b * p.k_block,
                           p.k_arena + <size_t>c.table[lo] * p.k_block,
                           <size_t>(c.len - c.base - lo * bs) * c.k_row)
                    memcpy(p.v_arena + <size_t>b * p.v_block,
                           p.v_arena + <size_t>c.table[lo] * p.v_block,
                           <size_t>(c.len - c.base - lo * bs) * c.v_row)
                old[at] = c.table[lo]
                at += 1
                c.table[lo] = b
            if not _private_at(c, c.len) and min(_blocks_for(c.len - c.base + t, bs),
                                                 c.n_blocks) >= c.shared_upto:
                c.shared_upto = (c.len - c.base) // bs   # the write range is all its own now
            if trim[i]:                # the blocks given back leave the table
                c.n_blocks -= trim[i]
                memmove(c.table, c.table + trim[i], <size_t>c.n_blocks * sizeof(int32_t))
                c.shared_upto = max(c.shared_upto - trim[i], 0)
                c.base += trim[i] * bs
            for j in range(grow[i]):
                c.table[c.n_blocks] = reqs[pool_of[i]].fresh[reqs[pool_of[i]].n_fresh]
                reqs[pool_of[i]].n_fresh += 1
                c.n_blocks += 1
            c.cap += grow[i] * bs
        # 4. let go of the shared blocks that were copied
        at = 0
        for i in range(n):
            if cows[i]:
                pool_drop(cs[i].pool, old + at, cows[i])
                at += cows[i]
    finally:
        free(grow)
        free(trim)
        free(dropped)
        free(cows)
        free(cow_at)
        free(fresh)
        free(old)
        free(pool_of)
        free(reqs)
    return 0


cdef int _append_rows(tuple cl, cnp.ndarray ka, cnp.ndarray va, int src, bint per_t) except -1:
    """push_layers (``per_t`` false: one row per cache, inputs (n, ...)) and
    _extend_each (``per_t`` true: T rows per cache, inputs (n, T, ...))."""
    cdef Py_ssize_t n = len(cl), t = 1
    cdef Cache** cs
    cdef KvCache c0
    if n == 0:
        raise ValueError("caches is empty")
    cs = _claim_all(cl, "caches")
    try:
        _check_same_geometry(cl, "caches")
        c0 = <KvCache>cl[0]
        lead_s = "B, T, " if per_t else "layers, "
        _check_rows(ka, 1 + per_t, c0.n_kv_heads, c0.head_dim, "k_steps", lead_s)
        _check_rows(va, 1 + per_t, c0.n_kv_heads, c0.v_head_dim, "v_steps", lead_s)
        if ka.shape[0] != n:
            raise ValueError(f"k_steps has {ka.shape[0]} rows for {n} caches")
        if va.shape[0] != n:
            raise ValueError(f"v_steps has {va.shape[0]} rows for {n} caches")
        if per_t:
            t = ka.shape[1]
            if va.shape[1] != t:
                raise ValueError(f"k_steps has {t} positions but v_steps has {va.shape[1]}")
        _append_each(cl, cs, n, t, cnp.PyArray_DATA(ka), cnp.PyArray_DATA(va), src)
    finally:
        _release_all(cs, n)
    return 0


def push_layers(caches, k_steps, v_steps):
    """Append one position to each of ``caches`` (one per layer) in one call.

    ``k_steps`` is shaped ``(layers, n_kv_heads, head_dim)`` or
    ``(layers, n_kv_heads * head_dim)``, row ``i`` going to ``caches[i]``;
    ``v_steps`` likewise with ``v_head_dim``. Every cache must have the same
    geometry. All or nothing: the blocks every pooled cache needs are taken
    (from every pool involved at once) before any row is copied; if a pool
    cannot supply them, ``KvPoolExhausted`` reports that pool's shortfall and
    nothing changes. The copies of all layers run in one C loop, with the
    GIL released once when the bytes of all layers together pay for it: this
    is the decode step's coarse call, the one that lets request threads run
    in parallel.
    """
    cdef tuple cl = tuple(caches)          # a private sequence, before any user code
    ka, va, src = _rows_pair(k_steps, v_steps, "k_steps", "v_steps")
    _append_rows(cl, ka, va, src, False)


def _extend_each(caches, k_steps, v_steps):
    """Append T positions to each of ``caches`` (a batch of sequences of one
    layer): ``k_steps`` shaped ``(B, T, n_kv_heads, head_dim)`` or
    ``(B, T, n_kv_heads * head_dim)``. All or nothing across the batch, as
    ``push_layers``. For ``ferrox_kv.hf``."""
    cdef tuple cl = tuple(caches)
    ka, va, src = _rows_pair(k_steps, v_steps, "k_steps", "v_steps")
    _append_rows(cl, ka, va, src, True)


# -- rows of one cache into another: reorders, forks ---------------------------------

def _assign(caches, sources):
    """``caches[i]`` takes the rows of ``caches[sources[i]]`` for every i with
    ``sources[i] != i``, all at once (every source is read as it was before
    the call). For beams (``reorder_cache``), batch selection and forks.

    Pooled caches (all on one pool) share the source's full blocks (one more
    reference each) and get blocks of their own for the source's partly
    filled tail and for their reservation: ``max(their own blocks, the
    source's)``. Their old blocks are let go in the same step, which may
    supply the new ones: one all-or-nothing change of the pool
    (``KvPoolExhausted``, nothing changed). Contiguous caches copy rows.
    """
    cdef tuple cl = tuple(caches)
    cdef Py_ssize_t n = len(cl), i
    src = [_index(s, "sources[i]") for s in sources]   # user code, before any claim
    if len(src) != n:
        raise ValueError(f"sources has {len(src)} entries for {n} caches")
    for i in range(n):
        if not 0 <= src[i] < n:
            raise ValueError(f"sources[{i}] = {src[i]} is out of range for {n} caches")
    if n == 0:
        return
    cdef Cache** cs = _claim_all(cl, "caches")
    cdef Py_ssize_t* order = <Py_ssize_t*>malloc(<size_t>n * sizeof(Py_ssize_t))
    try:
        if order == NULL:
            raise MemoryError()
        _check_same_geometry(cl, "caches")
        for i in range(n):
            order[i] = src[i]
            if (cs[i].pool == NULL) != (cs[0].pool == NULL) or cs[i].pool != cs[0].pool:
                raise ValueError("caches must all be contiguous or all on one pool")
            if cs[i].window != cs[order[i]].window:
                raise ValueError(f"caches[{i}] has window {cs[i].window or None} and its "
                                 f"source caches[{order[i]}] {cs[order[i]].window or None}: "
                                 "rows move only between caches of one sliding window")
        if cs[0].pool != NULL:
            _assign_blocks(cs, order, n)
        else:
            _assign_rows(cl, cs, order, n)
    finally:
        free(order)
        _release_all(cs, n)


cdef int _assign_blocks(Cache** cs, const Py_ssize_t* order, Py_ssize_t n) except -1:
    """_assign for caches on one pool: snapshot what every source holds, then
    one pools_update (shares, the targets' old blocks, fresh blocks), then
    the new tables and the tail rows."""
    cdef Pool* p = cs[0].pool
    cdef Py_ssize_t bs = p.block_size
    cdef size_t kw = cs[0].k_row, vw = cs[0].v_row       # stored bytes per row
    cdef Py_ssize_t i, s, full, tail, failed = 0
    cdef Py_ssize_t n_share = 0, n_drop = 0, n_fresh = 0, n_tail = 0
    cdef Py_ssize_t* n_new = NULL          # per target: blocks after the change
    cdef Py_ssize_t* src_len = NULL        # per target: its source's rows held now
    cdef Py_ssize_t* src_base = NULL       # per target: its source's first position
    cdef int32_t* share = NULL
    cdef int32_t* drop = NULL
    cdef int32_t* fresh = NULL
    cdef char* tails = NULL                # per target: source tail, K rows then V rows
    cdef BlockReq r
    cdef int rc
    cdef Cache* c
    try:
        n_new = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        src_len = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        src_base = <Py_ssize_t*>calloc(<size_t>n, sizeof(Py_ssize_t))
        if n_new == NULL or src_len == NULL or src_base == NULL:
            raise MemoryError()
        for i in range(n):                 # sizes, and table room (MemoryError only)
            s = order[i]
            if s == i:
                continue
            src_len[i] = cs[s].len - cs[s].base
            src_base[i] = cs[s].base
            full = src_len[i] // bs
            tail = src_len[i] - full * bs
            n_new[i] = max(cs[i].n_blocks, cs[s].n_blocks, full + (tail > 0))
            n_share += full
            n_drop += cs[i].n_blocks
            n_fresh += n_new[i] - full
            n_tail += tail
            _reserve_table(cs[i], n_new[i] - cs[i].n_blocks)
        share = <int32_t*>malloc(<size_t>(n_share + 1) * sizeof(int32_t))
        drop = <int32_t*>malloc(<size_t>(n_drop + 1) * sizeof(int32_t))
        fresh = <int32_t*>malloc(<size_t>(n_fresh + 1) * sizeof(int32_t))
        tails = <char*>malloc(<size_t>n_tail * (kw + vw) + 1)
        if share == NULL or drop == NULL or fresh == NULL or tails == NULL:
            raise MemoryError()
        n_share = n_drop = n_tail = 0
        for i in range(n):                 # snapshot: full blocks, old tables, tail rows
            s = order[i]
            if s == i:
                continue
            full = src_len[i] // bs
            tail = src_len[i] - full * bs
            memcpy(share + n_share, cs[s].table, <size_t>full * sizeof(int32_t))
            n_share += full
            memcpy(drop + n_drop, cs[i].table, <size_t>cs[i].n_blocks * sizeof(int32_t))
            n_drop += cs[i].n_blocks
            cache_gather(cs[s], src_base[i] + full * bs, tail, tails + <size_t>n_tail * (kw + vw),
                         tails + <size_t>n_tail * (kw + vw) + <size_t>tail * kw, False)
            n_tail += tail
        memset(&r, 0, sizeof(BlockReq))
        r.pool = p
        r.share = share
        r.n_share = n_share
        r.drop = drop
        r.n_drop = n_drop
        r.fresh = fresh
        r.n_fresh = n_fresh
        r.owner = OWNER_CACHE
        with nogil:
            rc = pools_update(&r, 1, &failed)
        if rc == FX_EXHAUSTED:
            raise KvPoolExhausted(r.needed, r.free_seen)
        if rc != 0:
            raise RuntimeError("ferrox_kv: a block table names a block it does not hold")
        # nothing below can fail
        for i in range(n):                 # a source that stays shares its full blocks now
            s = order[i]
            if s != i and order[s] == s and src_len[i] // bs > cs[s].shared_upto:
                cs[s].shared_upto = src_len[i] // bs
        n_share = n_fresh = n_tail = 0
        for i in range(n):
            s = order[i]
            if s == i:
                continue
            c = cs[i]
            full = src_len[i] // bs
            tail = src_len[i] - full * bs
            memcpy(c.table, share + n_share, <size_t>full * sizeof(int32_t))
            n_share += full
            memcpy(c.table + full, fresh + n_fresh, <size_t>(n_new[i] - full) * sizeof(int32_t))
            n_fresh += n_new[i] - full
            c.n_blocks = n_new[i]
            c.base = src_base[i]
            c.cap = c.base + n_new[i] * bs
            c.shared_upto = full
            cache_write(c, c.base + full * bs, tail, tails + <size_t>n_tail * (kw + vw),
                        tails + <size_t>n_tail * (kw + vw) + <size_t>tail * kw, SRC_STORED)
            n_tail += tail
            c.len = c.base + src_len[i]
    finally:
        free(n_new)
        free(src_len)
        free(src_base)
        free(share)
        free(drop)
        free(fresh)
        free(tails)
    return 0


cdef int _assign_rows(tuple cl, Cache** cs, const Py_ssize_t* order, Py_ssize_t n) except -1:
    """_assign for contiguous caches: the sources' rows are copied out first,
    new buffers allocated where a target is too small, then rows written."""
    cdef Py_ssize_t i, s
    cdef dict snap = {}
    cdef list rows = [None] * n
    cdef _Rows r
    for i in range(n):
        s = order[i]
        if s == i:
            continue
        if s not in snap:
            r = _rows_new(cs[s].len - cs[s].base, cs[s])
            _gather_rows(cs[s], cs[s].len - cs[s].base, r.k, r.v)
            snap[s] = (r, cs[s].base, cs[s].len)
        if cs[i].cap - cs[i].base < cs[s].len - cs[s].base:
            rows[i] = _rows_new(cs[s].len - cs[s].base, cs[i])
    for i in range(n):                     # nothing below can fail
        s = order[i]
        if s == i:
            continue
        r, base, length = snap[s]
        cs[i].cap += base - cs[i].base     # the same buffer, from the source's base
        cs[i].base = base
        if rows[i] is not None:
            (<KvCache>cl[i])._set_rows(<_Rows>rows[i])
        cs[i].len = base
        cache_write(cs[i], base, length - base, r.k, r.v, SRC_STORED)
        cs[i].len = length
    return 0
