# cython: language_level=3
"""The ferrox_kv core: a paged KV block pool and per-sequence KV caches.

Shape (after explosion/preshed ``maps.pxd``): two C structs, ``Pool`` and
``Cache``, and ``noexcept nogil`` C functions that do every hot piece of work on
raw ``float*`` (copying rows, gathering blocks, zero-filling, moving block ids).
The ``cdef class``es on top only validate arguments, call those functions and
build Python objects.

Locking rules (see the README's "Thread safety"):

* One pthread mutex per pool, held only while block ids move. Nothing inside
  the locked region makes a Python object, raises or can run the garbage
  collector; errors come back as codes and are raised after unlocking.
* A pool's C struct is reference counted (atomically) by its ``KvBlockPool``
  object and by every cache that holds blocks of it, so a cache may outlive the
  Python pool object and still give its blocks back from ``__dealloc__``
  touching only C state.
* Every ``KvCache`` method claims the cache with an atomic flag for its
  duration; a second thread that calls into the same cache meanwhile gets a
  ``RuntimeError`` instead of racing on its memory.
* Fork: ``os.register_at_fork`` takes every pool lock before ``fork()`` and
  re-initialises them afterwards, so a child never inherits a held lock or a
  half-moved free list.
"""

cimport cython
from libc.stdint cimport int32_t, uint64_t, INT32_MAX
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset

cimport numpy as cnp
import numpy as np
import os

cnp.import_array()

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)

cdef extern from "<unistd.h>" nogil:
    int usleep(unsigned int)

cdef extern from *:
    """
    #include <pthread.h>
    static pthread_mutex_t fx_registry_lock = PTHREAD_MUTEX_INITIALIZER;
    static inline int fx_try_claim(int *flag) {
        int expected = 0;
        return __atomic_compare_exchange_n(flag, &expected, 1, 0,
                                           __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
    }
    static inline void fx_unclaim(int *flag) { __atomic_store_n(flag, 0, __ATOMIC_RELEASE); }
    static inline long fx_incref(long *p) { return __atomic_add_fetch(p, 1, __ATOMIC_RELAXED); }
    static inline long fx_decref(long *p) { return __atomic_sub_fetch(p, 1, __ATOMIC_ACQ_REL); }
    static inline int fx_mul(size_t a, size_t b, size_t *out) { return __builtin_mul_overflow(a, b, out); }
    #include <sys/mman.h>
    /* Ask for transparent huge pages on large buffers, as numpy does for its
       own (>= 4 MiB): first-touch page faults then cost 512x fewer traps.
       The pages stay lazily allocated, so untouched memory still costs none. */
    static inline void fx_advise_huge(void *p, size_t nbytes) {
    #ifdef MADV_HUGEPAGE
        if (p != NULL && nbytes >= ((size_t)4 << 20)) {
            size_t page = 4096;
            size_t start = ((size_t)p + page - 1) & ~(page - 1);
            size_t end = ((size_t)p + nbytes) & ~(page - 1);
            if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
        }
    #endif
    }
    """
    pthread_mutex_t fx_registry_lock
    bint fx_try_claim(int* flag) noexcept nogil
    void fx_unclaim(int* flag) noexcept nogil
    long fx_incref(long* p) noexcept nogil
    long fx_decref(long* p) noexcept nogil
    bint fx_mul(size_t a, size_t b, size_t* out) noexcept nogil
    void fx_advise_huge(void* p, size_t nbytes) noexcept nogil


# ---------------------------------------------------------------------------
# Tunables
# ---------------------------------------------------------------------------

# Copies of at least this many bytes (K and V together, per call) run with the
# GIL released; smaller ones keep it, because a GIL release/re-acquire costs
# about as much as copying a few KB and threads convoy on the GIL when they
# release it around every small row. benchmarks/gil_threshold.py measures it:
# on the 2-core development machine releasing lost or broke even up to 128 KB
# per call (0.42x at 4 KB, 0.92x at 64 KB, 1.08x at 128 KB with 2 threads)
# and paid from 256 KB (1.82x).
cdef Py_ssize_t _gil_release_bytes = 131072

# The largest byte count any single allocation may have: beyond it ValueError.
cdef size_t _MAX_BYTES = <size_t>0x7fffffffffffffff


def gil_release_threshold():
    """Bytes copied per call at or above which the copy runs without the GIL."""
    return _gil_release_bytes


def set_gil_release_threshold(Py_ssize_t nbytes):
    """Set the copy size (bytes per call, K and V together) from which the GIL
    is released. ``0`` releases it for every copy; returns the old value."""
    global _gil_release_bytes
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    old = _gil_release_bytes
    _gil_release_bytes = nbytes
    return old


class KvPoolExhausted(Exception):
    """A pool had fewer free blocks than an operation needed.

    Nothing was changed when it is raised. ``requested`` is the number of
    blocks the operation needed, ``free`` the number the pool had free.
    """

    def __init__(self, requested, free):
        self.requested = requested
        self.free = free
        super().__init__(
            f"KV cache block pool exhausted: {requested} block(s) requested, "
            f"{free} free")

    def __reduce__(self):
        return (KvPoolExhausted, (self.requested, self.free))


# ---------------------------------------------------------------------------
# The C pool
# ---------------------------------------------------------------------------

ctypedef struct Pool:
    pthread_mutex_t lock
    long refcnt                 # KvBlockPool object + every attached cache
    Py_ssize_t block_size
    Py_ssize_t total
    Py_ssize_t n_free
    Py_ssize_t kw               # K row width in floats (n_kv_heads * head_dim)
    Py_ssize_t vw               # V row width in floats
    size_t k_block_floats       # block_size * kw
    size_t v_block_floats
    float* k_arena
    float* v_arena
    int32_t* free_stack         # ids of free blocks; top at n_free - 1
    int32_t* block_refs         # per-block holder count (0 = free)
    unsigned char* block_owner  # per-block holder kind: OWNER_FREE/CACHE/RAW
    Py_ssize_t high_water
    uint64_t acquired
    uint64_t released
    uint64_t refused
    Pool* reg_prev              # registry of live pools, for fork handling
    Pool* reg_next

cdef Pool* _registry_head = NULL

# Who holds a block: caches give back only what caches took, and
# KvBlockPool.free only what KvBlockPool.allocate handed out.
cdef enum:
    OWNER_FREE = 0
    OWNER_CACHE = 1
    OWNER_RAW = 2


cdef Pool* pool_new(Py_ssize_t block_size, Py_ssize_t total, Py_ssize_t kw,
                    Py_ssize_t vw) noexcept nogil:
    """Allocate a pool; NULL when memory is short. Sizes are pre-validated."""
    cdef Pool* p = <Pool*>calloc(1, sizeof(Pool))
    cdef Py_ssize_t i
    cdef size_t n_k = <size_t>total * <size_t>block_size * <size_t>kw
    cdef size_t n_v = <size_t>total * <size_t>block_size * <size_t>vw
    if p == NULL:
        return NULL
    p.block_size = block_size
    p.total = total
    p.n_free = total
    p.kw = kw
    p.vw = vw
    p.k_block_floats = <size_t>block_size * <size_t>kw
    p.v_block_floats = <size_t>block_size * <size_t>vw
    # calloc: untouched pages of a large arena are never made resident.
    p.k_arena = <float*>calloc(n_k if n_k > 0 else 1, sizeof(float))
    p.v_arena = <float*>calloc(n_v if n_v > 0 else 1, sizeof(float))
    p.free_stack = <int32_t*>malloc((total if total > 0 else 1) * sizeof(int32_t))
    p.block_refs = <int32_t*>calloc(total if total > 0 else 1, sizeof(int32_t))
    p.block_owner = <unsigned char*>calloc(total if total > 0 else 1, 1)
    if (p.k_arena == NULL or p.v_arena == NULL or p.free_stack == NULL
            or p.block_refs == NULL or p.block_owner == NULL):
        free(p.k_arena); free(p.v_arena); free(p.free_stack); free(p.block_refs)
        free(p.block_owner)
        free(p)
        return NULL
    fx_advise_huge(p.k_arena, n_k * sizeof(float))
    fx_advise_huge(p.v_arena, n_v * sizeof(float))
    # Lowest ids on top, so a fresh pool hands out 0, 1, 2, ...
    for i in range(total):
        p.free_stack[i] = <int32_t>(total - 1 - i)
    pthread_mutex_init(&p.lock, NULL)
    p.refcnt = 1
    pthread_mutex_lock(&fx_registry_lock)
    global _registry_head
    p.reg_next = _registry_head
    if _registry_head != NULL:
        _registry_head.reg_prev = p
    _registry_head = p
    pthread_mutex_unlock(&fx_registry_lock)
    return p


cdef inline void pool_incref(Pool* p) noexcept nogil:
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
    free(p.k_arena)
    free(p.v_arena)
    free(p.free_stack)
    free(p.block_refs)
    free(p.block_owner)
    free(p)


cdef int pool_take(Pool* p, Py_ssize_t n, int32_t* out,
                   Py_ssize_t* free_seen, int owner=OWNER_CACHE) noexcept nogil:
    """Take ``n`` blocks into ``out`` for ``owner``, all or nothing.

    Returns 0, or -1 when fewer than ``n`` are free (``free_seen`` then holds
    how many were). The lock is held only while ids move.
    """
    cdef Py_ssize_t i, used
    cdef int32_t b
    pthread_mutex_lock(&p.lock)
    if n > p.n_free:
        free_seen[0] = p.n_free
        p.refused += 1
        pthread_mutex_unlock(&p.lock)
        return -1
    for i in range(n):
        p.n_free -= 1
        b = p.free_stack[p.n_free]
        p.block_refs[b] = 1
        p.block_owner[b] = <unsigned char>owner
        out[i] = b
    p.acquired += <uint64_t>n
    used = p.total - p.n_free
    if used > p.high_water:
        p.high_water = used
    free_seen[0] = p.n_free
    pthread_mutex_unlock(&p.lock)
    return 0


cdef int pool_give(Pool* p, const int32_t* ids, Py_ssize_t n,
                   int owner=OWNER_CACHE) noexcept nogil:
    """Drop one reference to each of ``ids``; blocks reaching 0 become free.

    All or nothing: returns -1 if an id is out of range, -2 if one is not
    held by ``owner`` as often as it is named (changing nothing either way);
    0 otherwise.
    """
    cdef Py_ssize_t i, j
    cdef int32_t b
    for i in range(n):
        if ids[i] < 0 or ids[i] >= p.total:
            return -1
    pthread_mutex_lock(&p.lock)
    for i in range(n):
        b = ids[i]
        if p.block_refs[b] <= 0 or p.block_owner[b] != owner:
            for j in range(i):
                p.block_refs[ids[j]] += 1
            pthread_mutex_unlock(&p.lock)
            return -2
        p.block_refs[b] -= 1
    for i in range(n):
        b = ids[i]
        if p.block_refs[b] == 0:
            p.free_stack[p.n_free] = b
            p.n_free += 1
            p.block_owner[b] = OWNER_FREE
            p.block_refs[b] = -1          # pushed once, even if named twice
            p.released += 1
    for i in range(n):
        if p.block_refs[ids[i]] == -1:
            p.block_refs[ids[i]] = 0
    pthread_mutex_unlock(&p.lock)
    return 0


cdef Py_ssize_t pool_free(Pool* p) noexcept nogil:
    """The free-block count, read under the lock."""
    cdef Py_ssize_t n
    pthread_mutex_lock(&p.lock)
    n = p.n_free
    pthread_mutex_unlock(&p.lock)
    return n


cdef Py_ssize_t pool_refuse(Pool* p) noexcept nogil:
    """Count a refusal decided without taking blocks; returns the free count."""
    cdef Py_ssize_t n
    pthread_mutex_lock(&p.lock)
    p.refused += 1
    n = p.n_free
    pthread_mutex_unlock(&p.lock)
    return n


def _fork_before():
    # Take the registry lock, then every pool lock (lock order: registry,
    # then pools; pool operations never take the registry lock), all WITH the
    # GIL held, and keep it until fork() returns: a thread that holds a pool
    # lock never needs the GIL, so it always lets go; and no other thread can
    # hold the GIL while it waits for a pool lock we hold. (Releasing the GIL
    # here deadlocked: another thread took it, then waited in pool_take for a
    # lock this thread held, while this thread waited for the GIL.)
    cdef Pool* p
    pthread_mutex_lock(&fx_registry_lock)
    p = _registry_head
    while p != NULL:
        pthread_mutex_lock(&p.lock)
        p = p.reg_next


def _fork_after_parent():
    cdef Pool* p = _registry_head
    while p != NULL:
        pthread_mutex_unlock(&p.lock)
        p = p.reg_next
    pthread_mutex_unlock(&fx_registry_lock)


def _fork_after_child():
    # The child has one thread (this one); the free lists are consistent
    # because no other thread was inside a locked region at fork time.
    cdef Pool* p = _registry_head
    while p != NULL:
        pthread_mutex_init(&p.lock, NULL)
        p = p.reg_next
    pthread_mutex_init(&fx_registry_lock, NULL)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_fork_before,
                        after_in_parent=_fork_after_parent,
                        after_in_child=_fork_after_child)


# ---------------------------------------------------------------------------
# Argument helpers
# ---------------------------------------------------------------------------

cdef Py_ssize_t _count(object value, str name, Py_ssize_t minimum) except -1:
    """An integer argument >= minimum, or ValueError/TypeError naming it."""
    cdef Py_ssize_t n
    try:
        ivalue = value.__index__()
    except AttributeError:
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__}") from None
    if ivalue < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {ivalue}")
    if ivalue > INT32_MAX * <Py_ssize_t>4096 * 4096:
        raise ValueError(f"{name} is too large: {ivalue}")
    n = ivalue
    return n


cdef size_t _checked_bytes(str what, Py_ssize_t a, Py_ssize_t b,
                           Py_ssize_t c) except 0:
    """a * b * c * sizeof(float), or ValueError if it overflows.

    Returns at least 1 so that 0 can signal an exception.
    """
    cdef size_t out
    if (fx_mul(<size_t>a, <size_t>b, &out) or fx_mul(out, <size_t>c, &out)
            or fx_mul(out, sizeof(float), &out) or out > _MAX_BYTES):
        raise ValueError(f"{what}: {a} x {b} x {c} float32 overflows the byte count")
    return out if out > 0 else 1


# ---------------------------------------------------------------------------
# KvBlockPool
# ---------------------------------------------------------------------------

@cython.final
cdef class KvBlockPool:
    """A bounded pool of fixed-size KV blocks shared by every cache of a process.

    ``KvBlockPool(block_size, total_blocks, n_kv_heads, head_dim, *, v_head_dim=None)``

    A block holds ``block_size`` positions of one layer's K rows
    (``n_kv_heads * head_dim`` float32 each) and V rows
    (``n_kv_heads * v_head_dim``). The pool owns one K arena and one V arena of
    ``total_blocks`` blocks, allocated with ``calloc`` so that untouched blocks
    cost no physical memory. Block ids move through an O(1) free list under one
    native mutex, held only while ids move. ``free_blocks`` is the
    admission-control signal.

    All methods are safe to call from many threads at once.
    """
    cdef Pool* p
    cdef readonly Py_ssize_t n_kv_heads
    cdef readonly Py_ssize_t head_dim
    cdef readonly Py_ssize_t v_head_dim

    def __cinit__(self, block_size, total_blocks, n_kv_heads, head_dim, *,
                  v_head_dim=None):
        self.p = NULL
        cdef Py_ssize_t bs = _count(block_size, "block_size", 1)
        cdef Py_ssize_t total = _count(total_blocks, "total_blocks", 0)
        cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
        cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
        cdef Py_ssize_t vd = d if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        if total > INT32_MAX:
            raise ValueError(f"total_blocks must be <= {INT32_MAX}, got {total}")
        _checked_bytes("block_size * n_kv_heads * head_dim", bs, h, d)
        _checked_bytes("block_size * n_kv_heads * v_head_dim", bs, h, vd)
        _checked_bytes("total_blocks * block_size * K row", total, bs, h * d)
        _checked_bytes("total_blocks * block_size * V row", total, bs, h * vd)
        self.n_kv_heads = h
        self.head_dim = d
        self.v_head_dim = vd
        with nogil:
            self.p = pool_new(bs, total, h * d, h * vd)
        if self.p == NULL:
            raise MemoryError(f"cannot allocate a pool of {total} blocks of {bs} positions")

    def __init__(self, block_size, total_blocks, n_kv_heads, head_dim, *, v_head_dim=None):
        pass    # all done in __cinit__; here so the signature is introspectable

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
        """Blocks free right now (a snapshot under the lock)."""
        return pool_free(self.p)

    @property
    def used_blocks(self):
        """Blocks held by caches (or by ``allocate``) right now."""
        return self.p.total - self.free_blocks

    @property
    def block_bytes(self):
        """Bytes of one block, K and V together."""
        return (self.p.k_block_floats + self.p.v_block_floats) * sizeof(float)

    def stats(self):
        """A consistent snapshot of the pool's counters, as a dict.

        Keys: ``total_blocks``, ``free_blocks``, ``used_blocks``,
        ``high_water`` (most blocks ever used at once), ``acquired`` and
        ``released`` (blocks taken and given back since creation),
        ``refused`` (acquisitions refused for lack of blocks), ``block_size``,
        ``block_bytes``.
        """
        cdef Py_ssize_t free_, high
        cdef uint64_t acq, rel, ref
        with nogil:
            pthread_mutex_lock(&self.p.lock)
            free_ = self.p.n_free
            high = self.p.high_water
            acq = self.p.acquired
            rel = self.p.released
            ref = self.p.refused
            pthread_mutex_unlock(&self.p.lock)
        return {
            "total_blocks": self.p.total,
            "free_blocks": free_,
            "used_blocks": self.p.total - free_,
            "high_water": high,
            "acquired": acq,
            "released": rel,
            "refused": ref,
            "block_size": self.p.block_size,
            "block_bytes": self.block_bytes,
        }

    cdef cnp.ndarray _arena_view(self, float* base, Py_ssize_t width_last):
        cdef cnp.npy_intp dims[4]
        dims[0] = self.p.total
        dims[1] = self.p.block_size
        dims[2] = self.n_kv_heads
        dims[3] = width_last
        cdef cnp.ndarray arr = cnp.PyArray_SimpleNewFromData(4, dims, cnp.NPY_FLOAT32, base)
        cnp.set_array_base(arr, self)          # the view keeps the pool alive
        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
        return arr

    @property
    def key_blocks(self):
        """Read-only zero-copy view of the K arena,
        shape ``(total_blocks, block_size, n_kv_heads, head_dim)``; it keeps the
        arena alive. Row ``r`` of a pooled cache lives at
        ``key_blocks[cache.block_table[r // block_size], r % block_size]``."""
        return self._arena_view(self.p.k_arena, self.head_dim)

    @property
    def value_blocks(self):
        """Read-only zero-copy view of the V arena,
        shape ``(total_blocks, block_size, n_kv_heads, v_head_dim)``."""
        return self._arena_view(self.p.v_arena, self.v_head_dim)

    def allocate(self, n):
        """Take ``n`` blocks, all or nothing, and return their ids (int32 array).

        For block managers that keep their own tables (e.g. a GPU server's
        Python scheduler). Raises ``KvPoolExhausted`` with nothing taken when
        fewer than ``n`` are free. Give them back with ``free(ids)``.
        """
        cdef Py_ssize_t count = _count(n, "n", 0)
        cdef Py_ssize_t free_seen = 0
        cdef cnp.npy_intp dim = count
        cdef cnp.ndarray ids = cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)
        cdef int rc = pool_take(self.p, count, <int32_t*>cnp.PyArray_DATA(ids), &free_seen,
                                OWNER_RAW)
        if rc != 0:
            raise KvPoolExhausted(count, free_seen)
        return ids

    def free(self, block_ids):
        """Give back blocks taken with ``allocate``.

        All or nothing: if any id is out of range or not currently held (or is
        named more often than it is held), ``ValueError`` and nothing changes.
        """
        cdef cnp.ndarray ids
        cdef int rc
        if (cnp.PyArray_Check(block_ids)
                and cnp.PyArray_TYPE(<cnp.ndarray>block_ids) == cnp.NPY_INT32
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>block_ids)
                and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>block_ids)):
            ids = <cnp.ndarray>block_ids      # what allocate() returned: no copy
        else:
            wide = np.asarray(block_ids)
            if wide.size == 0:
                return
            if wide.dtype.kind not in "iu":
                raise TypeError(f"block_ids must be integers, got dtype {wide.dtype}")
            wide = wide.astype(np.int64).ravel()
            if wide.size and (wide.min() < 0 or wide.max() >= self.p.total):
                raise ValueError(f"block id out of range 0..{self.p.total - 1}")
            ids = wide.astype(np.int32)
        rc = pool_give(self.p, <int32_t*>cnp.PyArray_DATA(ids), cnp.PyArray_SIZE(ids), OWNER_RAW)
        if rc == -1:
            raise ValueError(f"block id out of range 0..{self.p.total - 1}")
        if rc != 0:
            raise ValueError("block_ids names a block that is not held from allocate() "
                             "(a double free, or a block a cache holds); nothing was "
                             "given back")

    def __repr__(self):
        return (f"KvBlockPool(block_size={self.p.block_size}, "
                f"total_blocks={self.p.total}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"free_blocks={self.free_blocks})")


# ---------------------------------------------------------------------------
# Contiguous row storage owned by a refcounted Python object, so that views
# keep exactly the buffer they show alive.
# ---------------------------------------------------------------------------

@cython.final
@cython.no_gc
cdef class _Rows:
    """One malloc'd buffer: ``cap`` K rows followed by ``cap`` V rows."""
    cdef float* k
    cdef float* v
    cdef Py_ssize_t cap

    def __cinit__(self):
        self.k = NULL
        self.v = NULL
        self.cap = 0

    def __dealloc__(self):
        free(self.k)
        self.k = NULL
        self.v = NULL


cdef _Rows _rows_new(Py_ssize_t cap, Py_ssize_t kw, Py_ssize_t vw):
    cdef size_t nbytes = _checked_bytes("capacity * row width", cap, kw + vw, 1)
    cdef _Rows r = _Rows.__new__(_Rows)
    r.k = <float*>malloc(nbytes)
    if r.k == NULL:
        raise MemoryError(f"cannot allocate {nbytes} bytes for {cap} KV rows")
    fx_advise_huge(r.k, nbytes)
    r.v = r.k + <size_t>cap * <size_t>kw
    r.cap = cap
    return r


# ---------------------------------------------------------------------------
# The C cache and its hot functions
# ---------------------------------------------------------------------------

ctypedef struct Cache:
    Py_ssize_t kw               # K row width in floats
    Py_ssize_t vw               # V row width in floats
    Py_ssize_t len              # positions stored
    Py_ssize_t cap              # rows that fit without growing / new blocks
    float* k                    # contiguous storage (NULL when pooled)
    float* v
    Pool* pool                  # NULL unless pooled (then one reference held)
    int32_t* table              # block ids, in order (pooled only)
    Py_ssize_t n_blocks
    Py_ssize_t table_cap
    Py_ssize_t plan             # with_capacity plan, -1 when none
    int busy                    # claimed by a method call


cdef inline float* _k_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.k + <size_t>r * <size_t>c.kw
    return (p.k_arena + <size_t>c.table[r // p.block_size] * p.k_block_floats
            + <size_t>(r % p.block_size) * <size_t>c.kw)


cdef inline float* _v_row(Cache* c, Py_ssize_t r) noexcept nogil:
    cdef Pool* p = c.pool
    if p == NULL:
        return c.v + <size_t>r * <size_t>c.vw
    return (p.v_arena + <size_t>c.table[r // p.block_size] * p.v_block_floats
            + <size_t>(r % p.block_size) * <size_t>c.vw)


cdef inline Py_ssize_t _run(Cache* c, Py_ssize_t r, Py_ssize_t end) noexcept nogil:
    """How many rows from ``r`` (before ``end``) are contiguous in memory."""
    cdef Py_ssize_t n
    if c.pool == NULL:
        return end - r
    n = c.pool.block_size - r % c.pool.block_size
    return n if n < end - r else end - r


cdef void cache_write(Cache* c, Py_ssize_t start, Py_ssize_t n,
                      const float* k, const float* v) noexcept nogil:
    """Copy ``n`` K and V rows (row-major) into positions start..start+n."""
    cdef Py_ssize_t r = start, end = start + n, m
    while r < end:
        m = _run(c, r, end)
        memcpy(_k_row(c, r), k, <size_t>m * <size_t>c.kw * sizeof(float))
        memcpy(_v_row(c, r), v, <size_t>m * <size_t>c.vw * sizeof(float))
        k += <size_t>m * <size_t>c.kw
        v += <size_t>m * <size_t>c.vw
        r += m


cdef void cache_zero(Cache* c, Py_ssize_t start, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t r = start, end = start + n, m
    while r < end:
        m = _run(c, r, end)
        memset(_k_row(c, r), 0, <size_t>m * <size_t>c.kw * sizeof(float))
        memset(_v_row(c, r), 0, <size_t>m * <size_t>c.vw * sizeof(float))
        r += m


cdef void cache_gather(Cache* c, Py_ssize_t start, Py_ssize_t n,
                       float* k_out, float* v_out) noexcept nogil:
    """Copy positions start..start+n into contiguous K and V outputs.

    Either output may be NULL to skip it."""
    cdef Py_ssize_t r = start, end = start + n, m
    while r < end:
        m = _run(c, r, end)
        if k_out != NULL:
            memcpy(k_out, _k_row(c, r), <size_t>m * <size_t>c.kw * sizeof(float))
            k_out += <size_t>m * <size_t>c.kw
        if v_out != NULL:
            memcpy(v_out, _v_row(c, r), <size_t>m * <size_t>c.vw * sizeof(float))
            v_out += <size_t>m * <size_t>c.vw
        r += m


# The same three copies, called with the GIL held: they release it only when
# the bytes pay for it (Cython's `with nogil(cond)` takes compile-time
# conditions only, so the branch lives here, once).

cdef inline bint _release_pays(Py_ssize_t nbytes) noexcept:
    return nbytes >= _gil_release_bytes


cdef void _write_rows(Cache* c, Py_ssize_t start, Py_ssize_t n,
                      const float* k, const float* v) noexcept:
    if _release_pays(n * (c.kw + c.vw) * <Py_ssize_t>sizeof(float)):
        with nogil:
            cache_write(c, start, n, k, v)
    else:
        cache_write(c, start, n, k, v)


cdef void _zero_rows(Cache* c, Py_ssize_t start, Py_ssize_t n) noexcept:
    if _release_pays(n * (c.kw + c.vw) * <Py_ssize_t>sizeof(float)):
        with nogil:
            cache_zero(c, start, n)
    else:
        cache_zero(c, start, n)


cdef void _gather_rows(Cache* c, Py_ssize_t n, float* k_out, float* v_out) noexcept:
    """The first n rows into contiguous outputs (either may be NULL)."""
    cdef Py_ssize_t width = (c.kw if k_out != NULL else 0) + (c.vw if v_out != NULL else 0)
    if _release_pays(n * width * <Py_ssize_t>sizeof(float)):
        with nogil:
            cache_gather(c, 0, n, k_out, v_out)
    else:
        cache_gather(c, 0, n, k_out, v_out)


cdef int cache_detach(Cache* c) noexcept nogil:
    """Give every block back and drop the pool reference (pooled caches)."""
    if c.pool == NULL:
        return 0
    pool_give(c.pool, c.table, c.n_blocks)
    pool_decref(c.pool)
    c.pool = NULL
    free(c.table)
    c.table = NULL
    c.n_blocks = 0
    c.table_cap = 0
    return 0


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


cdef int _check_pool_geometry(KvCache c, KvBlockPool pool) except -1:
    if (c.n_kv_heads, c.head_dim, c.v_head_dim) != (
            pool.n_kv_heads, pool.head_dim, pool.v_head_dim):
        raise ValueError(
            f"cache geometry (n_kv_heads={c.n_kv_heads}, head_dim={c.head_dim}, "
            f"v_head_dim={c.v_head_dim}) does not match the pool's "
            f"(n_kv_heads={pool.n_kv_heads}, head_dim={pool.head_dim}, "
            f"v_head_dim={pool.v_head_dim})")
    return 0


cdef str _BUSY = ("KvCache is in use by another thread; a cache must not be "
                  "used from two threads at once (guard it with a lock)")


cdef object _as_f32(object x, str name):
    """Convert an array-like to a C-contiguous float32 ndarray, or TypeError."""
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold numbers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


cdef inline cnp.ndarray _f32(object x, str name):
    """``x`` itself when it is a C-contiguous native float32 ndarray (the fast
    path: no conversion, no temporary), else a converted copy."""
    if (cnp.PyArray_Check(x)
            and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT32
            and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>x)
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>x)):
        return <cnp.ndarray>x
    return _as_f32(x, name)


# ---------------------------------------------------------------------------
# KvCache
# ---------------------------------------------------------------------------

@cython.no_gc_clear
cdef class KvCache:
    """K and V rows of one sequence in one layer.

    ``KvCache(n_kv_heads, head_dim, *, v_head_dim=None)`` starts empty and
    grows geometrically; ``KvCache.with_capacity`` pre-allocates a plan;
    ``KvCache.with_pool`` draws fixed-size blocks from a shared
    ``KvBlockPool``, reserving its worst case up front.

    A cache is not meant to be used from two threads at once: a method call
    that finds another call on the same cache in progress raises
    ``RuntimeError`` (never corrupts memory). Different caches may be used by
    different threads in parallel, on one pool.
    """
    cdef Cache c
    cdef _Rows rows              # contiguous storage (None when pooled / empty)
    cdef readonly Py_ssize_t n_kv_heads
    cdef readonly Py_ssize_t head_dim
    cdef readonly Py_ssize_t v_head_dim

    def __cinit__(self):
        memset(&self.c, 0, sizeof(Cache))
        self.c.plan = -1
        self.rows = None

    def __init__(self, n_kv_heads, head_dim, *, v_head_dim=None):
        if self.c.kw != 0:
            raise RuntimeError("KvCache.__init__ called on a cache that is already set up")
        self._set_geometry(n_kv_heads, head_dim, v_head_dim)

    def __dealloc__(self):
        # Only C state: give the blocks back (exactly once) and drop the pool.
        cache_detach(&self.c)
        free(self.c.table)
        self.c.table = NULL

    cdef int _set_geometry(self, n_kv_heads, head_dim, v_head_dim) except -1:
        cdef Py_ssize_t h = _count(n_kv_heads, "n_kv_heads", 1)
        cdef Py_ssize_t d = _count(head_dim, "head_dim", 1)
        cdef Py_ssize_t vd = d if v_head_dim is None else _count(v_head_dim, "v_head_dim", 1)
        _checked_bytes("n_kv_heads * head_dim", h, d, 1)
        _checked_bytes("n_kv_heads * v_head_dim", h, vd, 1)
        self.n_kv_heads = h
        self.head_dim = d
        self.v_head_dim = vd
        self.c.kw = h * d
        self.c.vw = h * vd
        return 0

    # -- constructors -------------------------------------------------------

    @staticmethod
    def with_capacity(n_kv_heads, head_dim, max_seq_len, *, v_head_dim=None):
        """A cache with ``max_seq_len`` rows pre-allocated: pushes within the
        plan never reallocate. Pushing past the plan still works (it grows)."""
        cdef KvCache self = KvCache.__new__(KvCache)
        self._set_geometry(n_kv_heads, head_dim, v_head_dim)
        cdef Py_ssize_t plan = _count(max_seq_len, "max_seq_len", 0)
        self._set_rows(_rows_new(plan, self.c.kw, self.c.vw))
        self.c.plan = plan
        return self

    @staticmethod
    def with_pool(n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                  *, v_head_dim=None):
        """A cache whose rows live in ``pool``'s blocks.

        Takes ``max(1, ceil(max_seq_len / block_size))`` blocks up front, all or
        nothing; raises ``KvPoolExhausted`` leaving the pool untouched when it
        cannot. Geometry must match the pool's (``ValueError`` otherwise).
        Pushing past the reservation takes one more block per ``block_size``
        positions (and can then raise ``KvPoolExhausted``).
        """
        cdef KvCache self = KvCache.__new__(KvCache)
        self._set_geometry(n_kv_heads, head_dim, v_head_dim)
        cdef Py_ssize_t max_len = _count(max_seq_len, "max_seq_len", 0)
        _check_pool_geometry(self, pool)
        cdef Pool* p = pool.p
        cdef Py_ssize_t n = _blocks_for(max_len, p.block_size)
        if n < 1:
            n = 1
        if n > p.total:            # before sizing a table for an impossible n
            raise KvPoolExhausted(n, pool_refuse(p))
        _reserve_table(&self.c, n)
        cdef Py_ssize_t free_seen = 0
        cdef int rc
        with nogil:
            rc = pool_take(p, n, self.c.table, &free_seen)
        if rc != 0:
            raise KvPoolExhausted(n, free_seen)
        pool_incref(p)
        self.c.pool = p
        self.c.n_blocks = n
        self.c.cap = n * p.block_size
        return self

    @staticmethod
    def with_pool_many(count, n_kv_heads, head_dim, KvBlockPool pool not None, max_seq_len,
                       *, v_head_dim=None):
        """``count`` pooled caches (e.g. every layer of a sequence, or every
        layer of every sequence of a batch), reserved at once.

        One acquisition of ``count * max(1, ceil(max_seq_len / block_size))``
        blocks: all the caches or none. When the pool cannot cover them all,
        ``KvPoolExhausted`` and the pool is untouched (one refusal counted).
        """
        cdef Py_ssize_t n_caches = _count(count, "count", 0)
        cdef KvCache proto = KvCache.with_capacity(n_kv_heads, head_dim, 0, v_head_dim=v_head_dim)
        cdef Py_ssize_t max_len = _count(max_seq_len, "max_seq_len", 0)
        _check_pool_geometry(proto, pool)
        cdef Pool* p = pool.p
        cdef Py_ssize_t per = _blocks_for(max_len, p.block_size), i, free_seen = 0
        if per < 1:
            per = 1
        if n_caches == 0:
            return []
        if per > p.total or n_caches > p.total // per:
            raise KvPoolExhausted(per * n_caches, pool_refuse(p))
        cdef Py_ssize_t total = per * n_caches
        cdef list out = []
        cdef KvCache c
        for i in range(n_caches):              # tables first: only MemoryError can fail
            c = KvCache.__new__(KvCache)
            c._copy_geometry(proto)
            _reserve_table(&c.c, per)
            out.append(c)
        cdef int32_t* ids = <int32_t*>malloc(total * sizeof(int32_t))
        if ids == NULL:
            raise MemoryError()
        cdef int rc
        with nogil:
            rc = pool_take(p, total, ids, &free_seen)
        if rc != 0:
            free(ids)
            raise KvPoolExhausted(total, free_seen)
        for i in range(n_caches):
            c = <KvCache>out[i]
            memcpy(c.c.table, ids + i * per, per * sizeof(int32_t))
            pool_incref(p)
            c.c.pool = p
            c.c.n_blocks = per
            c.c.cap = per * p.block_size
        free(ids)
        return out

    cdef void _copy_geometry(self, KvCache other) noexcept:
        self.n_kv_heads = other.n_kv_heads
        self.head_dim = other.head_dim
        self.v_head_dim = other.v_head_dim
        self.c.kw = other.c.kw
        self.c.vw = other.c.vw

    # -- read-only state ----------------------------------------------------

    @property
    def seq_len(self):
        """Positions stored."""
        return self.c.len

    def __len__(self):
        return self.c.len

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
        cdef Py_ssize_t n
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            n = self.c.n_blocks
            out = np.empty(n, dtype=np.int32)
            if n:
                memcpy(cnp.PyArray_DATA(out), self.c.table, n * sizeof(int32_t))
            return out
        finally:
            fx_unclaim(&self.c.busy)

    cdef object _rows_view(self, bint want_v):
        """(seq_len, n_kv_heads, dim) array of K or V: a read-only view of the
        contiguous buffer, or a gathered copy when pooled."""
        cdef cnp.npy_intp dims[3]
        cdef Py_ssize_t n = self.c.len
        cdef float* data
        cdef cnp.ndarray arr
        dims[0] = n
        dims[1] = self.n_kv_heads
        dims[2] = self.v_head_dim if want_v else self.head_dim
        if self.c.pool != NULL:
            arr = cnp.PyArray_EMPTY(3, dims, cnp.NPY_FLOAT32, 0)
            data = <float*>cnp.PyArray_DATA(arr)
            _gather_rows(&self.c, n, NULL if want_v else data, data if want_v else NULL)
            return arr
        if self.rows is None:
            arr = cnp.PyArray_EMPTY(3, dims, cnp.NPY_FLOAT32, 0)
            cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
            return arr
        arr = cnp.PyArray_SimpleNewFromData(3, dims, cnp.NPY_FLOAT32,
                                            self.rows.v if want_v else self.rows.k)
        cnp.set_array_base(arr, self.rows)     # the view keeps its buffer alive
        cnp.PyArray_CLEARFLAGS(arr, cnp.NPY_ARRAY_WRITEABLE)
        return arr

    def _views(self):
        """(k, v) for integrations that wrap them (e.g. as torch tensors):
        zero-copy *writable* views of a contiguous cache, gathered copies of a
        pooled one. Not public: writing through them bypasses the cache."""
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            k = self._rows_view(False)
            v = self._rows_view(True)
        finally:
            fx_unclaim(&self.c.busy)
        if self.c.pool == NULL:
            cnp.PyArray_ENABLEFLAGS(<cnp.ndarray>k, cnp.NPY_ARRAY_WRITEABLE)
            cnp.PyArray_ENABLEFLAGS(<cnp.ndarray>v, cnp.NPY_ARRAY_WRITEABLE)
        return k, v

    @property
    def k(self):
        """K rows, shape ``(seq_len, n_kv_heads, head_dim)``, float32.

        Contiguous caches: a read-only zero-copy view that keeps its buffer
        alive; if the cache later grows into a new buffer the view goes on
        showing the old one, and rows rewritten in place after a ``truncate``
        show through. Pooled caches: a fresh contiguous copy gathered from the
        blocks (GIL released for large gathers).
        """
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            return self._rows_view(False)
        finally:
            fx_unclaim(&self.c.busy)

    @property
    def v(self):
        """V rows, shape ``(seq_len, n_kv_heads, v_head_dim)``; as for ``k``."""
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            return self._rows_view(True)
        finally:
            fx_unclaim(&self.c.busy)

    # -- growth -------------------------------------------------------------

    cdef void _set_rows(self, _Rows r) noexcept:
        self.rows = r
        self.c.k = r.k
        self.c.v = r.v
        self.c.cap = r.cap

    cdef int _make_room(self, Py_ssize_t n) except -1:
        """Ensure ``n`` more rows fit; all or nothing. Called with the cache
        claimed. Pooled: takes the blocks needed (KvPoolExhausted if not).
        Contiguous: grows to max(2 * cap, needed, 4) rows."""
        cdef Py_ssize_t need = self.c.len + n, new_cap, nb, free_seen = 0
        cdef Pool* p = self.c.pool
        cdef _Rows r
        cdef int rc
        if need <= self.c.cap:
            return 0
        if p != NULL:
            nb = _blocks_for(need - self.c.cap, p.block_size)
            if nb > p.total:
                raise KvPoolExhausted(nb, pool_refuse(p))
            _reserve_table(&self.c, nb)
            if nb == 1:
                rc = pool_take(p, 1, self.c.table + self.c.n_blocks, &free_seen)
            else:
                with nogil:
                    rc = pool_take(p, nb, self.c.table + self.c.n_blocks, &free_seen)
            if rc != 0:
                raise KvPoolExhausted(nb, free_seen)
            self.c.n_blocks += nb
            self.c.cap += nb * p.block_size
            return 0
        new_cap = 2 * self.c.cap
        if new_cap < need:
            new_cap = need
        if new_cap < 4:
            new_cap = 4
        r = _rows_new(new_cap, self.c.kw, self.c.vw)
        if self.c.len:
            _gather_rows(&self.c, self.c.len, r.k, r.v)
        self._set_rows(r)
        return 0

    # -- appending ----------------------------------------------------------

    def push(self, k_step, v_step):
        """Append one position.

        ``k_step`` holds ``n_kv_heads * head_dim`` numbers, flat or shaped
        ``(n_kv_heads, head_dim)``; ``v_step`` likewise with ``v_head_dim``.
        C-contiguous native float32 ndarrays are copied straight in (no
        conversion, no temporary); other array-likes are converted first.
        Wrong size or shape: ``ValueError``; a full pooled cache takes one more
        block, or raises ``KvPoolExhausted``. Either way nothing is appended.
        """
        cdef cnp.ndarray ka = _f32(k_step, "k_step")
        cdef cnp.ndarray va = _f32(v_step, "v_step")
        self._check_step(ka, self.head_dim, "k_step")
        self._check_step(va, self.v_head_dim, "v_step")
        cdef const float* kp = <const float*>cnp.PyArray_DATA(ka)
        cdef const float* vp = <const float*>cnp.PyArray_DATA(va)
        cdef Cache* c = &self.c
        if not fx_try_claim(&c.busy):
            raise RuntimeError(_BUSY)
        try:
            if c.len == c.cap:
                self._make_room(1)
            if _release_pays((c.kw + c.vw) * <Py_ssize_t>sizeof(float)):
                _write_rows(c, c.len, 1, kp, vp)
            elif c.pool == NULL:          # the hot path: two memcpys, no loop
                memcpy(c.k + <size_t>c.len * <size_t>c.kw, kp, <size_t>c.kw * sizeof(float))
                memcpy(c.v + <size_t>c.len * <size_t>c.vw, vp, <size_t>c.vw * sizeof(float))
            else:
                memcpy(_k_row(c, c.len), kp, <size_t>c.kw * sizeof(float))
                memcpy(_v_row(c, c.len), vp, <size_t>c.vw * sizeof(float))
            c.len += 1
        finally:
            fx_unclaim(&c.busy)

    cdef int _check_step(self, cnp.ndarray a, Py_ssize_t dim, str name) except -1:
        cdef int nd = cnp.PyArray_NDIM(a)
        cdef cnp.npy_intp* shp = cnp.PyArray_DIMS(a)
        if nd == 1 and shp[0] == self.n_kv_heads * dim:
            return 0
        if nd == 2 and shp[0] == self.n_kv_heads and shp[1] == dim:
            return 0
        raise ValueError(
            f"{name} must have {self.n_kv_heads * dim} values, flat or shaped "
            f"({self.n_kv_heads}, {dim}); got shape {tuple((<object>a).shape)}")

    cdef Py_ssize_t _check_steps(self, cnp.ndarray a, Py_ssize_t dim, str name) except -1:
        cdef int nd = cnp.PyArray_NDIM(a)
        cdef cnp.npy_intp* shp = cnp.PyArray_DIMS(a)
        if nd == 2 and shp[1] == self.n_kv_heads * dim:
            return shp[0]
        if nd == 3 and shp[1] == self.n_kv_heads and shp[2] == dim:
            return shp[0]
        raise ValueError(
            f"{name} must be shaped (T, {self.n_kv_heads}, {dim}) or "
            f"(T, {self.n_kv_heads * dim}); got shape {tuple((<object>a).shape)}")

    def extend(self, k_steps, v_steps):
        """Append T positions at once (prefill, a batch of drafts).

        Shapes ``(T, n_kv_heads, head_dim)`` or ``(T, n_kv_heads * head_dim)``
        (and ``v_head_dim`` for V). All or nothing: every block needed is
        taken before anything is copied; the copy runs without the GIL when
        large. Mismatched T, wrong shape: ``ValueError``; too few free blocks:
        ``KvPoolExhausted``. Nothing is appended when it raises.
        """
        cdef cnp.ndarray ka = _f32(k_steps, "k_steps")
        cdef cnp.ndarray va = _f32(v_steps, "v_steps")
        cdef Py_ssize_t t = self._check_steps(ka, self.head_dim, "k_steps")
        cdef Py_ssize_t tv = self._check_steps(va, self.v_head_dim, "v_steps")
        if t != tv:
            raise ValueError(f"k_steps has {t} positions but v_steps has {tv}")
        cdef const float* kp = <const float*>cnp.PyArray_DATA(ka)
        cdef const float* vp = <const float*>cnp.PyArray_DATA(va)
        cdef Cache* c = &self.c
        if not fx_try_claim(&c.busy):
            raise RuntimeError(_BUSY)
        try:
            self._make_room(t)
            _write_rows(c, c.len, t, kp, vp)
            c.len += t
        finally:
            fx_unclaim(&c.busy)

    def advance_len(self, n):
        """Append ``n`` zero rows (K and V), all or nothing."""
        cdef Py_ssize_t count = _count(n, "n", 0)
        cdef Cache* c = &self.c
        if not fx_try_claim(&c.busy):
            raise RuntimeError(_BUSY)
        try:
            self._make_room(count)
            _zero_rows(c, c.len, count)
            c.len += count
        finally:
            fx_unclaim(&c.busy)

    # -- shrinking and detaching --------------------------------------------

    def truncate(self, new_seq_len):
        """Roll back to exactly ``new_seq_len`` positions (speculative decoding
        rejects drafts this way). Capacity and pool blocks are kept, so growing
        back costs no blocks. Beyond ``seq_len`` or negative: ``ValueError``."""
        cdef Py_ssize_t n
        try:
            n = _count(new_seq_len, "new_seq_len", 0)
        except ValueError:
            raise ValueError(f"truncate target {new_seq_len} must be >= 0") from None
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            if n > self.c.len:
                raise ValueError(
                    f"truncate target {n} must not exceed current seq_len {self.c.len}")
            self.c.len = n
        finally:
            fx_unclaim(&self.c.busy)

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
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            if self.c.pool == NULL:
                return
            r = _rows_new(self.c.cap, self.c.kw, self.c.vw)
            _gather_rows(&self.c, self.c.len, r.k, r.v)
            cache_detach(&self.c)
            self._set_rows(r)
        finally:
            fx_unclaim(&self.c.busy)

    def close(self):
        """Give every block back and free the rows: the cache is left empty,
        unpooled and without capacity. Idempotent. ``with`` calls it on exit.
        Views already taken of a contiguous cache stay valid."""
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            cache_detach(&self.c)
            self.rows = None
            self.c.k = NULL
            self.c.v = NULL
            self.c.cap = 0
            self.c.len = 0
        finally:
            fx_unclaim(&self.c.busy)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    # -- accounting -----------------------------------------------------------

    def allocated_bytes(self):
        """Bytes resident for K and V: capacity, not length. Pooled caches:
        ``blocks_held * pool.block_bytes``."""
        return self.c.cap * (self.c.kw + self.c.vw) * <Py_ssize_t>sizeof(float)

    def is_within_planned_capacity(self):
        """True only for a ``with_capacity`` cache (or its copy) whose
        ``seq_len`` is within its plan."""
        return self.c.plan >= 0 and self.c.len <= self.c.plan

    # -- copying --------------------------------------------------------------

    def copy(self):
        """An independent contiguous cache with the same rows and plan.

        Detached from any pool: it holds no blocks and gives none back. Its
        capacity equals its length (like a Rust ``Vec`` clone), so its next
        push grows it. The copy runs without the GIL when large."""
        cdef KvCache out = KvCache.__new__(KvCache)
        cdef _Rows r
        out._copy_geometry(self)
        if not fx_try_claim(&self.c.busy):
            raise RuntimeError(_BUSY)
        try:
            out.c.plan = self.c.plan
            if self.c.len:
                r = _rows_new(self.c.len, self.c.kw, self.c.vw)
                _gather_rows(&self.c, self.c.len, r.k, r.v)
                out._set_rows(r)
            out.c.len = self.c.len
        finally:
            fx_unclaim(&self.c.busy)
        return out

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __repr__(self):
        kind = "pooled" if self.c.pool != NULL else "contiguous"
        return (f"KvCache(n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, seq_len={self.c.len}, {kind}, "
                f"capacity={self.c.cap}, blocks_held={self.c.n_blocks})")


# ---------------------------------------------------------------------------
# One position into every layer of a sequence, in one call
# ---------------------------------------------------------------------------

def push_layers(caches, k_steps, v_steps):
    """Append one position to each of ``caches`` (one per layer) in one call.

    ``k_steps`` is shaped ``(layers, n_kv_heads, head_dim)`` or
    ``(layers, n_kv_heads * head_dim)``, row ``i`` going to ``caches[i]``;
    ``v_steps`` likewise with ``v_head_dim``. Every cache must have the same
    geometry. All or nothing: the blocks every pooled cache needs are taken
    before any row is copied; if the pool cannot supply them all,
    ``KvPoolExhausted`` and nothing changes. The copies of all layers run in
    one C loop, with the GIL released once when the bytes of all layers
    together pay for it: this is the decode step's coarse call, the one that
    lets request threads run in parallel.
    """
    cdef list cl = caches if type(caches) is list else list(caches)
    cdef Py_ssize_t n_layers = len(cl), i, j, need, free_seen = 0, total_bytes
    cdef Pool* refused
    cdef KvCache c0, ci
    cdef Cache* c
    cdef int rc
    if n_layers == 0:
        raise ValueError("caches is empty")
    if not isinstance(cl[0], KvCache):
        raise TypeError(f"caches[0] is {type(cl[0]).__name__}, not KvCache")
    c0 = <KvCache>cl[0]
    for i in range(1, n_layers):           # one pass: type and geometry
        if not isinstance(cl[i], KvCache):
            raise TypeError(f"caches[{i}] is {type(cl[i]).__name__}, not KvCache")
        ci = <KvCache>cl[i]
        if ci.c.kw != c0.c.kw or ci.c.vw != c0.c.vw or ci.head_dim != c0.head_dim:
            raise ValueError(f"caches[{i}] has another geometry than caches[0]")
    cdef cnp.ndarray ka = _f32(k_steps, "k_steps")
    cdef cnp.ndarray va = _f32(v_steps, "v_steps")
    if c0._check_steps(ka, c0.head_dim, "k_steps") != n_layers:
        raise ValueError(f"k_steps has {ka.shape[0]} rows for {n_layers} caches")
    if c0._check_steps(va, c0.v_head_dim, "v_steps") != n_layers:
        raise ValueError(f"v_steps has {va.shape[0]} rows for {n_layers} caches")
    cdef const float* kp = <const float*>cnp.PyArray_DATA(ka)
    cdef const float* vp = <const float*>cnp.PyArray_DATA(va)
    cdef Py_ssize_t kw = c0.c.kw, vw = c0.c.vw
    # one allocation: the cache pointers, then a "took a block" flag per layer
    cdef Cache** cs = <Cache**>calloc(n_layers, sizeof(Cache*) + 1)
    cdef char* took
    cdef Py_ssize_t claimed = 0
    if cs == NULL:
        raise MemoryError()
    took = <char*>(cs + n_layers)
    try:
        for i in range(n_layers):
            cs[i] = &(<KvCache>cl[i]).c
            if not fx_try_claim(&cs[i].busy):
                for j in range(i):          # claimed by this very call?
                    if cs[j] == cs[i]:
                        raise ValueError("a cache appears more than once in caches")
                raise RuntimeError(_BUSY)
            claimed += 1
        # 1. blocks for every full pooled cache (undone if any is refused)
        need = 0
        for i in range(n_layers):
            if cs[i].pool != NULL and cs[i].len == cs[i].cap:
                need += 1
        refused = NULL
        try:
            for i in range(n_layers):
                c = cs[i]
                if c.pool != NULL and c.len == c.cap:
                    _reserve_table(c, 1)
                    rc = pool_take(c.pool, 1, c.table + c.n_blocks, &free_seen)
                    if rc != 0:
                        refused = c.pool
                        raise KvPoolExhausted(need, free_seen)
                    c.n_blocks += 1
                    c.cap += c.pool.block_size
                    took[i] = 1
            # 2. growth of full contiguous caches (only MemoryError can stop it)
            for i in range(n_layers):
                if cs[i].pool == NULL and cs[i].len == cs[i].cap:
                    (<KvCache>cl[i])._make_room(1)
        except BaseException:
            for j in range(n_layers):
                if took[j]:
                    c = cs[j]
                    c.n_blocks -= 1
                    c.cap -= c.pool.block_size
                    pool_give(c.pool, c.table + c.n_blocks, 1)
            if refused != NULL:        # report the free count after the undo
                raise KvPoolExhausted(need, pool_free(refused)) from None
            raise
        # 3. the copies, in one loop
        total_bytes = n_layers * (kw + vw) * <Py_ssize_t>sizeof(float)
        if _release_pays(total_bytes):
            with nogil:
                for i in range(n_layers):
                    cache_write(cs[i], cs[i].len, 1, kp + i * kw, vp + i * vw)
                    cs[i].len += 1
        else:
            for i in range(n_layers):
                cache_write(cs[i], cs[i].len, 1, kp + i * kw, vp + i * vw)
                cs[i].len += 1
    finally:
        for i in range(claimed):
            fx_unclaim(&cs[i].busy)
        free(cs)


# ---------------------------------------------------------------------------
# Test-only and benchmark-only helpers (not part of the public API)
# ---------------------------------------------------------------------------

def _hold_pool_lock(KvBlockPool pool not None, double seconds):
    """Hold the pool's lock for ``seconds`` without the GIL (fork test)."""
    with nogil:
        pthread_mutex_lock(&pool.p.lock)
        usleep(<unsigned int>(seconds * 1e6))
        pthread_mutex_unlock(&pool.p.lock)


def _take_give_loop(KvBlockPool pool not None, Py_ssize_t iters, Py_ssize_t batch):
    """Take and give back ``batch`` blocks ``iters`` times, in C, without the
    GIL. Returns how many takes were refused (pool benchmark)."""
    cdef int32_t* ids = <int32_t*>malloc((batch if batch > 0 else 1) * sizeof(int32_t))
    cdef Py_ssize_t i, refused = 0, free_seen
    if ids == NULL:
        raise MemoryError()
    with nogil:
        for i in range(iters):
            if pool_take(pool.p, batch, ids, &free_seen, OWNER_RAW) != 0:
                refused += 1
            else:
                pool_give(pool.p, ids, batch, OWNER_RAW)
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
    if cnp.PyArray_NBYTES(dst) < <cnp.npy_intp>nbytes or row == 0:
        raise ValueError("dst smaller than src, or empty rows")
    with nogil:
        while off + row <= nbytes:
            memcpy(d + off, s + off, row)
            off += row
