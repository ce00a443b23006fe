# Attention read in place: KvCache.attend and attend_many over the caches'
# own rows (a contiguous buffer, or the pool's blocks through the block
# table), with the kernel of _attn.h. No gather, nothing of context size is
# allocated, the GIL is released for the whole call when the context pays.

from libc.math cimport sqrt

# Attention over at least this many context bytes (K and V rows read, all
# sequences of the call together) runs without the GIL. Below it the call is
# a few microseconds and holding the GIL is cheaper than handing it over;
# benchmarks/attend_gil.py measures where releasing starts to pay.
cdef Py_ssize_t _attend_release_bytes = 131072


def attend_gil_release_threshold():
    """Context bytes (K and V rows, all sequences of one call) at or above
    which attention runs without the GIL."""
    return _attend_release_bytes


def set_attend_gil_release_threshold(Py_ssize_t nbytes):
    """Set the context size (bytes) from which attention releases the GIL;
    ``0`` releases it for every call. Returns the old value."""
    global _attend_release_bytes
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    old = _attend_release_bytes
    _attend_release_bytes = nbytes
    return old


def simd_path(dtype=None):
    """The SIMD code path the attention kernel runs on this CPU (chosen at
    load time: the wheel carries a baseline, an x86-64-v3 (AVX2) and an
    x86-64-v4 (AVX-512, 16-float vectors) version; the last runs only where
    both head dims are multiples of 16, others run the x86-64-v3 one). With
    a storage ``dtype``, also how rows of that dtype are loaded, e.g.
    ``"x86-64-v3 (AVX2+FMA); float16: F16C vcvtph2ps"``."""
    path = fx_attend_simd_path().decode()
    if dtype is None:
        return path
    return f"{path}; {fx_attend_load_path(_dtype_code(dtype, 'dtype')).decode()}"


cdef inline void _kv_of(Cache* c, fx_kv* kv) noexcept nogil:
    """Where the kernel finds a cache's rows: bytes, typed by the dtype. The
    kernel's row 0 is the first row held (position ``base``): its positions
    are the cache's less ``base`` (a window shifts with them)."""
    cdef Pool* p = c.pool
    kv.len = c.len - c.base
    kv.dtype = c.dtype
    kv.k_row = c.k_row
    kv.v_row = c.v_row
    if p == NULL:
        kv.k = c.k
        kv.v = c.v
        kv.table = NULL
        kv.block_size = 0
        kv.k_block = 0
        kv.v_block = 0
    else:
        kv.k = p.k_arena
        kv.v = p.v_arena
        kv.table = c.table
        kv.block_size = p.block_size
        kv.k_block = p.k_block
        kv.v_block = p.v_block


# The threads the last attention call was split over (tests).
cdef int _last_threads = 1


def _env_threads():
    """The default thread count: FERROX_KV_NUM_THREADS, else the CPUs this
    process may run on."""
    import os
    env = os.environ.get("FERROX_KV_NUM_THREADS")
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError("FERROX_KV_NUM_THREADS must be a positive integer (threads "
                             f"attention may use), got {env!r}")
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _thread_count(n, what):
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"{what} must be a positive int, got {n!r}")
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return min(n, 1 << 16)


def set_num_threads(n):
    """Set the threads ``attend`` and ``attend_many`` may use, the calling
    thread included (an int >= 1; above the CPU count is allowed, the extra
    threads then share CPUs); returns the previous count. The default is
    ``FERROX_KV_NUM_THREADS`` or the CPUs the process may run on. Worker
    threads are created on first use and shared by every calling thread."""
    return fx_workers_set(<int>_thread_count(n, "the thread count"))


def get_num_threads():
    """The threads ``attend`` and ``attend_many`` may use, the calling
    thread included."""
    return fx_workers_get()


def _attend_threads_used():
    """Threads the last attention call split over (1: not split)."""
    return _last_threads


def _openmp_load(path):
    """Make the GNU OpenMP runtime reached through the library at ``path``
    (already loaded: torch's libtorch_cpu) the one split calls may run on;
    returns whether it is this process's runtime (False: not loaded, no
    runtime behind it, another one chosen before, or a fork child)."""
    cdef bytes b = os.fsencode(path)
    if b"\0" in b:
        raise ValueError("path holds a NUL byte")
    return bool(fx_workers_openmp_load(b))


def _openmp_route(bint on):
    """Run this thread's later split calls on its team of the loaded OpenMP
    runtime (``_openmp_load``), or on the worker pool; returns whether the
    route is on (off without a loaded runtime, and in a fork child)."""
    return bool(fx_workers_openmp(on))


def _openmp_routed():
    """Whether this thread's split calls take the OpenMP route now."""
    return bool(fx_workers_openmp_on())


# torch's library path once the core took its OpenMP runtime; False: none.
# Read and written under _torch_omp_lock (free-threaded builds included).
cdef object _torch_omp = None
_torch_omp_lock = threading.Lock()


def _mapped_under(home, prefix):
    """The path of a library mapped into this process from directory
    ``home`` whose name starts with ``prefix``, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as maps:
            for line in maps:
                field = line.split(None, 5)
                if len(field) == 6 and field[5].startswith(home):
                    path = field[5].strip()
                    if os.path.basename(path).startswith(prefix):
                        return path
    except OSError:
        pass
    return None


def _torch_openmp():
    """The library through which torch reaches its OpenMP runtime
    (libtorch_cpu, a path under torch's directory), once the core has taken
    that runtime for its split calls (``_openmp_load``); None while torch is
    not imported, and where torch has no OpenMP, the core refused the
    runtime (not GNU OpenMP's entry points, a fork child), or
    ``FERROX_KV_TORCH_OPENMP=0``. Looked up once, on the first call that
    finds torch imported (an hf attention call, or a split call of the main
    thread); nothing is imported here, and nothing raises: anything odd
    about the ``torch`` module means no route."""
    global _torch_omp
    with _torch_omp_lock:
        if _torch_omp is None:
            torch = sys.modules.get("torch")
            if not isinstance(torch, types.ModuleType):
                return None
            try:
                usable = bool(torch.backends.openmp.is_available())
                home = os.path.join(os.path.realpath(os.path.dirname(torch.__file__)), "")
            except AttributeError:      # torch still importing: look again later
                return None
            except Exception:
                usable = False
            path = None
            if usable and os.environ.get("FERROX_KV_TORCH_OPENMP", "1") != "0":
                path = _mapped_under(home, "libtorch_cpu")
            _torch_omp = path if path is not None and _openmp_load(path) else False
        return _torch_omp or None


# Whether the main thread's split calls take torch's team (_route_width).
cdef bint _main_routes = True


def _set_route_main(bint on):
    """Test hook: whether the main thread's split calls take torch's team
    once torch is imported (the default); returns the old setting."""
    global _main_routes
    old = _main_routes
    _main_routes = on
    return old


cdef int _route_width():
    """The most threads a split call of this thread may run on torch's
    OpenMP team: ``torch.get_num_threads()`` on the main thread once torch
    is imported, where torch's operators run in most programs (its team
    spins for milliseconds after each operator, so pool threads would wait
    for those cores), so that the team holds no thread torch would not
    make; 0 (the pool) on other threads, without torch, with
    ``FERROX_KV_TORCH_OPENMP=0``, and where anything about torch is odd.
    Never raises. Called before a call claims its caches: it runs Python."""
    if not _main_routes or threading.get_ident() != threading.main_thread().ident:
        return 0
    if _torch_openmp() is None:
        return 0
    try:
        return max(0, min(int(sys.modules["torch"].get_num_threads()), 1 << 16))
    except Exception:
        return 0


cdef inline int _route_on(int nthreads, int width) noexcept:
    """Turns the route on for a split call of ``nthreads`` within
    ``width`` (``_route_width``); returns 1 where it did (the caller turns
    it off after), 0 where the call stays on the pool or the route was on
    already (``ferrox_kv.hf``, which turns it off itself)."""
    if nthreads < 2 or nthreads > width or fx_workers_openmp_on():
        return 0
    return fx_workers_openmp(1)


def _worker_threads_alive():
    """Worker threads alive in this process (created on first use)."""
    return fx_workers_alive()


def _set_attend_split(Py_ssize_t split_bytes, Py_ssize_t chunk_rows):
    """Test hook: split calls over at least ``split_bytes`` context bytes,
    decode chunks of at least ``chunk_rows`` rows ((0, 1) splits every call
    that has two threads); returns the old pair."""
    cdef Py_ssize_t b, r
    if split_bytes < 0 or chunk_rows < 1:
        raise ValueError("split_bytes must be >= 0 and chunk_rows >= 1")
    fx_attend_get_split(&b, &r)
    fx_attend_set_split(split_bytes, chunk_rows)
    return (b, r)


fx_workers_set(<int>_env_threads())


cdef object _attend_call(tuple cl, object q, object scale, object window, object out,
                         object start, bint batched, object threads=None):
    """attend (one cache, q (n_heads, d) or (q_len, n_heads, d)) and
    attend_many (B caches, q (B, q_len, n_heads, d))."""
    # 1. convert every argument (user code may run here), before any claim
    cdef cnp.ndarray qa = _f32(q, "q")
    cdef Py_ssize_t n = len(cl), i, b, win = 0, q_len, nh, hd, lead, split_bytes, chunk_rows
    cdef Py_ssize_t first
    cdef int nthreads = fx_workers_get(), rc = 0, routed = 0
    if threads is not None:
        nthreads = min(nthreads, <int>_thread_count(threads, "threads"))
    cdef double sc = 0.0
    cdef bint has_scale = scale is not None
    if has_scale:
        sc = _real(scale, "scale")
        if not (sc == sc) or abs(sc) > 3.4028234663852886e38:
            raise ValueError(f"scale must be a finite float32, got {sc}")
    if window is not None:
        win = _positions(window, "window")
    starts = None
    if start is not None:
        starts = np.asarray(start)
        if starts.dtype.kind not in "iu" or starts.ndim != batched:
            raise TypeError("start must be an integer" + (" per sequence" if batched else ""))
        starts = starts.astype(np.int64).reshape(-1)
    # torch's team's width, for a call that may split (runs Python: before the claim)
    cdef int width = _route_width() if nthreads > 1 else 0
    cdef cnp.ndarray oa = None
    if out is not None:
        if not (cnp.PyArray_Check(out) and cnp.PyArray_TYPE(<cnp.ndarray>out) == cnp.NPY_FLOAT32
                and cnp.PyArray_ISCARRAY(<cnp.ndarray>out)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>out)):
            raise ValueError("out must be a writeable C-contiguous float32 ndarray")
        oa = <cnp.ndarray>out
    if n == 0:
        raise ValueError("caches is empty")
    cdef Cache** cs = _claim_all(cl, "caches" if batched else "")
    cdef KvCache c0 = <KvCache>cl[0]
    cdef fx_kv* kvs = NULL
    cdef fx_attn_args a
    cdef float* tmp = NULL
    cdef float* qp
    cdef float* op
    cdef size_t q_stride, o_stride, ctx_bytes = 0
    cdef Py_ssize_t* st = NULL
    cdef float* tmp_out = NULL
    cdef void* work = NULL
    cdef size_t o_bytes, work_bytes
    cdef bint aliased, out_reads = False, release
    try:
        # 2. validate against the claimed caches
        _check_same_geometry(cl, "caches")
        lead = 1 + batched            # axes before (n_heads, head_dim)
        if cnp.PyArray_NDIM(qa) == lead + 1:
            q_len = -1                # one position, no q_len axis
        elif cnp.PyArray_NDIM(qa) == lead + 2:
            q_len = qa.shape[batched]
            if q_len < 1:
                raise ValueError("q_len must be >= 1: q has no query positions")
        else:
            raise ValueError(
                "q must be shaped " + ("(B, q_len, n_heads, head_dim)" if batched else
                                       "(n_heads, head_dim) or (q_len, n_heads, head_dim)")
                + f"; got {cnp.PyArray_NDIM(qa)} dimensions, shape {_shape(qa)}")
        if batched and q_len == -1:
            raise ValueError("q must be shaped (B, q_len, n_heads, head_dim); "
                             f"got shape {_shape(qa)}")
        if batched and qa.shape[0] != n:
            raise ValueError(f"q has {qa.shape[0]} sequences for {n} caches")
        nh = qa.shape[cnp.PyArray_NDIM(qa) - 2]
        hd = qa.shape[cnp.PyArray_NDIM(qa) - 1]
        if hd != c0.head_dim:
            raise ValueError(f"q has head_dim {hd}; the cache's head_dim is {c0.head_dim}")
        if nh < 1 or nh % c0.n_kv_heads != 0:
            raise ValueError(f"q has {nh} heads, not a multiple of the cache's "
                             f"n_kv_heads={c0.n_kv_heads}")
        if starts is not None and starts.shape[0] != n:
            raise ValueError(f"start has {starts.shape[0]} entries for {n} caches")
        win = _attend_window(cs, n, win, window is not None, batched)
        for i in range(n):
            if cs[i].len == 0:
                raise ValueError(f"caches[{i}] is empty: push the queries' K/V first"
                                 if batched else "the cache is empty: push the query's K/V first")
            if max(q_len, 1) > cs[i].len:
                raise ValueError(f"q_len {q_len} exceeds the seq_len {cs[i].len} of "
                                 f"{'caches[%d]' % i if batched else 'the cache'}: the queries "
                                 "are the cache's last q_len positions")
            if starts is not None and starts[i] < 0:
                raise ValueError(f"start must be >= 0, got {starts[i]}")
            first = 0 if starts is None else <Py_ssize_t>min(starts[i], cs[i].len)
            _check_held(cs[i], max(q_len, 1), win, first,
                        f"caches[{i}]" if batched else "the cache")
            ctx_bytes += <size_t>(cs[i].len - cs[i].base) * (cs[i].k_row + cs[i].v_row)
        shape = ((n,) if batched else ()) + ((q_len,) if q_len >= 0 else ()) + (nh, c0.v_head_dim)
        if oa is None:
            oa = np.empty(shape, np.float32)
        elif tuple((<object>oa).shape) != shape:
            raise ValueError(f"out must be shaped {shape}; got {_shape(oa)}")
        # 3. the kernel, once per sequence
        memset(&a, 0, sizeof(fx_attn_args))
        a.n_kv_heads = <int>c0.n_kv_heads
        a.head_dim = <int>c0.head_dim
        a.v_head_dim = <int>c0.v_head_dim
        a.n_heads = <int>nh
        a.q_len = max(q_len, 1)
        a.scale = <float>(sc if has_scale else 1.0 / sqrt(<double>c0.head_dim))
        a.window = win
        kvs = <fx_kv*>malloc(<size_t>n * sizeof(fx_kv))
        q_stride = <size_t>(a.q_len * nh * hd)
        o_stride = <size_t>(a.q_len * nh * c0.v_head_dim)
        o_bytes = <size_t>cnp.PyArray_NBYTES(oa)
        aliased = fx_overlap(cnp.PyArray_DATA(qa), <size_t>cnp.PyArray_NBYTES(qa),
                             cnp.PyArray_DATA(oa), o_bytes)
        if aliased:                    # out overlaps q: the kernel reads a copy of q
            tmp = <float*>malloc(<size_t>cnp.PyArray_NBYTES(qa) + 4)
        # out overlaps storage the kernel reads (a cache's buffer or its pool's
        # arenas, as _aliases decides for writes): the kernel writes a
        # temporary, copied to out after the last pass
        for i in range(n):
            if _aliases(cs[i], cnp.PyArray_DATA(oa), o_bytes):
                out_reads = True
        if out_reads:
            tmp_out = <float*>malloc(o_bytes + 4)
        if (kvs == NULL or (aliased and tmp == NULL)
                or (out_reads and tmp_out == NULL)):
            raise MemoryError()
        if aliased:
            memcpy(tmp, cnp.PyArray_DATA(qa), <size_t>cnp.PyArray_NBYTES(qa))
        for i in range(n):
            _kv_of(cs[i], &kvs[i])
        qp = tmp if tmp != NULL else <float*>cnp.PyArray_DATA(qa)
        op = tmp_out if tmp_out != NULL else <float*>cnp.PyArray_DATA(oa)
        if starts is not None:         # in the kernel's positions (less base)
            st = <Py_ssize_t*>malloc(<size_t>n * sizeof(Py_ssize_t))
            if st == NULL:
                raise MemoryError()
            for i in range(n):
                st[i] = max(<Py_ssize_t>min(starts[i], cs[i].len) - cs[i].base, 0)
        # a call the split leaves on this thread keeps the GIL below the
        # release threshold (fx_attend_batch applies the same split size)
        fx_attend_get_split(&split_bytes, &chunk_rows)
        if nthreads > 1 and <Py_ssize_t>ctx_bytes < split_bytes:
            nthreads = 1
        release = <Py_ssize_t>ctx_bytes >= _attend_release_bytes or nthreads > 1
        if not release:
            nthreads = 1
        # the work memory is taken here, with the GIL: no thread without it
        # allocates while another may fork
        work_bytes = fx_attend_batch_work(kvs, st, n, &a, nthreads)
        work = malloc(work_bytes)
        if work == NULL:
            raise MemoryError()
        if release:
            routed = _route_on(nthreads, width)
            try:
                with nogil:
                    rc = fx_attend_batch_in(kvs, st, n, &a, qp, q_stride, op, o_stride, nthreads,
                                            work, work_bytes)
            finally:
                if routed:
                    fx_workers_openmp(0)
        else:
            rc = fx_attend_batch_in(kvs, st, n, &a, qp, q_stride, op, o_stride, 1, work, work_bytes)
        if rc < 0:
            raise MemoryError()
        global _last_threads
        _last_threads = rc
        if tmp_out != NULL:
            memcpy(cnp.PyArray_DATA(oa), tmp_out, o_bytes)
    finally:
        free(kvs)
        free(tmp)
        free(tmp_out)
        free(st)
        free(work)
        _release_all(cs, n)
    return oa


def attend_many(caches, q, *, scale=None, window=None, out=None, start=None, threads=None):
    """Causal attention for a batch: ``q`` shaped ``(B, q_len, n_heads,
    head_dim)`` against ``B`` caches of one geometry, each with its own
    length; returns ``(B, q_len, n_heads, v_head_dim)`` float32. Sequence b's
    queries are its cache's last q_len positions, as in ``KvCache.attend``.
    ``start`` (B integers) is each sequence's first visible position, for
    left-padded batches: positions before it are never attended. ``scale``
    and ``out`` as in ``KvCache.attend``. One call, one GIL release: the
    decode step of a batch, split over at most ``threads`` threads (default
    ``get_num_threads()``) by sequences first, then (a decode) chunks of the
    context and kv heads."""
    return _attend_call(tuple(caches), q, scale, window, out, start, True, threads)
