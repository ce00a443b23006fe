# Row storage, the row copies, and KvCache.

@cython.final
@cython.no_gc
cdef class _Rows:
    """One malloc'd buffer: ``cap`` K rows followed by ``cap`` V rows. Views of
    a contiguous cache keep exactly the buffer they show alive."""

    def __cinit__(self):
        self.k = NULL
        self.v = NULL
        self.cap = 0

    def __dealloc__(self):
        free(self.k)
        self.k = NULL
        self.v = NULL


cdef _Rows _rows_new(Py_ssize_t cap, Cache* c):
    """A buffer of ``cap`` rows of ``c``'s stored format."""
    cdef size_t nbytes
    if (fx_mul(<size_t>cap, c.k_row + c.v_row, &nbytes) or nbytes > _MAX_BYTES):
        raise ValueError(f"capacity {cap} x {c.k_row + c.v_row} bytes overflows the byte count")
    cdef _Rows r = _Rows.__new__(_Rows)
    r.k = <char*>malloc(nbytes if nbytes > 0 else 1)
    if r.k == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes for {cap} KV rows")
    fx_advise_huge(r.k, nbytes)
    r.v = r.k + <size_t>cap * c.k_row
    r.cap = cap
    return r


# -- where rows live ------------------------------------------------------------

cdef inline char* _k_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.k + <size_t>r * c.k_row
    return (p.k_arena + <size_t>c.table[r // p.block_size] * p.k_block
            + <size_t>(r % p.block_size) * c.k_row)


cdef inline char* _v_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.v + <size_t>r * c.v_row
    return (p.v_arena + <size_t>c.table[r // p.block_size] * p.v_block
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
    return c.shared_upto == 0 or r >= c.shared_upto * c.pool.block_size


cdef inline bint _aliases(Cache* c, const void* src, size_t nbytes) noexcept nogil:
    """Whether ``src`` overlaps memory that a write into ``c`` may touch: its
    buffer, or its pool's arenas (a source there is copied first)."""
    cdef Pool* p = c.pool
    if p == NULL:
        return fx_overlap(src, nbytes, c.k, <size_t>c.cap * (c.k_row + c.v_row))
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
    """The first n rows into contiguous outputs (either may be NULL), without
    the GIL when the bytes pay for it."""
    cdef size_t width = (c.k_row if k_out != NULL else 0) + (c.v_row if v_out != NULL else 0)
    if _release_pays(n * <Py_ssize_t>width):
        with nogil:
            cache_gather(c, 0, n, k_out, v_out, to_f32)
    else:
        cache_gather(c, 0, n, k_out, v_out, to_f32)


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
        raise ValueError(f"dtype={DTYPES[c.c.dtype]!r} does not match the pool's dtype "
                         f"{pool.dtype!r}: a pooled cache stores what its pool stores "
                         "(leave dtype out to take the pool's)")
    if (c.n_kv_heads, c.head_dim, c.v_head_dim) != (
            pool.n_kv_heads, pool.head_dim, pool.v_head_dim):
        raise ValueError(
            f"cache geometry (n_kv_heads={c.n_kv_heads}, head_dim={c.head_dim}, "
            f"v_head_dim={c.v_head_dim}) does not match the pool's "
            f"(n_kv_heads={pool.n_kv_heads}, head_dim={pool.head_dim}, "
            f"v_head_dim={pool.v_head_dim})")
    return 0


# ---------------------------------------------------------------------------
# KvCache
# ---------------------------------------------------------------------------

@cython.no_gc_clear
cdef class KvCache:
    """KvCache(n_kv_heads, head_dim, *, v_head_dim=None, dtype="float32")
--

K and V rows of one sequence in one layer.

    ``KvCache(n_kv_heads, head_dim)`` starts empty and grows geometrically; ``KvCache.with_capacity`` pre-allocates a plan;
    ``KvCache.with_pool`` draws fixed-size blocks from a shared
    ``KvBlockPool``, reserving its worst case up front. ``dtype`` is the
    storage: ``"float32"`` (default), ``"float16"``, ``"bfloat16"`` or
    ``"int8"`` (README, "Precision"); input rows are converted to it inside
    the copy loop.

    A cache is not meant to be used from two threads at once: a method call
    that finds another call on the same cache in progress raises
    ``RuntimeError`` (never corrupts memory). Different caches may be used by
    different threads in parallel, on one pool. After ``close()`` every
    operation but ``close()`` raises ``ValueError("KvCache is closed")``.
    """

    def __cinit__(self, *args, **kwargs):
        memset(&self.c, 0, sizeof(Cache))
        self.c.plan = -1
        self.c.state = STATE_NEW
        self.rows = None
        if len(args) > 2 and type(self).__init__ is KvCache.__init__:
            raise TypeError(
                f"KvCache() takes 2 positional arguments (n_kv_heads, head_dim) but "
                f"{len(args)} were given: a capacity is not a constructor argument, "
                "max_seq_len belongs to KvCache.with_capacity(n_kv_heads, head_dim, "
                "max_seq_len=...) (rows pre-allocated) or KvCache.with_pool; "
                "v_head_dim is keyword-only (v_head_dim=...)")

    def __init__(self, n_kv_heads=_MISSING, head_dim=_MISSING, *, v_head_dim=None,
                 dtype="float32"):
        _require(type(self).__name__, ("n_kv_heads", "head_dim"), (n_kv_heads, head_dim))
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            if self.c.state != STATE_NEW:
                raise ValueError("KvCache.__init__ called on a cache that is already set up")
            self._set_geometry(n_kv_heads, head_dim, v_head_dim, dtype)
        finally:
            _leave(self)

    def __dealloc__(self):
        # Only C state: give the blocks back (exactly once) and drop the pool.
        cache_detach(&self.c)

    cdef int _set_geometry(self, n_kv_heads, head_dim, v_head_dim, dtype) except -1:
        cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
        cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
        cdef Py_ssize_t vd = d if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        cdef int code = _dtype_code(dtype, "dtype")
        _checked_bytes("n_kv_heads * head_dim", h, d, 1)
        _checked_bytes("n_kv_heads * v_head_dim", h, vd, 1)
        if h > INT32_MAX or d > INT32_MAX or vd > INT32_MAX:
            raise ValueError("n_kv_heads, head_dim and v_head_dim must be < 2**31")
        self.n_kv_heads = h
        self.head_dim = d
        self.v_head_dim = vd
        self.c.kw = h * d
        self.c.vw = h * vd
        self.c.nh = <int>h
        self.c.hd = <int>d
        self.c.vhd = <int>vd
        self.c.dtype = code
        self.c.k_row = _row_bytes(h, d, code)
        self.c.v_row = _row_bytes(h, vd, code)
        self.c.state = STATE_OPEN
        return 0

    cdef void _copy_geometry(self, KvCache other) noexcept:
        self.n_kv_heads = other.n_kv_heads
        self.head_dim = other.head_dim
        self.v_head_dim = other.v_head_dim
        self.c.kw = other.c.kw
        self.c.vw = other.c.vw
        self.c.nh = other.c.nh
        self.c.hd = other.c.hd
        self.c.vhd = other.c.vhd
        self.c.dtype = other.c.dtype
        self.c.k_row = other.c.k_row
        self.c.v_row = other.c.v_row
        self.c.state = STATE_OPEN

    # -- constructors -------------------------------------------------------

    @staticmethod
    def with_capacity(n_kv_heads, head_dim, max_seq_len, *, v_head_dim=None, dtype="float32"):
        """A cache with ``max_seq_len`` rows pre-allocated: pushes within the
        plan never reallocate. Pushing past the plan still works (it grows)."""
        cdef KvCache self = KvCache.__new__(KvCache)
        self._set_geometry(n_kv_heads, head_dim, v_head_dim, dtype)
        cdef Py_ssize_t plan = _count(max_seq_len, "max_seq_len", 0)
        self._set_rows(_rows_new(plan, &self.c))
        self.c.plan = plan
        return self

    @staticmethod
    def with_pool(n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                  *, v_head_dim=None, tokens=None, salt=None, dtype=None):
        """A cache whose rows live in ``pool``'s blocks.

        Takes ``max(1, ceil(max_seq_len / block_size))`` blocks up front, all or
        nothing; raises ``KvPoolExhausted`` leaving the pool untouched when it
        cannot. Geometry must match the pool's (``ValueError`` otherwise);
        the cache stores the pool's dtype (a ``dtype=`` that names another
        is a ``ValueError``). Pushing past the reservation takes one more block per ``block_size``
        positions (and can then raise ``KvPoolExhausted``).

        With ``tokens`` (the request's token ids; a pool with
        ``prefix_cache=True``), the longest prefix of them published under the
        same ``salt`` (and layer count, 1) is reused: the cache starts with
        ``seq_len`` = that many positions (whole blocks, at most
        ``len(tokens) - 1``), sharing those blocks, and reserves the rest of
        ``max_seq_len``. Every hit is verified against the token ids stored
        with the blocks, never trusted to a hash.
        """
        return _new_pooled(1, n_kv_heads, head_dim, v_head_dim, pool, max_seq_len,
                           tokens, salt, dtype)[0]

    def _blank(self, Py_ssize_t count):
        """``count`` empty caches like this one, to be filled by ``_assign``:
        on its pool with no blocks yet (``_assign`` gives them the source's
        reservation), or contiguous with this cache's plan."""
        cdef list out = []
        cdef KvCache c
        cdef Cache* cc
        cdef Py_ssize_t i
        _enter(self)
        try:
            for i in range(count):
                c = KvCache.__new__(KvCache)
                c._copy_geometry(self)
                if self.c.pool != NULL:
                    pool_incref(self.c.pool)
                    c.c.pool = self.c.pool
                    cc = &c.c
                    pool_link(self.c.pool, &cc, 1)
                elif self.c.plan >= 0:
                    c._set_rows(_rows_new(self.c.plan, &c.c))
                    c.c.plan = self.c.plan
                out.append(c)
        finally:
            _leave(self)
        return out

    @staticmethod
    def with_pool_many(count, n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                       *, v_head_dim=None, tokens=None, salt=None, dtype=None):
        """``count`` pooled caches (e.g. every layer of a sequence, or every
        layer of every sequence of a batch), reserved at once.

        One acquisition of ``count * max(1, ceil(max_seq_len / block_size))``
        blocks: all the caches or none. When the pool cannot cover them all,
        ``KvPoolExhausted`` and the pool is untouched (one refusal counted).
        With ``tokens``, the caches are one sequence's ``count`` layers and
        reuse its longest published prefix, as ``with_pool`` does.
        """
        cdef Py_ssize_t n = _count(count, "count", 0)
        return _new_pooled(n, n_kv_heads, head_dim, v_head_dim, pool, max_seq_len,
                           tokens, salt, dtype)

    # -- read-only state (answers in every state) ---------------------------

    @property
    def seq_len(self):
        """Positions stored."""
        return self.c.len

    def __len__(self):
        return self.c.len

    @property
    def dtype(self):
        """The storage dtype, as a name: ``"float32"``, ``"float16"``,
        ``"bfloat16"`` or ``"int8"`` (what ``dtype=`` takes back)."""
        return DTYPES[self.c.dtype]

    @property
    def closed(self):
        """True after ``close()``."""
        return self.c.state == STATE_CLOSED

    @property
    def is_pooled(self):
        """True while the cache's rows live in pool blocks."""
        return self.c.pool != NULL

    @property
    def blocks_held(self):
        """Pool blocks this cache holds (0 when not pooled)."""
        return self.c.n_blocks

    @property
    def capacity(self):
        """Positions that fit without growing (or taking another block)."""
        return self.c.cap

    @property
    def block_table(self):
        """The ids of the blocks held, in position order (int32 copy)."""
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            out = np.empty(self.c.n_blocks, dtype=np.int32)
            if self.c.n_blocks:
                memcpy(cnp.PyArray_DATA(out), self.c.table, self.c.n_blocks * sizeof(int32_t))
            return out
        finally:
            _leave(self)

    cdef object _rows_view(self, bint want_v):
        """(seq_len, n_kv_heads, dim) array of K or V: float32 and float16
        caches give a read-only view of the contiguous buffer, or a gathered
        copy when pooled; bfloat16 and int8 caches a float32 copy of the
        values (dequantised). Cache claimed."""
        cdef cnp.npy_intp dims[3]
        cdef Py_ssize_t n = self.c.len
        cdef void* data
        cdef cnp.ndarray arr
        cdef bint values = self.c.dtype == FX_BF16 or self.c.dtype == FX_I8
        cdef int typ = cnp.NPY_FLOAT16 if self.c.dtype == FX_F16 else cnp.NPY_FLOAT32
        if self.c.state == STATE_NEW:
            raise ValueError(_NEW)
        dims[0] = n
        dims[1] = self.n_kv_heads
        dims[2] = self.v_head_dim if want_v else self.head_dim
        if self.c.pool != NULL or (values and self.rows is not None):
            arr = cnp.PyArray_EMPTY(3, dims, typ, 0)
            data = cnp.PyArray_DATA(arr)
            _gather_rows(&self.c, n, NULL if want_v else data, data if want_v else NULL, values)
            return arr
        if self.rows is None:
            arr = cnp.PyArray_EMPTY(3, dims, typ, 0)
            cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
            return arr
        arr = cnp.PyArray_SimpleNewFromData(3, dims, typ,
                                            self.rows.v if want_v else self.rows.k)
        cnp.set_array_base(arr, self.rows)     # the view keeps its buffer alive
        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
        return arr

    cdef object _claimed_view(self, bint want_v):
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            return self._rows_view(want_v)
        finally:
            _leave(self)

    def _views(self):
        """(k, v) for integrations that wrap them (e.g. as torch tensors):
        zero-copy *writable* views of a contiguous cache, gathered copies of a
        pooled one. Not public: writing through them bypasses the cache."""
        _enter(self)
        try:
            k = self._rows_view(False)
            v = self._rows_view(True)
        finally:
            _leave(self)
        if self.c.pool == NULL and (self.c.dtype == FX_F32 or self.c.dtype == FX_F16):
            cnp.PyArray_ENABLEFLAGS(<cnp.ndarray>k, cnp.NPY_ARRAY_WRITEABLE)
            cnp.PyArray_ENABLEFLAGS(<cnp.ndarray>v, cnp.NPY_ARRAY_WRITEABLE)
        return k, v

    @property
    def k(self):
        """K rows, shape ``(seq_len, n_kv_heads, head_dim)``: float32 for
        float32, bfloat16 and int8 caches, float16 for float16 caches.

        Contiguous float32 / float16 caches: a read-only zero-copy view that
        keeps its buffer alive; if the cache later grows into a new buffer the
        view goes on showing the old one, and rows rewritten in place after a
        ``truncate`` show through. Pooled caches: a fresh contiguous copy
        gathered from the blocks (GIL released for large gathers); attention
        should read the blocks in place with ``attend`` instead. bfloat16 and
        int8 caches (numpy has no bfloat16; int8 rows carry scales): a fresh
        float32 copy of the values, dequantised. Closed caches: empty.
        """
        return self._claimed_view(False)

    @property
    def v(self):
        """V rows, shape ``(seq_len, n_kv_heads, v_head_dim)``; as for ``k``."""
        return self._claimed_view(True)

    cdef void _set_rows(self, _Rows r) noexcept:
        self.rows = r
        self.c.k = r.k
        self.c.v = r.v
        self.c.cap = r.cap

    # -- appending ----------------------------------------------------------

    def push(self, k_step, v_step):
        """Append one position.

        ``k_step`` holds ``n_kv_heads * head_dim`` numbers, flat or shaped
        ``(n_kv_heads, head_dim)``; ``v_step`` likewise with ``v_head_dim``.
        C-contiguous native float32 ndarrays are copied straight in (no
        conversion, no temporary), float16 ndarrays and torch float16 /
        bfloat16 CPU tensors are read in place (a straight copy into a cache
        of their dtype), each converted to the cache's dtype inside the copy
        loop; other array-likes are converted to float32 first.
        Wrong size or shape: ``ValueError``; a full pooled cache takes one more
        block, or raises ``KvPoolExhausted``. Either way nothing is appended.
        """
        cdef cnp.ndarray ka
        cdef cnp.ndarray va
        cdef int src = FX_F32
        if _is_f32(k_step) and _is_f32(v_step):      # the fast path: no conversion
            ka = <cnp.ndarray>k_step
            va = <cnp.ndarray>v_step
        else:
            ka, va, src = _rows_pair(k_step, v_step, "k_step", "v_step")
        cdef Cache* c = &self.c
        cdef const char* kp = <const char*>cnp.PyArray_DATA(ka)
        cdef const char* vp = <const char*>cnp.PyArray_DATA(va)
        cdef size_t kb, vb
        _enter(self)
        try:
            _check_rows(ka, 0, self.n_kv_heads, self.head_dim, "k_step", "")
            _check_rows(va, 0, self.n_kv_heads, self.v_head_dim, "v_step", "")
            kb = <size_t>c.kw * <size_t>_src_size(src)
            vb = <size_t>c.vw * <size_t>_src_size(src)
            if (src == FX_F32 and c.dtype == FX_F32 and c.len < c.cap and _private_at(c, c.len)
                    and not _release_pays(<Py_ssize_t>(kb + vb))
                    and not _aliases(c, kp, kb) and not _aliases(c, vp, vb)):
                memcpy(_k_row(c, c.len), kp, kb)       # the hot path: two memcpys
                memcpy(_v_row(c, c.len), vp, vb)
                c.len += 1
            else:
                _append_each((self,), &c, 1, 1, kp, vp, src)
        finally:
            _leave(self)

    def _stored(self):
        """(k, v): copies of the stored rows as bytes, uint8 ``(seq_len,
        row_bytes)`` (int8: scales included), for ``ferrox_kv.store``."""
        cdef cnp.ndarray k, v
        _enter(self)
        try:
            k = np.empty((self.c.len, self.c.k_row), np.uint8)
            v = np.empty((self.c.len, self.c.v_row), np.uint8)
            _gather_rows(&self.c, self.c.len, cnp.PyArray_DATA(k), cnp.PyArray_DATA(v))
        finally:
            _leave(self)
        return k, v

    def _extend_stored(self, k_rows, v_rows):
        """Append rows given as stored bytes (what ``_stored`` returns: C-contiguous
        uint8 ``(T, row_bytes)``), all or nothing, as ``extend``."""
        cdef Cache* c = &self.c
        cdef cnp.ndarray ka, va
        _enter(self)
        try:
            if (not isinstance(k_rows, np.ndarray) or not isinstance(v_rows, np.ndarray)
                    or k_rows.dtype != np.uint8 or v_rows.dtype != np.uint8
                    or k_rows.ndim != 2 or v_rows.ndim != 2
                    or k_rows.shape[1] != c.k_row or v_rows.shape[1] != c.v_row
                    or k_rows.shape[0] != v_rows.shape[0]):
                raise ValueError(f"stored rows must be uint8 (T, {c.k_row}) and "
                                 f"(T, {c.v_row}) arrays of one T")
            ka = np.ascontiguousarray(k_rows)
            va = np.ascontiguousarray(v_rows)
            _append_each((self,), &c, 1, ka.shape[0], cnp.PyArray_DATA(ka),
                         cnp.PyArray_DATA(va), SRC_STORED)
        finally:
            _leave(self)

    def save(self, path, *, fingerprint=None, tokens=None):
        """Park this conversation in the file ``path`` (atomic; its rows as
        stored, checksummed; ``tokens``: its ids, checked again by a load
        given them); see ``ferrox_kv.store.save_cache``."""
        from ferrox_kv.store._cache import save_cache
        return save_cache(self, path, fingerprint=fingerprint, tokens=tokens)

    @staticmethod
    def load(path, *, fingerprint=None, pool=None, max_seq_len=None, tokens=None):
        """A cache holding the conversation saved in ``path`` (verified
        first; ``tokens``: the resumed conversation's ids, which must start
        with the saved ones); see ``ferrox_kv.store.load_cache``."""
        from ferrox_kv.store._cache import load_cache
        return load_cache(path, fingerprint=fingerprint, pool=pool, max_seq_len=max_seq_len,
                          tokens=tokens)

    def extend(self, k_steps, v_steps):
        """Append T positions at once (prefill, a batch of drafts).

        Shapes ``(T, n_kv_heads, head_dim)`` or ``(T, n_kv_heads * head_dim)``
        (and ``v_head_dim`` for V). Inputs as for ``push``. All or nothing:
        every block needed is taken before anything is copied; the copy (and
        the conversion to the cache's dtype) runs without the GIL when
        large. Mismatched T, wrong shape: ``ValueError``; too few free
        blocks: ``KvPoolExhausted``. Nothing is appended when it raises.
        """
        cdef cnp.ndarray ka
        cdef cnp.ndarray va
        cdef int src
        ka, va, src = _rows_pair(k_steps, v_steps, "k_steps", "v_steps")
        cdef Cache* c = &self.c
        cdef Py_ssize_t t, tv
        _enter(self)
        try:
            t = _check_rows(ka, 1, self.n_kv_heads, self.head_dim, "k_steps", "T, ")
            tv = _check_rows(va, 1, self.n_kv_heads, self.v_head_dim, "v_steps", "T, ")
            if t != tv:
                raise ValueError(f"k_steps has {t} positions but v_steps has {tv}")
            _append_each((self,), &c, 1, t, cnp.PyArray_DATA(ka), cnp.PyArray_DATA(va), src)
        finally:
            _leave(self)

    def advance_len(self, n):
        """Append ``n`` zero rows (K and V), all or nothing."""
        cdef Py_ssize_t count = _count(n, "n", 0)
        cdef Cache* c = &self.c
        _enter(self)
        try:
            _append_each((self,), &c, 1, count, NULL, NULL, FX_F32)
        finally:
            _leave(self)

    # -- attention ------------------------------------------------------------

    def attend(self, q, *, scale=None, window=None, out=None, start=None, threads=None):
        """Causal attention of the cache's last positions, read in place.

        ``q`` is ``(n_heads, head_dim)`` for one position (returns
        ``(n_heads, v_head_dim)``) or ``(q_len, n_heads, head_dim)`` (returns
        ``(q_len, n_heads, v_head_dim)``), float32. The queries are the
        cache's last q_len positions (push or extend their K/V first, as a
        model does): query t sits at position p = seq_len - q_len + t and
        sees positions 0..p, or with ``window=w`` only p-w+1..p
        (transformers' sliding window), and never a position before
        ``start`` (left padding). Grouped-query heads: ``n_heads`` is a
        multiple of ``n_kv_heads`` and query head j reads KV head
        ``j // (n_heads // n_kv_heads)``. ``scale``, a real number (a str or
        a complex is a ``TypeError``), defaults to ``1/sqrt(head_dim)``;
        ``out`` takes a preallocated float32 array, which may overlap ``q``
        or the storage the call reads (the result is then computed into a
        temporary and copied to ``out``).

        The kernel reads the contiguous buffer, or the pool's blocks through
        the block table, in one pass with an online softmax: no gather,
        nothing of context size allocated, the GIL released for the call
        when the context is large enough to pay for it. A large call is
        split over at most ``threads`` threads (default and upper bound:
        ``get_num_threads()``): a decode by chunks of the context, then kv
        heads; a prefill by kv heads, then query blocks. A given count
        gives the same result on every run, and any count equals one
        thread's result within float32 rounding. An int8 cache reads each
        query vector quantised to int8 (one scale per vector; on AVX2 CPUs
        its scores are exact integer dot products with the stored K): that
        costs about as much accuracy as K's own quantisation. Bad shapes,
        an empty cache, q_len beyond seq_len, ``window < 1``, a wrong
        ``out`` or ``threads``: ``ValueError``, nothing changed.
        """
        return _attend_call((self,), q, scale, window, out, start, False, threads)

    # -- shrinking and detaching --------------------------------------------

    def truncate(self, new_seq_len):
        """Roll back to exactly ``new_seq_len`` positions (speculative decoding
        rejects drafts this way). Capacity and pool blocks are kept, so growing
        back costs no blocks. Beyond ``seq_len`` or negative: ``ValueError``."""
        n = _index(new_seq_len, "new_seq_len")
        _enter(self)
        try:
            if n < 0:
                raise ValueError(f"truncate target {n} must be >= 0")
            if n > self.c.len:
                raise ValueError(
                    f"truncate target {n} must not exceed current seq_len {self.c.len}")
            self.c.len = n
        finally:
            _leave(self)

    def clear(self):
        """``truncate(0)``: keeps capacity, blocks and plan."""
        self.truncate(0)

    def release_to_pool(self):
        """Give every block back to the pool now and detach from it.

        The rows are kept: they are copied (GIL released when large) into a
        private buffer of the same capacity, and from then on the cache is an
        ordinary growable cache. No-op for unpooled caches; idempotent.
        """
        cdef _Rows r
        _enter(self)
        try:
            if self.c.pool == NULL:
                return
            r = _rows_new(self.c.cap, &self.c)
            _gather_rows(&self.c, self.c.len, r.k, r.v)
            cache_detach(&self.c)
            self._set_rows(r)
        finally:
            _leave(self)

    def close(self):
        """Give every block back and free the rows. Final, as for a file:
        afterwards every operation but ``close()`` raises
        ``ValueError("KvCache is closed")``; ``seq_len`` reads 0, ``k``/``v``
        are empty and ``closed`` is true. Idempotent; ``with`` calls it on
        exit. Views already taken of a contiguous cache stay valid."""
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            cache_detach(&self.c)
            self.rows = None
            self.c.k = NULL
            self.c.v = NULL
            self.c.cap = 0
            self.c.len = 0
            self.c.plan = -1
            self.c.state = STATE_CLOSED
        finally:
            _leave(self)

    def __enter__(self):
        _enter(self)
        _leave(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    # -- accounting -----------------------------------------------------------

    def allocated_bytes(self):
        """Bytes resident for K and V: capacity, not length. Pooled caches:
        ``blocks_held * pool.block_bytes``."""
        _enter(self)
        _leave(self)
        return self.c.cap * <Py_ssize_t>(self.c.k_row + self.c.v_row)

    def is_within_planned_capacity(self):
        """True only for a ``with_capacity`` cache (or its copy) whose
        ``seq_len`` is within its plan."""
        _enter(self)
        _leave(self)
        return self.c.plan >= 0 and self.c.len <= self.c.plan

    # -- copying --------------------------------------------------------------

    def copy(self):
        """An independent contiguous cache with the same rows and plan.

        Detached from any pool: it holds no blocks and gives none back. Its
        capacity equals its length (like a Rust ``Vec`` clone), so its next
        push grows it. The copy runs without the GIL when large."""
        cdef KvCache out = KvCache.__new__(KvCache)
        cdef _Rows r
        _enter(self)
        try:
            out._copy_geometry(self)
            out.c.plan = self.c.plan
            if self.c.len:
                r = _rows_new(self.c.len, &self.c)
                _gather_rows(&self.c, self.c.len, r.k, r.v)
                out._set_rows(r)
            out.c.len = self.c.len
        finally:
            _leave(self)
        return out

    def fork(self):
        """A new cache with the same rows that shares this one's blocks.

        Pooled: every full block is shared (one more reference), the partly
        filled tail block is copied into a block of the child's own, and the
        child reserves the parent's plan beyond the shared blocks, all or
        nothing (``KvPoolExhausted``, nothing changed). Decoding within the
        plan then never needs a block in parent or child. A write into a
        shared block (only after ``truncate`` back into shared territory)
        copies that block first, which takes a free block and may raise
        ``KvPoolExhausted``. Contiguous caches: ``copy()``."""
        if self.c.pool == NULL:
            return self.copy()
        child = self._blank(1)[0]
        try:
            _assign((self, child), (0, 0))
        except BaseException:
            child.close()
            raise
        return child

    def __copy__(self):
        return self.copy()

    def __reduce__(self):
        raise TypeError(
            "KvCache objects cannot be pickled: their rows are this process's memory "
            "(a private buffer or blocks of a KvBlockPool). Copy a cache with "
            "cache.copy() (or copy.deepcopy); to save or send its rows, pickle the "
            "arrays cache.k and cache.v and extend a new cache with them")

    def __deepcopy__(self, memo):
        return self.copy()

    def __repr__(self):
        if self.c.state != STATE_OPEN:
            return (f"KvCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                    f"{'closed' if self.c.state == STATE_CLOSED else 'never initialised'})")
        kind = "pooled" if self.c.pool != NULL else "contiguous"
        return (f"KvCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, dtype={self.dtype!r}, seq_len={self.c.len}, {kind}, "
                f"capacity={self.c.cap}, blocks_held={self.c.n_blocks})")


cdef Py_ssize_t _check_rows(cnp.ndarray a, int lead, Py_ssize_t h, Py_ssize_t d,
                            str name, str lead_s) except -1:
    """Check that ``a`` is ``lead`` leading axes (named ``lead_s``, e.g.
    "T, ") followed by (h, d) or (h*d,); returns the product of the leading
    axes (1 when lead is 0)."""
    cdef int nd = cnp.PyArray_NDIM(a), i
    cdef cnp.npy_intp* shp = cnp.PyArray_DIMS(a)
    cdef Py_ssize_t n = 1
    if (nd == lead + 1 and shp[lead] == h * d) or (
            nd == lead + 2 and shp[lead] == h and shp[lead + 1] == d):
        for i in range(lead):
            n *= shp[i]
        return n
    if lead == 0:
        raise ValueError(f"{name} must have {h * d} values, flat or shaped ({h}, {d}); "
                         f"got shape {_shape(a)}")
    raise ValueError(f"{name} must be shaped ({lead_s}{h}, {d}) or ({lead_s}{h * d}); "
                     f"got shape {_shape(a)}")


cdef object _token_ids(object tokens, str name):
    """Token ids as a private 1-D int32 array (ValueError / TypeError)."""
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a sequence of integer token ids ({e})") from None
    if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and arr.size == 0):
        raise TypeError(f"{name} must be integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one sequence of token ids, got shape {arr.shape}")
    if arr.size and (arr.min() < -2**31 or arr.max() > 2**31 - 1):
        raise ValueError(f"{name} holds ids outside the int32 range")
    return np.array(arr, dtype=np.int32, copy=True)


cdef list _new_pooled(Py_ssize_t count, n_kv_heads, head_dim, v_head_dim,
                      KvBlockPool pool, max_seq_len, tokens=None, salt=None, dtype=None):
    """``count`` pooled caches of one geometry (one sequence's layers), each
    reserving max(1, ceil(max_seq_len / block_size)) blocks, in one
    acquisition. With ``tokens``, the longest published prefix of them (whole
    blocks, at most len(tokens) - 1 positions, this salt and layer count) is
    shared instead of reserved anew, and the caches start holding it."""
    cdef KvCache proto = KvCache.__new__(KvCache)
    proto._set_geometry(n_kv_heads, head_dim, v_head_dim,
                        pool.dtype if dtype is None else dtype)
    cdef Py_ssize_t max_len = _count(max_seq_len, "max_seq_len", 0)
    _check_pool_geometry(proto, pool)
    cdef Pool* p = pool.p
    cdef Py_ssize_t bs = p.block_size, per = _blocks_for(max_len, bs), i, m_max = 0, m = 0, nb
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
    if per < 1:
        per = 1
    if count == 0:
        return out
    if per > p.total or count > p.total // per:  # before sizing memory, before any store read
        raise KvPoolExhausted(per * count, pool_refuse(p))
    # blocks missing here are read through the store only while the whole
    # reservation fits in the free blocks without counting any sharing: a
    # request refused (for good or for now) never fetched, imported or evicted
    if m_max and pool._store is not None and pool_free_count(p) >= per * count:
        from ferrox_kv.store._pool import read_through
        read_through(pool, toks[:min(m_max, p.total) * bs], salt, count)
    if m_max > p.total:
        m_max = p.total
    nb = max(per, m_max)
    for i in range(count):                 # tables first: only MemoryError can fail
        c = KvCache.__new__(KvCache)
        c._copy_geometry(proto)
        _reserve_table(&c.c, nb)
        out.append(c)
    try:
        ids = <int32_t*>malloc(<size_t>(nb * count) * sizeof(int32_t))
        scratch = <int32_t*>malloc(<size_t>(m_max * (count + 1) + count * nb + 1) * sizeof(int32_t))
        keys = <uint64_t*>malloc(<size_t>(m_max + 1) * sizeof(uint64_t))
        if ids == NULL or scratch == NULL or keys == NULL:
            raise MemoryError()
        with nogil:
            if m_max:
                prefix_keys(tp, m_max, bs, <int32_t>count, salt_id, keys)
            rc = pool_reserve(p, keys if lookup else NULL, tp, m_max, <int32_t>count, salt_id,
                              per, ids, nb, scratch, &m, &r)
        if rc == FX_EXHAUSTED:
            raise KvPoolExhausted(r.needed, r.free_seen)
        if rc != 0:
            raise RuntimeError("ferrox_kv: the prefix index names a block it does not hold")
        nb = max(per, m)
        for i in range(count):
            c = <KvCache>out[i]
            memcpy(c.c.table, ids + i * max(per, m_max), <size_t>nb * sizeof(int32_t))
            pool_incref(p)
            c.c.pool = p
            c.c.n_blocks = nb
            c.c.cap = nb * bs
            c.c.len = m * bs
            c.c.shared_upto = m
            cc = &c.c
            pool_link(p, &cc, 1)
    finally:
        free(ids)
        free(scratch)
        free(keys)
    return out
