# The prefix cache's index: published blocks keyed by chained hashes, every
# hit verified against the stored token ids, salt, layer count and parent;
# an intrusive LRU list of entries that have a block no one holds; eviction
# of the least recently used entry together with its descendants (which its
# eviction makes unreachable). Everything here runs under the pool lock and
# touches only C memory.
#
# Entry e (1..cap) is one block position of a published sequence in every
# layer: e_layers blocks linked from e_first through blk_next. An entry is in
# the LRU list exactly when e_held[e] < e_layers[e]; its blocks with no holder
# are the pool's cached blocks.

cdef Prefix* prefix_new(Py_ssize_t total, Py_ssize_t block_size) noexcept nogil:
    cdef Prefix* x = <Prefix*>calloc(1, sizeof(Prefix))
    cdef size_t cap = <size_t>total if total > 0 else 1
    cdef size_t ne = cap + 1              # entry 0 is "none"
    cdef size_t nb = 1
    if x == NULL:
        return NULL
    while nb < cap:
        nb <<= 1
    x.cap = <Py_ssize_t>cap
    x.n_buckets = <Py_ssize_t>nb
    x.next_entry = 1
    x.blk_entry = <int32_t*>calloc(cap, sizeof(int32_t))
    x.blk_next = <int32_t*>calloc(cap, sizeof(int32_t))
    x.e_key = <uint64_t*>calloc(ne, sizeof(uint64_t))
    x.e_parent = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_salt = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_layers = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_first = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_held = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_hnext = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_lru_prev = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_lru_next = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_child = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_sib_prev = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_sib_next = <int32_t*>calloc(ne, sizeof(int32_t))
    x.e_tokens = <int32_t*>calloc(ne * <size_t>block_size, sizeof(int32_t))
    x.buckets = <int32_t*>calloc(nb, sizeof(int32_t))
    x.e_free = <int32_t*>malloc(ne * sizeof(int32_t))
    if (x.blk_entry == NULL or x.blk_next == NULL or x.e_key == NULL
            or x.e_parent == NULL or x.e_salt == NULL or x.e_layers == NULL
            or x.e_first == NULL or x.e_held == NULL or x.e_hnext == NULL
            or x.e_lru_prev == NULL or x.e_lru_next == NULL or x.e_child == NULL
            or x.e_sib_prev == NULL or x.e_sib_next == NULL or x.e_tokens == NULL
            or x.buckets == NULL or x.e_free == NULL):
        prefix_free(x)
        return NULL
    return x


cdef void prefix_free(Prefix* x) noexcept nogil:
    if x == NULL:
        return
    free(x.blk_entry); free(x.blk_next); free(x.e_key); free(x.e_parent)
    free(x.e_salt); free(x.e_layers); free(x.e_first); free(x.e_held)
    free(x.e_hnext); free(x.e_lru_prev); free(x.e_lru_next); free(x.e_child)
    free(x.e_sib_prev); free(x.e_sib_next); free(x.e_tokens); free(x.buckets)
    free(x.e_free)
    free(x)


# -- the LRU list ---------------------------------------------------------------

cdef inline void _lru_remove(Prefix* x, int32_t e) noexcept nogil:
    cdef int32_t a = x.e_lru_prev[e], b = x.e_lru_next[e]
    if a != 0:
        x.e_lru_next[a] = b
    else:
        x.lru_head = b
    if b != 0:
        x.e_lru_prev[b] = a
    else:
        x.lru_tail = a
    x.e_lru_prev[e] = 0
    x.e_lru_next[e] = 0


cdef inline void _lru_append(Prefix* x, int32_t e) noexcept nogil:
    """Make e the most recently used."""
    x.e_lru_prev[e] = x.lru_tail
    x.e_lru_next[e] = 0
    if x.lru_tail != 0:
        x.e_lru_next[x.lru_tail] = e
    else:
        x.lru_head = e
    x.lru_tail = e


cdef inline bint _in_lru(Prefix* x, int32_t e) noexcept nogil:
    return x.e_held[e] < x.e_layers[e]


cdef void prefix_held(Pool* p, int32_t b) noexcept nogil:
    """A cached block gets a holder (its refs go 0 -> 1)."""
    cdef Prefix* x = p.prefix
    cdef int32_t e = x.blk_entry[b]
    x.n_cached -= 1
    x.e_held[e] += 1
    if not _in_lru(x, e):
        _lru_remove(x, e)


cdef void prefix_unheld(Pool* p, int32_t b) noexcept nogil:
    """A published block loses its last holder: cached, and its entry becomes
    the most recently used."""
    cdef Prefix* x = p.prefix
    cdef int32_t e = x.blk_entry[b]
    x.n_cached += 1
    if _in_lru(x, e):
        _lru_remove(x, e)
    x.e_held[e] -= 1
    _lru_append(x, e)


# -- the index ------------------------------------------------------------------

cdef inline Py_ssize_t _bucket(Prefix* x, uint64_t key) noexcept nogil:
    return <Py_ssize_t>(key & <uint64_t>(x.n_buckets - 1))


cdef int32_t _find(Pool* p, uint64_t key, int32_t parent, int32_t salt,
                   int32_t layers, const int32_t* tokens) noexcept nogil:
    """The entry that stores exactly this block (same parent, salt, layer
    count and token ids), or 0. The key only narrows the search."""
    cdef Prefix* x = p.prefix
    cdef int32_t e = x.buckets[_bucket(x, key)]
    while e != 0:
        if (x.e_key[e] == key and x.e_parent[e] == parent and x.e_salt[e] == salt
                and x.e_layers[e] == layers
                and memcmp(x.e_tokens + <size_t>e * <size_t>p.block_size, tokens,
                           <size_t>p.block_size * sizeof(int32_t)) == 0):
            return e
        e = x.e_hnext[e]
    return 0


cdef void _unlink(Pool* p, int32_t e) noexcept nogil:
    """Drop a childless entry from the index; its blocks with no holder go to
    the free list, the held ones stay with their holders, unpublished."""
    cdef Prefix* x = p.prefix
    cdef Py_ssize_t bk = _bucket(x, x.e_key[e])
    cdef int32_t a, b, nxt, par = x.e_parent[e]
    # hash chain (singly linked)
    if x.buckets[bk] == e:
        x.buckets[bk] = x.e_hnext[e]
    else:
        a = x.buckets[bk]
        while x.e_hnext[a] != e:
            a = x.e_hnext[a]
        x.e_hnext[a] = x.e_hnext[e]
    # the parent's children
    a = x.e_sib_prev[e]
    nxt = x.e_sib_next[e]
    if a != 0:
        x.e_sib_next[a] = nxt
    elif par != 0:
        x.e_child[par] = nxt
    if nxt != 0:
        x.e_sib_prev[nxt] = a
    if _in_lru(x, e):
        _lru_remove(x, e)
    b = x.e_first[e]
    while True:
        nxt = x.blk_next[b]
        x.blk_entry[b] = 0
        x.blk_next[b] = 0
        if p.refs[b] == 0:
            x.n_cached -= 1
            x.evictions += 1
            _push_free(p, b)
        if nxt == 0:
            break
        b = nxt - 1
    x.e_hnext[e] = 0
    x.e_sib_prev[e] = 0
    x.e_sib_next[e] = 0
    x.e_parent[e] = 0
    x.e_held[e] = 0
    x.e_layers[e] = 0
    x.e_free[x.n_efree] = e
    x.n_efree += 1


cdef void prefix_evict(Pool* p) noexcept nogil:
    """Evict the least recently used entry and its descendants (unreachable
    without it), descendants first. Frees at least one block."""
    cdef Prefix* x = p.prefix
    cdef int32_t top = x.lru_head, e = top, nxt
    if top == 0:
        return
    while True:
        while x.e_child[e] != 0:
            e = x.e_child[e]
        if e == top:
            _unlink(p, e)
            return
        nxt = x.e_parent[e]
        _unlink(p, e)
        e = nxt


cdef Py_ssize_t prefix_match(Pool* p, const uint64_t* keys, const int32_t* tokens,
                             Py_ssize_t n, int32_t layers, int32_t salt,
                             int32_t* out) noexcept nogil:
    """How many of the first ``n`` blocks of ``tokens`` are published under
    this salt and layer count, walking the chain from its first block; their
    entries go to ``out``."""
    cdef int32_t parent = 0, e
    cdef Py_ssize_t i
    for i in range(n):
        e = _find(p, keys[i], parent, salt, layers, tokens + i * p.block_size)
        if e == 0:
            return i
        out[i] = e
        parent = e
    return n


cdef void prefix_blocks(Pool* p, const int32_t* entries, Py_ssize_t n,
                        int32_t layers, int32_t* out) noexcept nogil:
    """The blocks of ``n`` entries, layer-major: layer j's block of entry i
    at ``out[j * n + i]``."""
    cdef Prefix* x = p.prefix
    cdef Py_ssize_t i, j
    cdef int32_t b
    for i in range(n):
        b = x.e_first[entries[i]]
        for j in range(layers):
            out[j * n + i] = b
            b = x.blk_next[b] - 1


cdef bint _distinct_unpublished(Pool* p, int32_t** tables, int32_t layers,
                                Py_ssize_t i) noexcept nogil:
    """Whether position ``i``'s blocks of every layer are distinct blocks that
    no entry owns yet (a cache and its fork share blocks: such a pair is not
    one sequence's layers). Marks with the pool's delta scratch (pool lock
    held, as for _req_check), cleared."""
    cdef int32_t j, b
    cdef bint ok = True
    for j in range(layers):
        b = tables[j][i]
        if p.prefix.blk_entry[b] != 0 or p.delta[b] != 0:
            ok = False
            break
        p.delta[b] = 1
    for j in range(layers):
        p.delta[tables[j][i]] = 0
    return ok


cdef int32_t _entry_add(Pool* p, uint64_t key, int32_t parent, int32_t salt, int32_t layers,
                        const int32_t* tok, int32_t** tables, Py_ssize_t i) noexcept nogil:
    """A new entry for blocks ``tables[j][i]`` (layer j), held by their
    holders, under ``parent``: indexed, linked, its token ids stored."""
    cdef Prefix* x = p.prefix
    cdef int32_t e, b, j
    cdef Py_ssize_t bk
    if x.n_efree > 0:
        x.n_efree -= 1
        e = x.e_free[x.n_efree]
    else:
        e = <int32_t>x.next_entry
        x.next_entry += 1
    x.e_key[e] = key
    x.e_parent[e] = parent
    x.e_salt[e] = salt
    x.e_layers[e] = layers
    x.e_held[e] = layers
    memcpy(x.e_tokens + <size_t>e * <size_t>p.block_size, tok,
           <size_t>p.block_size * sizeof(int32_t))
    x.e_first[e] = tables[0][i]
    for j in range(layers):
        b = tables[j][i]
        x.blk_entry[b] = e
        x.blk_next[b] = tables[j + 1][i] + 1 if j + 1 < layers else 0
    bk = _bucket(x, key)
    x.e_hnext[e] = x.buckets[bk]
    x.buckets[bk] = e
    if parent != 0:
        x.e_sib_next[e] = x.e_child[parent]
        if x.e_child[parent] != 0:
            x.e_sib_prev[x.e_child[parent]] = e
        x.e_child[parent] = e
    return e


cdef Py_ssize_t prefix_publish(Pool* p, int32_t** tables, int32_t layers,
                               const uint64_t* keys, const int32_t* tokens,
                               Py_ssize_t n, int32_t salt) noexcept nogil:
    """Publish the first ``n`` full blocks of one sequence (``tables[j]`` is
    layer j's block table). A block position already published keeps the
    existing blocks. Stops at a position whose blocks belong to another
    entry (e.g. reused under another salt) or are not distinct across the
    layers. Returns the positions now published along this chain. Pool lock
    held; the caches hold every block."""
    cdef int32_t parent = 0, e
    cdef const int32_t* tok
    cdef Py_ssize_t i
    for i in range(n):
        tok = tokens + i * p.block_size
        e = _find(p, keys[i], parent, salt, layers, tok)
        if e == 0:
            if not _distinct_unpublished(p, tables, layers, i):
                return i
            e = _entry_add(p, keys[i], parent, salt, layers, tok, tables, i)
        parent = e
    return n


cdef void prefix_keys(const int32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t bs,
                      int32_t layers, int32_t salt, uint64_t* keys) noexcept nogil:
    """The chained keys of the first ``n_blocks`` blocks of ``tokens``."""
    cdef Py_ssize_t i
    cdef uint64_t parent = 0
    for i in range(n_blocks):
        keys[i] = fx_block_key(parent, tokens + i * bs, bs, <uint64_t>layers, <uint64_t>salt)
        parent = keys[i]


cdef int pool_reserve(Pool* p, const uint64_t* keys, const int32_t* tokens, Py_ssize_t m_max,
                      int32_t layers, int32_t salt, Py_ssize_t per, int32_t* out,
                      Py_ssize_t stride, int32_t* scratch, Py_ssize_t* matched,
                      BlockReq* r) noexcept nogil:
    """The blocks of ``layers`` new caches of one sequence, in one locked
    step: the longest published prefix of ``tokens`` (at most ``m_max``
    blocks; no lookup when ``keys`` is NULL), shared, and fresh blocks up to
    max(per, matched) per cache. A lookup that succeeds counts as one hit or
    one miss (``m_max`` 0 is a miss). All or nothing (FX_EXHAUSTED, ``r``
    says by how much). Cache j's ids go to ``out[j * stride ...]``;
    ``scratch`` holds ``m_max * (layers + 1) + layers * max(per, m_max)``
    ids."""
    cdef int32_t* entries = scratch
    cdef int32_t* share = scratch + m_max
    cdef int32_t* fresh = share + <size_t>m_max * <size_t>layers
    cdef Py_ssize_t m = 0, nb, i, j
    cdef int rc
    pthread_mutex_lock(&p.lock)
    if keys != NULL and p.prefix != NULL:
        m = prefix_match(p, keys, tokens, m_max, layers, salt, entries)
        prefix_blocks(p, entries, m, layers, share)
    nb = per if per > m else m
    memset(r, 0, sizeof(BlockReq))
    r.pool = p
    r.share = share
    r.n_share = m * layers
    r.fresh = fresh
    r.n_fresh = (nb - m) * layers
    r.owner = OWNER_CACHE
    rc = _req_check(r)
    if rc == 0:
        _req_apply(r)
        if keys != NULL and p.prefix != NULL:
            if m:
                p.prefix.hits += 1
                p.prefix.hit_tokens += <uint64_t>(m * p.block_size)
            else:
                p.prefix.misses += 1
    elif rc == FX_EXHAUSTED:
        p.refused += 1
    pthread_mutex_unlock(&p.lock)
    if rc != 0:
        return rc
    for j in range(layers):
        for i in range(m):
            out[j * stride + i] = share[j * m + i]
        for i in range(nb - m):
            out[j * stride + m + i] = fresh[j * (nb - m) + i]
    matched[0] = m
    return 0


cdef Py_ssize_t pool_publish(Pool* p, int32_t** tables, int32_t layers, const uint64_t* keys,
                             const int32_t* tokens, Py_ssize_t n, int32_t salt) noexcept nogil:
    cdef Py_ssize_t done
    pthread_mutex_lock(&p.lock)
    done = prefix_publish(p, tables, layers, keys, tokens, n, salt)
    pthread_mutex_unlock(&p.lock)
    return done
