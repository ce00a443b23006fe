# KvCache: one sequence's K/V rows in one layer, over the C rows of _cache.pxi.

@cython.no_gc_clear
cdef class KvCache:
    """KvCache(n_kv_heads, head_dim, *, v_head_dim=None, dtype="float32", rotate=None, window=None)
--

K and V rows of one sequence in one layer.

    ``KvCache(n_kv_heads, head_dim)`` starts empty and grows geometrically;
    ``KvCache.with_capacity`` pre-allocates a plan;
    ``KvCache.with_pool`` draws fixed-size blocks from a shared
    ``KvBlockPool``, reserving its worst case up front. ``dtype`` is the
    storage: ``"float32"`` (default), ``"float16"``, ``"bfloat16"``,
    ``"int8"`` or ``"int4"`` (docs/precision.md); input rows are converted to
    it inside the copy loop. ``rotate`` applies to int4 (``KvBlockPool``
    says what it does; a pooled cache takes its pool's). ``window=W`` makes
    a sliding-window cache (see ``with_pool``): a growing buffer keeps only
    the rows from the window of the last append on.

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
                 dtype="float32", rotate=None, window=None):
        _require(type(self).__name__, ("n_kv_heads", "head_dim"), (n_kv_heads, head_dim))
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            if self.c.state != STATE_NEW:
                raise ValueError("KvCache.__init__ called on a cache that is already set up")
            self._set_geometry(n_kv_heads, head_dim, v_head_dim, dtype, rotate)
            self.c.window = _window_arg(window, None, None, 1)
        finally:
            _leave(self)

    def __dealloc__(self):
        # Only C state: give the blocks back (exactly once) and drop the pool.
        cache_detach(&self.c)

    cdef int _set_geometry(self, n_kv_heads, head_dim, v_head_dim, dtype, rotate=None) except -1:
        cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
        cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
        cdef Py_ssize_t vd = d if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        cdef int code = _storage_code(dtype, rotate, d, vd)
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
    def with_capacity(n_kv_heads, head_dim, max_seq_len, *, v_head_dim=None, dtype="float32",
                      rotate=None):
        """A cache with ``max_seq_len`` rows pre-allocated: pushes within the
        plan never reallocate. Pushing past the plan still works (it grows)."""
        cdef KvCache self = KvCache.__new__(KvCache)
        self._set_geometry(n_kv_heads, head_dim, v_head_dim, dtype, rotate)
        cdef Py_ssize_t plan = _count(max_seq_len, "max_seq_len", 0)
        self._set_rows(_rows_new(plan, &self.c))
        self.c.plan = plan
        return self

    @staticmethod
    def with_pool(n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                  *, v_head_dim=None, tokens=None, salt=None, dtype=None, window=None,
                  max_chunk=None):
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

        With ``window=W`` (a sliding-window layer: Mistral, Gemma's local
        layers, gpt-oss), the cache keeps only what attention over its last
        ``push``/``extend`` can read: that call's first query reads W
        positions up to itself, so an append of T rows to length n keeps
        positions from ``n - W + 1`` on, and blocks wholly before that go
        back to the pool at the append that next takes a block (in the same
        step) or when the cache holds more than its reservation.
        ``max_chunk`` (default ``block_size``) is the largest append the
        reservation covers: the cache reserves
        ``min(ceil(max_seq_len / block_size), ceil((W + max_chunk - 1) /
        block_size) + 1)`` blocks, and appends of up to ``max_chunk`` rows
        recycle its own blocks (a longer one, e.g. a whole prompt, takes
        blocks from the pool for that step). ``seq_len`` counts every
        position ever appended; ``first_pos`` is the first one still held.
        ``attend`` applies the window, ``truncate`` cannot go back before
        ``first_pos + W - 1``, and the cache takes no part in the prefix
        cache (``tokens=`` with ``window=`` is a ``ValueError``). ``window``
        and ``max_chunk`` are integers >= 1; a bool is a ``TypeError``.
        """
        return _new_pooled(1, n_kv_heads, head_dim, v_head_dim, pool, max_seq_len,
                           tokens, salt, dtype, window, max_chunk)[0]

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
                    c.c.resv = self.c.resv
                    cc = &c.c
                    pool_link(self.c.pool, &cc, 1)
                elif self.c.plan >= 0:
                    c._set_rows(_rows_new(self.c.plan, &c.c))
                    c.c.plan = self.c.plan
                c.c.window = self.c.window
                out.append(c)
        finally:
            _leave(self)
        return out

    @staticmethod
    def with_pool_many(count, n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                       *, v_head_dim=None, tokens=None, salt=None, dtype=None, window=None,
                       max_chunk=None):
        """``count`` pooled caches (e.g. every layer of a sequence, or every
        layer of every sequence of a batch), reserved at once.

        One acquisition of ``count * max(1, ceil(max_seq_len / block_size))``
        blocks: all the caches or none. When the pool cannot cover them all,
        ``KvPoolExhausted`` and the pool is untouched (one refusal counted).
        With ``tokens``, the caches are one sequence's ``count`` layers and
        reuse its longest published prefix, as ``with_pool`` does. With
        ``window=W``, every cache has that sliding window and each reserves
        what the window needs, as ``with_pool`` says.

        ``window`` may also be a sequence of ``count`` entries, one per cache
        in order: an int (that cache's window) or None (no window), e.g.
        ``layer_windows(config)`` for one sequence's layers. The acquisition
        is still one: the sum of what each cache reserves, all or nothing.
        ``max_chunk`` sizes every windowed entry's reservation. A sequence
        of the wrong length is a ``ValueError``, an entry that is not an int
        or None a ``TypeError``, an entry below 1 a ``ValueError``, and
        ``tokens=`` goes only with a sequence whose entries are all None
        (``ValueError`` naming the first windowed entry); nothing is
        reserved then.
        """
        cdef Py_ssize_t n = _count(count, "count", 0)
        return _new_pooled(n, n_kv_heads, head_dim, v_head_dim, pool, max_seq_len,
                           tokens, salt, dtype, window, max_chunk)

    # -- read-only state (answers in every state) ---------------------------

    @property
    def seq_len(self):
        """Positions appended (and not truncated), counting those a sliding
        window has given back."""
        return self.c.len

    @property
    def first_pos(self):
        """The position of the first row still held: 0, unless a sliding
        window gave earlier blocks back. ``k``/``v`` start there."""
        return self.c.base

    @property
    def window(self):
        """The sliding window (``with_pool(..., window=W)``), or None."""
        return self.c.window if self.c.window else None

    def __len__(self):
        return self.c.len

    @property
    def dtype(self):
        """The storage dtype, as a name: ``"float32"``, ``"float16"``,
        ``"bfloat16"``, ``"int8"`` or ``"int4"`` (what ``dtype=`` takes back)."""
        return _DTYPE_OF_CODE[self.c.dtype]

    @property
    def rotate(self):
        """Whether rows are stored Hadamard-rotated (int4 with rotate on)."""
        return self.c.dtype == FX_I4H

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
        """(seq_len - first_pos, n_kv_heads, dim) array of K or V: float32 and float16
        caches give a read-only view of the contiguous buffer, or a gathered
        copy when pooled; bfloat16, int8 and int4 caches a float32 copy of
        the values (dequantised, rotated back). Cache claimed."""
        cdef cnp.npy_intp dims[3]
        cdef Py_ssize_t n = self.c.len - self.c.base
        cdef void* data
        cdef cnp.ndarray arr
        cdef bint values = (self.c.dtype == FX_BF16 or self.c.dtype == FX_I8
                            or self.c.dtype == FX_I4 or self.c.dtype == FX_I4H)
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
        """K rows held, shape ``(seq_len - first_pos, n_kv_heads, head_dim)``:
        float32 for float32, bfloat16, int8 and int4 caches, float16 for
        float16 caches. Row i is position ``first_pos + i`` (``first_pos`` is
        0 unless a sliding window gave earlier positions back).

        Contiguous float32 / float16 caches: a read-only zero-copy view that
        keeps its buffer alive; if the cache later grows into a new buffer the
        view goes on showing the old one, and rows rewritten in place after a
        ``truncate`` show through. Pooled caches: a fresh contiguous copy
        gathered from the blocks (GIL released for large gathers); attention
        should read the blocks in place with ``attend`` instead. bfloat16 and
        int8 and int4 caches (numpy has no bfloat16; int8 / int4 rows carry
        scales): a fresh float32 copy of the values, dequantised (int4 with
        rotation: rotated back, so what was pushed up to the quantisation
        error). Closed caches: empty.
        """
        return self._claimed_view(False)

    @property
    def v(self):
        """V rows held, shape ``(seq_len - first_pos, n_kv_heads, v_head_dim)``;
        as for ``k``."""
        return self._claimed_view(True)

    cdef void _set_rows(self, _Rows r) noexcept:
        self.rows = r
        self.c.k = r.k
        self.c.v = r.v
        self.c.cap = self.c.base + r.cap

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
                    and not _trim_due(c) and not _release_pays(<Py_ssize_t>(kb + vb))
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
        row_bytes)`` (int8: scales included), for ``ferrox_kv.store``. A
        windowed cache: ``ValueError`` (it holds part of its sequence)."""
        cdef cnp.ndarray k, v
        _enter(self)
        try:
            if self.c.window:
                raise ValueError(
                    f"a cache with a sliding window ({self.c.window}) cannot be saved or "
                    "exported: it holds only the positions its window still reads")
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
        given them); forwards to ``ferrox_kv.store.save_cache``."""
        return _store_files().save_cache(self, path, fingerprint=fingerprint, tokens=tokens)

    @staticmethod
    def load(path, *, fingerprint=None, pool=None, max_seq_len=None, tokens=None):
        """A cache holding the conversation saved in ``path`` (verified
        first; ``tokens``: the resumed conversation's ids, which must start
        with the saved ones); forwards to ``ferrox_kv.store.load_cache``."""
        return _store_files().load_cache(path, fingerprint=fingerprint, pool=pool,
                                         max_seq_len=max_seq_len, tokens=tokens)

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

        A cache with a sliding window (``with_pool(..., window=W)``) applies
        its own window when ``window`` is None; a larger ``window`` is a
        ``ValueError``, and so is a call whose queries would read a
        position the window gave back (more queries than its last append
        added). Positions before the window are never read.
        """
        return _attend_call((self,), q, scale, window, out, start, False, threads)

    # -- shrinking and detaching --------------------------------------------

    def truncate(self, new_seq_len):
        """Roll back to exactly ``new_seq_len`` positions (speculative decoding
        rejects drafts this way). Capacity and pool blocks are kept, so growing
        back costs no blocks. Beyond ``seq_len`` or negative: ``ValueError``.
        A sliding-window cache rolls back within its window: a target whose
        next append would read a position given back (below ``first_pos +
        window - 1``, other than 0) is a ``ValueError`` that says so,
        nothing changed. ``truncate(0)`` (and ``clear()``) always works: the
        blocks held then hold positions from 0 again."""
        n = _index(new_seq_len, "new_seq_len")
        _enter(self)
        try:
            if n < 0:
                raise ValueError(f"truncate target {n} must be >= 0")
            if n > self.c.len:
                raise ValueError(
                    f"truncate target {n} must not exceed current seq_len {self.c.len}")
            _check_truncate(&self.c, n)
            if n == 0 and self.c.base:     # a window starts over: its rows from position 0
                self.c.cap -= self.c.base
                self.c.base = 0
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
        ordinary growable cache. No-op for unpooled caches; idempotent. A
        windowed cache keeps its window and the rows it held (from
        ``first_pos``), and from then on gives nothing back.
        """
        cdef _Rows r
        _enter(self)
        try:
            if self.c.pool == NULL:
                return
            r = _rows_new(self.c.cap - self.c.base, &self.c)
            _gather_rows(&self.c, self.c.len - self.c.base, r.k, r.v)
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
        return (self.c.cap - self.c.base) * <Py_ssize_t>(self.c.k_row + self.c.v_row)

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
        push grows it. The copy runs without the GIL when large. A windowed
        cache's copy has its window and the rows it holds (from
        ``first_pos``)."""
        cdef KvCache out = KvCache.__new__(KvCache)
        cdef _Rows r
        _enter(self)
        try:
            out._copy_geometry(self)
            out.c.plan = self.c.plan
            out.c.window = self.c.window
            out.c.base = self.c.base
            out.c.cap = self.c.base
            if self.c.len > self.c.base:
                r = _rows_new(self.c.len - self.c.base, &self.c)
                _gather_rows(&self.c, self.c.len - self.c.base, r.k, r.v)
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
        ``KvPoolExhausted``. A windowed cache's child has its window, the
        blocks from ``first_pos`` on and its reservation. Contiguous caches:
        ``copy()``."""
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
                f"v_head_dim={self.v_head_dim}, dtype={self.dtype!r}, seq_len={self.c.len}, "
                f"{kind}, "
                + (f"window={self.c.window}, first_pos={self.c.base}, " if self.c.window else "")
                + f"capacity={self.c.cap}, blocks_held={self.c.n_blocks})")
