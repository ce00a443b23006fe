# Test-only and benchmark-only hooks (not part of the public API).

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int)


def _hold_pool_lock(KvBlockPool pool not None, double seconds):
    """Hold the pool's lock for ``seconds`` without the GIL (fork test)."""
    with nogil:
        pthread_mutex_lock(&pool.p.lock)
        usleep(<unsigned int>(seconds * 1e6))
        pthread_mutex_unlock(&pool.p.lock)


def _set_constant_hash(bint on):
    """Make every prefix-cache key equal (forces hash collisions); returns
    the old setting."""
    global fx_constant_hash
    old = fx_constant_hash
    fx_constant_hash = on
    return bool(old)


def _set_attend_max_width(int width):
    """Widest vectors attention may use, 8 or 16 floats (8 runs the
    x86-64-v3 path on an AVX-512 CPU); returns the old width. Call it while
    no other thread attends."""
    if width not in (8, 16):
        raise ValueError(f"width must be 8 or 16, got {width}")
    return fx_attend_set_max_width(width)


def _set_attend_max_level(int level):
    """Highest x86-64 level attention may run: 4 (x86-64-v4), 3 (x86-64-v3)
    or 0 (the baseline), so a test runs a lower level's instantiation on
    this CPU; returns the old level. Call it while no other thread attends."""
    if level not in (0, 3, 4):
        raise ValueError(f"level must be 0, 3 or 4, got {level}")
    return fx_attend_set_max_level(level)


def _set_attend_vnni(on):
    """Whether int8 attention may score with AVX-512 VNNI (vpdpbusd) where
    the CPU has it (True, the default) or must take the AVX2 integer tile,
    so a test compares the two on one CPU; returns the old setting. Call it
    while no other thread attends."""
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    return bool(fx_attend_set_vnni(1 if on else 0))


def _take_give_loop(KvBlockPool pool not None, Py_ssize_t iters, Py_ssize_t batch):
    """Take and give back ``batch`` blocks ``iters`` times, in C, without the
    GIL. Returns how many takes were refused (pool benchmark)."""
    cdef int32_t* ids = <int32_t*>malloc((batch if batch > 0 else 1) * sizeof(int32_t))
    cdef Py_ssize_t i, refused = 0, failed
    cdef BlockReq r
    if ids == NULL:
        raise MemoryError()
    with nogil:
        for i in range(iters):
            if pool_take(pool.p, batch, ids, OWNER_RAW, &r) != 0:
                refused += 1
            else:
                r.fresh = NULL
                r.n_fresh = 0
                r.drop = ids
                r.n_drop = batch
                pools_update(&r, 1, &failed)
    free(ids)
    return refused


def _copy_floor(cnp.ndarray dst not None, cnp.ndarray src not None, Py_ssize_t row_floats):
    """memcpy ``src`` into ``dst`` row by row (rows of ``row_floats``), one C
    loop, no Python per row: the memory-bandwidth floor for the benchmark."""
    cdef char* d = <char*>cnp.PyArray_DATA(dst)
    cdef const char* s = <const char*>cnp.PyArray_DATA(src)
    cdef size_t nbytes = <size_t>cnp.PyArray_NBYTES(src)
    cdef size_t row = <size_t>row_floats * sizeof(float)
    cdef size_t off = 0
    if not (cnp.PyArray_ISCARRAY(dst) and cnp.PyArray_ISCARRAY_RO(src)):
        raise ValueError("dst must be writeable and C-contiguous, src C-contiguous")
    if cnp.PyArray_NBYTES(dst) < <cnp.npy_intp>nbytes or row == 0:
        raise ValueError("dst smaller than src, or empty rows")
    with nogil:
        while off + row <= nbytes:
            memcpy(d + off, s + off, row)
            off += row


cdef float _read_cache(Cache* c) noexcept nogil:
    """Every K and V float of a cache's rows read once, where they lie."""
    cdef Py_ssize_t r = c.base, m
    cdef float acc = 0
    while r < c.len:
        m = _run(c, r, c.len)
        acc += fx_read_rows(<const float*>_k_row(c, r), 1, <Py_ssize_t>(m * c.k_row // 4), 0)
        acc += fx_read_rows(<const float*>_v_row(c, r), 1, <Py_ssize_t>(m * c.v_row // 4), 0)
        r += m
    return acc


ctypedef struct _FloorRuns:
    const float** p           # each run's first K float, then its first V float
    Py_ssize_t* n             # floats of each
    float* acc                # one sum per slot, 16 floats apart
    Py_ssize_t runs


cdef void _floor_unit(void* ctx, Py_ssize_t u, int slot) noexcept nogil:
    cdef _FloorRuns* f = <_FloorRuns*>ctx
    f.acc[16 * slot] += fx_read_rows(f.p[u], 1, f.n[u], 0)


def _read_floor(caches, Py_ssize_t repeat=1, int threads=1):
    """The read-bandwidth floor of attention: read every stored K and V byte
    of each cache's context once (as floats; the last bytes of a run of rows
    whose bytes are not a multiple of 4 are skipped) (through its block table
    when pooled), ``repeat`` times, in C without the GIL; on ``threads``
    threads (the worker pool, as attention uses it) the runs of rows are
    shared out (on torch's team where attention's split would be: the main
    thread once torch is imported). Returns the sum (so nothing is optimised
    away)."""
    cdef tuple cl = tuple(caches)
    cdef Py_ssize_t n = len(cl), i, k, r, m, total = 0
    cdef int width = _route_width() if threads > 1 else 0, routed = 0
    cdef Cache** cs = _claim_all(cl, "caches")
    cdef float acc = 0
    cdef _FloorRuns f
    f.p = NULL
    f.n = NULL
    f.acc = NULL
    try:
        if threads <= 1:
            with nogil:
                for k in range(repeat):
                    for i in range(n):
                        acc += _read_cache(cs[i])
            return acc
        for i in range(n):
            r = cs[i].base
            while r < cs[i].len:
                r += _run(cs[i], r, cs[i].len)
                total += 2
        f.p = <const float**>malloc(<size_t>(total + 1) * sizeof(float*))
        f.n = <Py_ssize_t*>malloc(<size_t>(total + 1) * sizeof(Py_ssize_t))
        f.acc = <float*>calloc(<size_t>(16 * threads), sizeof(float))
        if f.p == NULL or f.n == NULL or f.acc == NULL:
            raise MemoryError()
        f.runs = 0
        for i in range(n):
            r = cs[i].base
            while r < cs[i].len:
                m = _run(cs[i], r, cs[i].len)
                f.p[f.runs] = <const float*>_k_row(cs[i], r)
                f.n[f.runs] = <Py_ssize_t>(m * cs[i].k_row // 4)
                f.p[f.runs + 1] = <const float*>_v_row(cs[i], r)
                f.n[f.runs + 1] = <Py_ssize_t>(m * cs[i].v_row // 4)
                f.runs += 2
                r += m
        routed = _route_on(min(threads, fx_workers_get()), width)   # as attention's split
        try:
            with nogil:
                for k in range(repeat):
                    fx_workers_run(_floor_unit, &f, f.runs, threads)
        finally:
            if routed:
                fx_workers_openmp(0)
        for k in range(threads):
            acc += f.acc[16 * k]
        return acc
    finally:
        free(f.p)
        free(f.n)
        free(f.acc)
        _release_all(cs, n)


cdef struct _Probe:
    int* slot
    pthread_t* tid
    double* acc


cdef void _probe_unit(void* ctx, Py_ssize_t u, int slot) noexcept nogil:
    cdef _Probe* p = <_Probe*>ctx
    cdef int i
    p.slot[u] = slot
    p.tid[u] = pthread_self()
    for i in range(20000):
        p.acc[u] += i * 1e-9
    if slot == 0:
        usleep(1000)                         # the caller yields its core: the others take units


def _workers_probe(Py_ssize_t units, int max_slots, bint route):
    """Test hook: run ``units`` units through fx_workers_run on at most
    ``max_slots`` threads, on this thread's OpenMP route when ``route``
    (left off after); returns (threads that joined, each unit's slot, each
    unit's thread as an int, the calling thread, whether the route was on)."""
    if units < 1 or max_slots < 1:
        raise ValueError("units and max_slots must be >= 1")
    cdef _Probe p
    cdef int joined, on
    p.slot = <int*>calloc(units, sizeof(int))
    p.tid = <pthread_t*>calloc(units, sizeof(pthread_t))
    p.acc = <double*>calloc(units, sizeof(double))
    try:
        if p.slot == NULL or p.tid == NULL or p.acc == NULL:
            raise MemoryError()
        on = fx_workers_openmp(route)
        with nogil:
            joined = fx_workers_run(_probe_unit, &p, units, max_slots)
        fx_workers_openmp(0)
        return (joined, [p.slot[i] for i in range(units)], [p.tid[i] for i in range(units)],
                pthread_self(), bool(on))
    finally:
        free(p.slot)
        free(p.tid)
        free(p.acc)


def _convert_floor(cnp.ndarray dst not None, cnp.ndarray src not None, Py_ssize_t n_heads,
                   Py_ssize_t head_dim, dtype, Py_ssize_t repeat=1):
    """Convert float32 rows ``src`` (n, n_heads * head_dim) into stored rows
    of ``dtype`` in ``dst`` (bytes, at least n rows), ``repeat`` times, in C
    without the GIL and without a cache: the conversion floor of the
    benchmark. Returns the row bytes."""
    cdef int code = _dtype_code(dtype, "dtype")
    cdef size_t row = _row_bytes(n_heads, head_dim, code)
    cdef Py_ssize_t w = n_heads * head_dim, k
    cdef Py_ssize_t n = cnp.PyArray_NBYTES(src) // (w * 4) if w > 0 else 0
    if not (cnp.PyArray_ISCARRAY(dst) and cnp.PyArray_ISCARRAY_RO(src)
            and cnp.PyArray_TYPE(src) == cnp.NPY_FLOAT32):
        raise ValueError("dst must be writeable and C-contiguous, src C-contiguous float32")
    if w <= 0 or <size_t>cnp.PyArray_NBYTES(dst) < <size_t>n * row:
        raise ValueError("dst holds fewer than n stored rows")
    with nogil:
        for k in range(repeat):
            fx_rows_from_f32(cnp.PyArray_DATA(dst), row, <const float*>cnp.PyArray_DATA(src),
                             <size_t>w, n, <int>n_heads, <int>head_dim, code)
    return row
