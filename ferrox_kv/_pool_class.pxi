# KvBlockPool, the Python face of the C pool (_pool.pxi), and KvPoolExhausted.
# Its prefix-entry I/O for ferrox_kv.store forwards to _prefix_io.pxi.

class KvPoolExhausted(Exception):
    """A pool had fewer free blocks than an operation needed.

    Nothing was changed when it is raised. ``requested`` is the number of
    blocks the operation needed from that pool, ``free`` the number the pool
    had free (its ``free_blocks``).
    """

    def __init__(self, requested, free):
        self.requested = requested
        self.free = free
        super().__init__(
            f"KV cache block pool exhausted: {requested} block(s) requested, "
            f"{free} free")

    def __reduce__(self):
        return (KvPoolExhausted, (self.requested, self.free))


cdef class KvBlockPool:
    """KvBlockPool(block_size, total_blocks, n_kv_heads, head_dim, *, v_head_dim=None,
               prefix_cache=False, dtype="float32", rotate=None)
--

A bounded pool of fixed-size KV blocks shared by every cache of a process.

    A block holds ``block_size`` positions of one layer's K rows
    (``n_kv_heads * head_dim`` values each) and V rows
    (``n_kv_heads * v_head_dim``), stored as ``dtype``: ``"float32"`` (the
    default), ``"float16"``, ``"bfloat16"``, ``"int8"`` (with one float16
    scale per 32 values of each head, inside the row) or ``"int4"`` (4-bit
    values, the same scales: 4.5 bits per value; head dims multiples of 32);
    see docs/precision.md. ``rotate`` applies to int4 only: ``None`` or
    ``True`` (the default for int4) stores each head's K and V values
    rotated by an orthonormal Hadamard transform before quantising (attend
    rotates queries and outputs to match, ``.k``/``.v`` read back un-rotated),
    which spreads outlier channels over the group; ``False`` stores them as
    given. ``rotate=True`` with another dtype is a ``ValueError``. The pool
    owns one K arena and one V arena of ``total_blocks`` blocks, allocated
    so that untouched blocks cost no physical memory. Block ids and their
    reference counts move under one native mutex, held only while ids move. ``free_blocks`` is the
    admission-control signal.

    All methods are safe to call from many threads at once.
    """

    def __cinit__(self, block_size=_MISSING, total_blocks=_MISSING, n_kv_heads=_MISSING,
                  head_dim=_MISSING, *, v_head_dim=None, prefix_cache=False,
                  dtype="float32", rotate=None):
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
        cdef int code = _storage_code(dtype, rotate, d, vd)
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
                 dtype="float32", rotate=None):
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
        ``"bfloat16"``, ``"int8"`` or ``"int4"``."""
        return _DTYPE_OF_CODE[self.p.dtype]

    @property
    def rotate(self):
        """Whether rows are stored Hadamard-rotated (int4 with rotate on;
        False for every other dtype)."""
        return self.p.dtype == FX_I4H

    def reservation_blocks(self, max_seq_len, *, window=None, max_chunk=None):
        """The blocks ``KvCache.with_pool(..., max_seq_len, window=window,
        max_chunk=max_chunk)`` reserves from this pool (``with_pool_many``:
        this per cache): ``max(1, ceil(max_seq_len / block_size))``, and with
        a window at most ``ceil((window + max_chunk - 1) / block_size) + 1``
        (``max_chunk`` defaults to ``block_size``). For admission control
        that sizes requests before making their caches."""
        cdef Py_ssize_t bs = self.p.block_size
        cdef Py_ssize_t full = max(_blocks_for(_count(max_seq_len, "max_seq_len", 0), bs), 1)
        cdef Py_ssize_t w = _window_arg(window, max_chunk, None, bs)
        cdef Py_ssize_t mc = _count(max_chunk, "max_chunk", 1) if max_chunk is not None else bs
        return _reserved_blocks(full, w, mc, bs)

    def stats(self):
        """A consistent snapshot of the pool's counters, as a dict.

        ``total_blocks``, ``free_blocks``, ``used_blocks``, ``cached_blocks``
        (published, held by no one; part of ``free_blocks``), ``high_water``
        (most blocks used at once), ``acquired`` and ``released`` (blocks that
        came into use and went out of use), ``refused`` (requests refused for
        lack of blocks), ``window_freed`` (of ``released``: blocks that went
        out of use as sliding-window caches gave them back, having left the
        window; a block still held elsewhere, e.g. by a fork, counts when its
        last holder lets it go that way), ``block_size``, ``block_bytes``, and
        for the prefix cache ``prefix_hits`` and ``prefix_misses`` (lookups that reused at
        least one block, or none: every reservation with ``tokens=`` is one
        lookup, one of the two; tokens shorter than a block are a miss),
        ``hit_tokens`` (positions reused) and ``evictions`` (cached blocks
        given to other requests). With a store attached (``attach``), its
        ``stats()`` too, each key prefixed ``store_``.
        """
        cdef Pool* p = self.p
        cdef Py_ssize_t used, high, cached = 0
        cdef uint64_t acq, rel, ref, wf, hits = 0, misses = 0, toks = 0, ev = 0
        with nogil:
            pthread_mutex_lock(&p.lock)
            used = p.n_used
            high = p.high_water
            acq = p.acquired
            rel = p.released
            ref = p.refused
            wf = p.window_freed
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
            "window_freed": wf,
            "block_size": p.block_size,
            "block_bytes": self.block_bytes,
            "prefix_hits": hits,
            "prefix_misses": misses,
            "hit_tokens": toks,
            "evictions": ev,
        }
        store = self._store
        if store is not None:
            for name, value in store.stats().items():
                out["store_" + name] = value
        return out

    cdef object _arena_view(self, char* base, Py_ssize_t dim, size_t row, bint scales):
        """A read-only view of an arena (keeps the pool alive): the values,
        shape (total_blocks, block_size, n_kv_heads, dim), or with ``scales``
        an int8 / int4 arena's scales, (total_blocks, block_size, n_kv_heads,
        ceil(dim / 32)) float16. int4 values: uint8, two per byte (dim // 2
        bytes per head, FORMAT.md's layout). Strided: rows are ``row`` bytes
        apart."""
        cdef Pool* p = self.p
        cdef bint i4 = p.dtype == FX_I4 or p.dtype == FX_I4H
        cdef int typ = (cnp.NPY_FLOAT32, cnp.NPY_FLOAT16, cnp.NPY_UINT16, cnp.NPY_INT8,
                        cnp.NPY_UINT8, cnp.NPY_UINT8)[p.dtype]
        cdef Py_ssize_t item = 4 if p.dtype == FX_F32 else (1 if p.dtype == FX_I8 or i4 else 2)
        cdef Py_ssize_t last = dim // 2 if i4 else dim
        cdef char* data = base
        if scales:
            typ = cnp.NPY_FLOAT16
            item = 2
            data = base + <size_t>p.nh * <size_t>last
            last = (dim + 31) // 32
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
        bfloat16, int8 for int8 (dequantise with ``key_scales``); int4: uint8,
        shape ``(..., head_dim // 2)``, two values per byte as FORMAT.md lays
        them out (rotated when ``rotate``)."""
        return self._arena_view(self.p.k_arena, self.head_dim, self.p.k_row, False)

    @property
    def value_blocks(self):
        """Read-only zero-copy view of the V arena's values,
        shape ``(total_blocks, block_size, n_kv_heads, v_head_dim)``."""
        return self._arena_view(self.p.v_arena, self.v_head_dim, self.p.v_row, False)

    @property
    def key_scales(self):
        """An int8 or int4 pool's K scales, read-only float16 view shaped
        ``(total_blocks, block_size, n_kv_heads, ceil(head_dim / 32))``: value
        ``i`` of an int8 head is ``key_blocks[..., i] * key_scales[..., i // 32]``.
        None for the other dtypes."""
        if self.p.dtype != FX_I8 and self.p.dtype != FX_I4 and self.p.dtype != FX_I4H:
            return None
        return self._arena_view(self.p.k_arena, self.head_dim, self.p.k_row, True)

    @property
    def value_scales(self):
        """An int8 or int4 pool's V scales (as ``key_scales``); None otherwise."""
        if self.p.dtype != FX_I8 and self.p.dtype != FX_I4 and self.p.dtype != FX_I4H:
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
                if cs[i].window:
                    raise ValueError(
                        f"caches[{i}] has a sliding window ({cs[i].window}): windowed caches "
                        "take no part in the prefix cache (they give back the blocks a "
                        "hit would share); publish the full-attention layers only")
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
        store = self._store            # read once: another thread may detach it
        if store is not None and done:
            store.after_publish(self, cl, toks[:done * p.block_size], salt)
        return done * p.block_size

    def _export_prefixes(self, n_layers=0):
        """Every published prefix entry, parents first, with its stored rows
        (for ``ferrox_kv.store``; see ``io_export`` in ``_prefix_io.pxi``):
        ``(n_layers, salts, parents, depths, tokens, k, v)``."""
        return io_export(self, n_layers)

    def _import_prefixes(self, n_layers, tokens, salts, parents, ks, vs, *, bint fit=False):
        """Publish verified entries given with their rows (for
        ``ferrox_kv.store``; see ``io_import`` in ``_prefix_io.pxi``):
        ``(added, present, left_out)``."""
        return io_import(self, n_layers, tokens, salts, parents, ks, vs, None, fit)

    def _import_prefixes_streamed(self, n_layers, tokens, salts, parents, rows, *,
                                  bint fit=False):
        """As ``_import_prefixes``, each entry's rows read by ``rows(i)`` into
        blocks reserved from the free list first; None (nothing changed) when
        the pool would have to share or evict for them."""
        return io_import(self, n_layers, tokens, salts, parents, None, None, rows, fit)

    def _prefix_match(self, tokens, salt=None, n_layers=1):
        """How many leading full blocks of ``tokens`` are published under
        ``salt`` for ``n_layers`` layers (counts no hit or miss)."""
        return io_match(self, tokens, salt, n_layers)

    def save_prefixes(self, path, *, fingerprint, n_layers=None):
        """Write every published prefix entry to the prefix file ``path``
        (FORMAT.md), atomically; forwards to ``ferrox_kv.store.save_prefixes``."""
        return _store_files().save_prefixes(self, path, fingerprint=fingerprint,
                                            n_layers=n_layers)

    def load_prefixes(self, path, *, fingerprint):
        """Publish the entries of the prefix file ``path``, verified first;
        forwards to ``ferrox_kv.store.load_prefixes``."""
        return _store_files().load_prefixes(self, path, fingerprint=fingerprint)

    def attach(self, store):
        """Attach a prefix store (``ferrox_kv.store.RedisPrefixStore``), or
        detach with None: ``publish`` writes through to it, and a lookup with
        ``tokens=`` (``KvCache.with_pool``, ``with_pool_many``) reads the
        blocks missing locally through it first. Store faults are counted
        misses, never exceptions; ``stats()`` adds the store's counters under
        ``store_``.

        A store is an object with three methods the pool calls (the core
        never imports the store): ``after_publish(pool, caches, tokens,
        salt)`` after ``publish`` published ``tokens``, ``before_lookup(pool,
        tokens, salt, n_layers)`` before a lookup of ``tokens`` (whole
        blocks) that fits in the free blocks, and ``stats()``."""
        if self.p.prefix == NULL:
            raise ValueError("a store needs a pool with a prefix cache: "
                             "KvBlockPool(..., prefix_cache=True)")
        if store is not None:
            for name in ("after_publish", "before_lookup", "stats"):
                if not callable(getattr(store, name, None)):
                    raise TypeError(f"store must be a prefix store such as "
                                    f"ferrox_kv.store.RedisPrefixStore (it has no {name}()), "
                                    f"got {type(store).__name__}")
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
        if rc == CHECK_NO_MEMORY:
            raise MemoryError(f"KvBlockPool.check: {_CHECK_MESSAGES[rc]}")
        if rc:
            raise RuntimeError(f"KvBlockPool.check: {_CHECK_MESSAGES[rc]} (at {where})")

    def __repr__(self):
        return (f"KvBlockPool(block_size={self.p.block_size}, "
                f"total_blocks={self.p.total}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}"
                f"{', prefix_cache=True' if self.p.prefix != NULL else ''}"
                f"{'' if self.p.dtype == FX_F32 else ', dtype=%r' % self.dtype}"
                f"{', rotate=False' if self.p.dtype == FX_I4 else ''}, "
                f"free_blocks={self.free_blocks})")
