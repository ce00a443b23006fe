# Everything ferrox_kv.store needs from the core: a pool's published prefix
# entries out (io_export: held under the lock, copied outside it), verified
# entries in (io_import: reserved under the lock, filled outside it,
# published under it again) and the length of the published prefix of a
# token sequence (io_match). KvBlockPool's _export_prefixes,
# _import_prefixes, _import_prefixes_streamed and _prefix_match call them.
# The core never imports the store: the store calls these.

cdef Py_ssize_t pool_export(Pool* p, int32_t* layers, int32_t* order, int32_t* salt,
                            int32_t* parent, int32_t* depth, int32_t* tokens,
                            int32_t* ids) noexcept nogil:
    """Every published entry of ``layers[0]`` layers (0: the layer count that
    every entry has; -1 returned when they have several), parents first
    (breadth-first from the roots): its salt id, its parent's index (-1 for
    a root), depth, token ids and blocks (``ids[i * layers + j]``: layer j's
    block of entry i). Each block gets one more holder, so that nothing
    evicts or rewrites it until pool_drop(ids). Returns the count (FX_BAD_IDS:
    the index names a block it does not hold; nothing held). The arrays
    hold ``total`` entries (``tokens``: ``total * block_size``)."""
    cdef Prefix* x = p.prefix
    cdef int32_t L = layers[0], e, c, b, j
    cdef Py_ssize_t n = 0, head = 0, i, bs = p.block_size
    cdef BlockReq r
    cdef int rc
    pthread_mutex_lock(&p.lock)
    for e in range(1, x.next_entry):
        if x.e_layers[e] == 0:
            continue
        if L == 0:
            L = x.e_layers[e]
        elif x.e_layers[e] != L:
            if layers[0] == 0:
                pthread_mutex_unlock(&p.lock)
                return -1
            continue
        if x.e_parent[e] == 0:
            order[n] = e
            parent[n] = -1
            depth[n] = 0
            n += 1
    while head < n:                 # children share their parent's layer count
        c = x.e_child[order[head]]
        while c != 0:
            order[n] = c
            parent[n] = <int32_t>head
            depth[n] = depth[head] + 1
            n += 1
            c = x.e_sib_next[c]
        head += 1
    for i in range(n):
        e = order[i]
        salt[i] = x.e_salt[e]
        memcpy(tokens + i * bs, x.e_tokens + <size_t>e * <size_t>bs, <size_t>bs * sizeof(int32_t))
        b = x.e_first[e]
        for j in range(L):
            ids[i * L + j] = b
            b = x.blk_next[b] - 1
    memset(&r, 0, sizeof(BlockReq))
    r.pool = p
    r.share = ids
    r.n_share = n * L
    r.owner = OWNER_CACHE
    rc = _req_check(&r)            # published blocks: held or cached, so it passes
    if rc == 0:
        _req_apply(&r)
    pthread_mutex_unlock(&p.lock)
    layers[0] = L
    return n if rc == 0 else FX_BAD_IDS


cdef int pool_import_reserve(Pool* p, Import* t, bint fit, bint only_free) noexcept nogil:
    """Reserve the blocks of ``t.n`` entries (parents first: ``t.parent[i] <
    i``, -1 for a root), in one locked step. An entry already published (the
    same key, parent, salt, layer count and token ids) is held, not
    duplicated: ``t.ent[i]`` its entry id, ``t.slot[i]`` -1; a new one gets
    ``t.layers`` fresh blocks: ``t.slot[i] = s``, its layer j block
    ``t.fresh[j * t.n_new + s]``. All ``t.n`` or nothing (FX_EXHAUSTED,
    ``t.req`` says by how much); with ``fit``, the leading entries that fit
    (``t.taken``). Held until pool_import_publish. With ``only_free``, an
    entry already published or a block that only an eviction could supply is
    FX_NOT_FREE (nothing changed, no refusal counted): what such a
    reservation takes, pool_import_abort gives back exactly."""
    cdef Prefix* x = p.prefix
    cdef BlockReq* r = &t.req
    cdef Py_ssize_t i, m = 0, nn = 0, ns = 0, cost, spent = 0, avail
    cdef int32_t e, b, j, layers = t.layers
    cdef int rc
    pthread_mutex_lock(&p.lock)
    t.high_water = p.high_water
    avail = p.total - p.n_used
    for i in range(t.n):
        e = 0
        if t.parent[i] < 0 or t.slot[t.parent[i]] < 0:
            e = _find(p, t.keys[i], 0 if t.parent[i] < 0 else t.ent[t.parent[i]], t.salt[i],
                      layers, t.tokens + i * p.block_size)
        cost = layers
        if e != 0:
            cost = 0
            b = x.e_first[e]
            for j in range(layers):
                if p.refs[b] == 0:
                    cost += 1           # a cached block comes back into use
                b = x.blk_next[b] - 1
        if fit and spent + cost > avail:
            break
        spent += cost
        t.ent[i] = e
        t.slot[i] = -1
        if e != 0:
            b = x.e_first[e]
            for j in range(layers):
                t.share[ns] = b
                ns += 1
                b = x.blk_next[b] - 1
        else:
            t.slot[i] = <int32_t>nn
            nn += 1
        m += 1
    memset(r, 0, sizeof(BlockReq))
    r.pool = p
    r.share = t.share
    r.n_share = ns
    r.fresh = t.fresh
    r.n_fresh = nn * layers
    r.owner = OWNER_CACHE
    if only_free and (ns > 0 or nn * layers > p.n_stack + (p.total - p.next_fresh)):
        rc = FX_NOT_FREE
    else:
        rc = _req_check(r)
    if rc == 0:
        _req_apply(r)
    elif rc == FX_EXHAUSTED:
        p.refused += 1
    pthread_mutex_unlock(&p.lock)
    t.taken = m
    t.n_new = nn
    return rc


cdef void pool_import_abort(Pool* p, Import* t) noexcept nogil:
    """Give back the fresh blocks of an only_free pool_import_reserve that
    will not be published, uncounted (_untake, last taken first: the free
    list is as before); the high-water mark returns to what it was (no lower
    than the blocks used now)."""
    cdef Py_ssize_t i
    pthread_mutex_lock(&p.lock)
    for i in range(t.n_new * t.layers - 1, -1, -1):
        _untake(p, t.fresh[i])
    p.high_water = t.high_water if t.high_water > p.n_used else p.n_used
    pthread_mutex_unlock(&p.lock)


cdef Py_ssize_t pool_import_publish(Pool* p, Import* t, int32_t** tables) noexcept nogil:
    """Publish the ``t.taken`` entries pool_import_reserve took (their new
    blocks filled), then let go of every block it held, deepest entry first
    (a chain's tail is evicted before its head). An entry that another
    thread published meanwhile is kept and these blocks go back. ``tables``
    has room for ``t.layers`` pointers. Returns the entries added."""
    cdef Prefix* x = p.prefix
    cdef Py_ssize_t i, added = 0, nn = t.n_new
    cdef int32_t e, b, j, par, layers = t.layers
    for j in range(layers):
        tables[j] = t.fresh + j * nn
    pthread_mutex_lock(&p.lock)
    for i in range(t.taken):
        if t.slot[i] < 0:
            continue
        par = 0 if t.parent[i] < 0 else t.ent[t.parent[i]]
        e = _find(p, t.keys[i], par, t.salt[i], layers, t.tokens + i * p.block_size)
        if e == 0:
            e = _entry_add(p, t.keys[i], par, t.salt[i], layers, t.tokens + i * p.block_size,
                           tables, t.slot[i])
            added += 1
        t.ent[i] = e
    for i in range(t.taken - 1, -1, -1):
        if t.slot[i] >= 0:
            for j in range(layers):
                _unhold(p, t.fresh[j * nn + t.slot[i]])
        else:
            b = x.e_first[t.ent[i]]
            for j in range(layers):
                _unhold(p, b)
                b = x.blk_next[b] - 1
    pthread_mutex_unlock(&p.lock)
    return added


# -- the Python side ----------------------------------------------------------------

cdef _import_rows(k, v, Py_ssize_t i, int32_t layers, Py_ssize_t bs, size_t k_row,
                  size_t v_row):
    """Entry i's stored rows for _import_prefixes: C-contiguous uint8 arrays
    of shape (layers, bs, row bytes), or ValueError naming them."""
    for name, a, row in (("ks", k, k_row), ("vs", v, v_row)):
        if (not isinstance(a, np.ndarray) or a.dtype != np.uint8
                or a.shape != (layers, bs, row) or not a.flags.c_contiguous):
            raise ValueError(f"{name}[{i}] must be C-contiguous uint8 of shape "
                             f"{(layers, bs, row)}")


cdef tuple io_export(KvBlockPool self, n_layers):
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
        if n == -1:
            raise ValueError("this pool's prefix entries were published with different "
                             "layer counts: pass n_layers= to choose one")
        if n < 0:
            raise RuntimeError("ferrox_kv: the prefix index names a block it does not hold")
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


cdef object io_import(KvBlockPool self, n_layers, tokens, salts, parents, ks, vs, rows,
                      bint fit):
    """Publish verified entries (``ferrox_kv.store``): entry i has token
    ids ``tokens[i]`` (int32 ``(n, block_size)``), salt ``salts[i]``,
    parent index ``parents[i] < i`` (-1 at depth 0) and stored rows
    ``ks[i]``/``vs[i]`` (C-contiguous uint8 ``(n_layers, block_size,
    row_bytes)``). Every block is reserved first: all or nothing
    (``KvPoolExhausted``, nothing changed), or with ``fit`` the leading
    entries that fit; an entry already published is kept, not
    duplicated. Rows are copied without the GIL, outside the lock.
    Returns ``(added, present, left_out)``.

    Streamed (``rows`` not None; ``ks``/``vs`` unused): ``rows(i)`` reads
    and verifies entry i's rows and returns ``(k, v)`` (views that may
    reuse the previous call's buffer), called once per entry in order
    after the blocks are reserved and before anything is published. Only a
    pool that can take every block from its free list, none of the entries
    published yet, is filled that way; else the result is None and nothing
    changed (read the rows first and pass them as arrays). An exception
    from ``rows`` gives back what was reserved, exactly (``stats()`` as
    before), and propagates."""
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
    cdef Import t
    cdef int rc
    cdef bint fill = rows is not None
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
        memset(&t, 0, sizeof(Import))
        t.layers = layers
        t.n = n
        t.keys = keys
        t.tokens = tp
        t.salt = sid
        t.parent = pp
        t.ent = ent
        t.slot = slot
        t.share = share
        t.fresh = fresh
        with nogil:
            for i in range(n):
                keys[i] = fx_block_key(0 if pp[i] < 0 else keys[pp[i]], tp + i * bs, bs,
                                       <uint64_t>layers, <uint64_t>sid[i])
            rc = pool_import_reserve(p, &t, fit, fill)
        m = t.taken
        nn = t.n_new
        if rc == FX_NOT_FREE:
            return None
        if rc == FX_EXHAUSTED:
            raise KvPoolExhausted(t.req.needed, t.req.free_seen)
        if rc != 0:
            raise RuntimeError("ferrox_kv: the prefix index names a block it does not hold")
        if fill:
            try:
                for i in range(n):
                    pair = rows(i)
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
                    pool_import_abort(p, &t)
                raise
        with nogil:
            if not fill:
                for i in range(m):
                    if slot[i] >= 0:
                        fx_copy_blocks(p.k_arena, p.k_block, fresh + slot[i], layers, nn,
                                       kp[i], True)
                        fx_copy_blocks(p.v_arena, p.v_block, fresh + slot[i], layers, nn,
                                       vp[i], True)
            added = pool_import_publish(p, &t, tables)
    finally:
        free(sid); free(ent); free(slot); free(share); free(fresh); free(tables)
        free(keys); free(kp); free(vp)
    return added, m - nn, n - m


cdef Py_ssize_t io_match(KvBlockPool self, tokens, salt, n_layers) except -1:
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


# -- the store's file I/O, handed to the core ----------------------------------------
# KvBlockPool.save_prefixes / load_prefixes and KvCache.save / load forward to
# ferrox_kv.store, which the core does not import: the package
# (ferrox_kv/__init__.py) hands the core an object with those four functions,
# and that object imports the store (and its xxhash) when first called.

cdef object _files = None


def _set_store_files(files):
    """Set what ``KvBlockPool.save_prefixes`` / ``load_prefixes`` and
    ``KvCache.save`` / ``load`` forward to (ferrox_kv/__init__.py sets it);
    returns the previous one."""
    global _files
    old = _files
    _files = files
    return old


cdef object _store_files():
    if _files is None:
        raise RuntimeError("ferrox_kv._core was imported without ferrox_kv: import ferrox_kv "
                           "(it connects the prefix files of ferrox_kv.store)")
    return _files
