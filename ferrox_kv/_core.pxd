# The index of ferrox_kv's C layer: every struct and every nogil function of
# the core, grouped by the file that defines it (_core.pyx includes those
# .pxi files), each tagged with its lock rule:
#
#   [takes lock]  takes and releases the pool lock(s) itself; call it with no
#                 pool lock held (a pthread mutex is not recursive);
#   [lock held]   the caller holds the pool's lock;
#   [no lock]     touches no shared pool state, or only the caller's own
#                 (a cache it has claimed, fresh memory).
#
# Nothing under a pool lock makes a Python object, raises or can run the
# garbage collector: these functions return codes, raised after unlocking.
# C helpers live in _fx.h (inline), the row conversions in _conv.h / _conv.c,
# the attention kernel in _attn.h / _attn.c (built once per x86-64 level:
# _attn_base.c, _attn_v3.c, _attn_v4.c), the worker threads in _workers.h /
# _workers.c. setup.py compiles those C files next to _core.c.

cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, uint16_t, uint64_t

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef void (*fx_fork_fn)() noexcept nogil
    int pthread_mutex_init(pthread_mutex_t*, void*)
    int pthread_mutex_destroy(pthread_mutex_t*)
    int pthread_mutex_lock(pthread_mutex_t*)
    int pthread_mutex_unlock(pthread_mutex_t*)
    int pthread_atfork(fx_fork_fn prepare, fx_fork_fn parent, fx_fork_fn child)


cdef extern from "_fx.h" nogil:
    const char* fx_build_flags
    const char* fx_compiler
    pthread_mutex_t fx_registry_lock
    int fx_constant_hash
    bint fx_try_claim(int* flag)
    void fx_unclaim(int* flag)
    long fx_incref(long* p)
    long fx_decref(long* p)
    int32_t fx_load(const int32_t* p)
    void fx_store(int32_t* p, int32_t v)
    bint fx_mul(size_t a, size_t b, size_t* out)
    void* fx_big_alloc(size_t nbytes, bint zero)
    void fx_big_free(void* p, size_t nbytes)
    bint fx_overlap(const void* a, size_t an, const void* b, size_t bn)
    uint64_t fx_block_key(uint64_t parent, const int32_t* tokens, Py_ssize_t n,
                          uint64_t layers, uint64_t salt)
    void fx_copy_blocks(char* arena, size_t block, const int32_t* ids, Py_ssize_t n,
                        Py_ssize_t stride, char* buf, bint into_arena)
    float fx_read_rows(const float* p, Py_ssize_t n, Py_ssize_t width, Py_ssize_t stride)
    # storage dtypes (_conv.h) and the row loops (_conv.c)
    enum:
        FX_F32
        FX_F16
        FX_BF16
        FX_I8
        FX_I4                 # int4, values as given
        FX_I4H                # int4 of Hadamard-rotated values (rotate=True)
    size_t fx_row_bytes(int n_heads, int head_dim, int dtype)
    void fx_rows_from_f32(void* dst, size_t dst_row, const float* src, size_t src_row_floats,
                          Py_ssize_t n_rows, int n_heads, int head_dim, int dtype)
    void fx_rows_to_f32(float* dst, size_t dst_row_floats, const void* src, size_t src_row,
                        Py_ssize_t n_rows, int n_heads, int head_dim, int dtype)
    void fx_rows_from_half(void* dst, size_t dst_row, const uint16_t* src, size_t src_row_elems,
                           Py_ssize_t n_rows, int n_heads, int head_dim, int src_dtype, int dtype)


# Attention read in place (_attn.h; _attn.c and one file per x86-64 level).
cdef extern from "_attn.h" nogil:
    ctypedef struct fx_kv:
        const void* k
        const void* v
        const int32_t* table
        Py_ssize_t block_size
        size_t k_block            # bytes
        size_t v_block
        size_t k_row              # bytes
        size_t v_row
        Py_ssize_t len
        int dtype
    ctypedef struct fx_attn_args:
        int n_kv_heads
        int head_dim
        int v_head_dim
        int n_heads
        Py_ssize_t q_len
        float scale
        Py_ssize_t window
        Py_ssize_t start
    size_t fx_attend_scratch_floats(const fx_attn_args* a)
    void fx_attend(const fx_kv* kv, const fx_attn_args* a, const float* q, float* out,
                   float* scratch)
    const char* fx_attend_simd_path()
    const char* fx_attend_levels()
    const char* fx_attend_load_path(int dtype)
    int fx_attend_set_max_width(int w)
    int fx_attend_set_max_level(int level)
    int fx_attend_set_vnni(int on)
    size_t fx_attend_batch_work(const fx_kv* kvs, const Py_ssize_t* starts, Py_ssize_t n,
                                const fx_attn_args* a, int threads)
    int fx_attend_batch_in(const fx_kv* kvs, const Py_ssize_t* starts, Py_ssize_t n,
                           const fx_attn_args* a, const float* q, size_t q_stride, float* out,
                           size_t o_stride, int threads, void* work, size_t work_bytes)
    void fx_attend_set_split(Py_ssize_t split_bytes, Py_ssize_t chunk_rows)
    void fx_attend_get_split(Py_ssize_t* split_bytes, Py_ssize_t* chunk_rows)


# The worker threads that split attention (_workers.h / _workers.c).
cdef extern from "_workers.h" nogil:
    ctypedef void fx_unit_fn(void* ctx, Py_ssize_t unit, int slot) noexcept nogil
    int fx_workers_run(fx_unit_fn* fn, void* ctx, Py_ssize_t n_units, int max_slots)
    int fx_workers_set(int n)
    int fx_workers_get()
    int fx_workers_alive()
    int fx_workers_openmp_load(const char* path)
    int fx_workers_openmp(int on)
    int fx_workers_openmp_on()

# The thread running a worker unit (the tests' probe of who ran what).
cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()

# A source of rows for cache_write besides FX_F32 / FX_F16 / FX_BF16 values:
# rows already in the cache's own stored format (its row bytes apart).
cdef enum:
    SRC_STORED = -1


# Who holds a block: caches share and give back only blocks caches took, and
# KvBlockPool.free only what KvBlockPool.allocate handed out.
cdef enum:
    OWNER_FREE = 0
    OWNER_CACHE = 1
    OWNER_RAW = 2

# Result codes of the block-moving functions (0 is success).
cdef enum:
    FX_EXHAUSTED = -1         # fewer free blocks than needed; nothing changed
    FX_BAD_IDS = -2           # an id not held as the request says; nothing changed
    FX_NOT_FREE = -3          # would share or evict (only_free); nothing changed


# The prefix cache's index (see _prefix.pxi). Entry e (ids 1..cap; 0 is
# "none") stands for one block position of a published sequence, in every
# layer at once: its blocks are linked through Prefix.blk_next from e_first.
# Links hold id + 1 for block ids, so that 0 means "none" in calloc'd memory.
ctypedef struct Prefix:
    Py_ssize_t cap            # entries that can exist (= total blocks)
    Py_ssize_t n_cached       # published blocks no one holds
    int32_t* blk_entry        # per block: its entry, or 0
    int32_t* blk_next         # per block: the next layer's block + 1, or 0
    uint64_t* e_key
    int32_t* e_parent         # 0 for a sequence's first block
    int32_t* e_salt
    int32_t* e_layers
    int32_t* e_first          # first layer's block
    int32_t* e_held           # blocks of the entry with holders
    int32_t* e_hnext          # hash chain
    int32_t* e_lru_prev       # LRU list of entries with a block no one holds
    int32_t* e_lru_next
    int32_t* e_child          # first child entry
    int32_t* e_sib_prev       # siblings under one parent
    int32_t* e_sib_next
    int32_t* e_tokens         # cap * block_size token ids
    int32_t* buckets
    Py_ssize_t n_buckets      # a power of two
    int32_t* e_free           # stack of unused entry ids
    Py_ssize_t n_efree
    Py_ssize_t next_entry     # ids >= next_entry were never used (starts at 1)
    int32_t lru_head          # least recently used
    int32_t lru_tail
    uint64_t hits, misses, hit_tokens, evictions


ctypedef struct Pool:
    pthread_mutex_t lock      # held only while block ids move
    long refcnt               # the KvBlockPool object + every cache holding blocks
    Py_ssize_t block_size
    Py_ssize_t total
    Py_ssize_t kw             # K values per row (n_kv_heads * head_dim)
    Py_ssize_t vw             # V values per row
    int dtype                 # FX_*, K and V alike
    int nh                    # n_kv_heads
    int hd                    # head_dim
    int vhd                   # v_head_dim
    size_t k_row              # bytes of one stored K row (scales included)
    size_t v_row
    size_t k_block            # bytes of one block's K rows (block_size * k_row)
    size_t v_block
    char* k_arena
    char* v_arena
    int32_t* free_stack       # ids given back, top at n_stack - 1
    Py_ssize_t n_stack
    Py_ssize_t next_fresh     # ids >= next_fresh were never handed out
    int32_t* refs             # holders per block: table entries + a raw allocation
    unsigned char* owner      # OWNER_* per block
    int32_t* delta            # scratch under the lock: _req_check's counts and
    #                           _distinct_unpublished's marks; all zero between calls
    Py_ssize_t n_used         # blocks with holders
    Py_ssize_t high_water
    uint64_t acquired
    uint64_t released
    uint64_t refused
    uint64_t window_freed     # of released: blocks a sliding window's drops freed
    Prefix* prefix            # NULL unless prefix_cache=True
    void* caches              # Cache*: every cache holding its blocks (for check())
    Pool* reg_prev            # registry of live pools, in address order
    Pool* reg_next


# One pool's part of an all-or-nothing change of block holdings: the holder
# gains a reference to each of `share`, loses one on each of `drop`, and gets
# `n_fresh` blocks of its own written to `fresh`.
ctypedef struct BlockReq:
    Pool* pool
    const int32_t* share
    Py_ssize_t n_share
    const int32_t* drop
    Py_ssize_t n_drop
    int32_t* fresh
    Py_ssize_t n_fresh
    int owner
    bint window_drops         # the drops are blocks that left a sliding window
    Py_ssize_t needed         # out, when refused: blocks it needed beyond what it gives back
    Py_ssize_t free_seen      # out, when refused: the pool's free blocks


# The entries of one import (_prefix_io.pxi): the caller fills the inputs,
# pool_import_reserve the outputs; pool_import_publish or pool_import_abort
# ends it.
ctypedef struct Import:
    int32_t layers
    Py_ssize_t n              # entries, parents first
    const uint64_t* keys      # chained keys
    const int32_t* tokens     # n * block_size token ids
    const int32_t* salt       # salt ids
    const int32_t* parent     # parent's index (< i), or -1
    int32_t* ent              # per entry: the published entry it matched, or 0 (new)
    int32_t* slot             # per entry: -1 (present), or s: its layer j block is
    #                           fresh[j * n_new + s]
    int32_t* share            # room for n * layers ids: the present entries' blocks
    int32_t* fresh            # room for n * layers ids: the new entries' blocks
    Py_ssize_t taken          # out: the leading entries reserved
    Py_ssize_t n_new          # out: of those, the new ones
    Py_ssize_t high_water     # out: the pool's high-water mark before the reservation
    BlockReq req              # out, when refused: by how much


# KvCache.c.state
cdef enum:
    STATE_NEW = 0             # __init__ never ran
    STATE_OPEN = 1
    STATE_CLOSED = 2


ctypedef struct Cache:
    Py_ssize_t kw             # K values per row
    Py_ssize_t vw             # V values per row
    int dtype                 # FX_*, K and V alike
    int nh                    # n_kv_heads
    int hd                    # head_dim
    int vhd                   # v_head_dim
    size_t k_row              # bytes of one stored K row (scales included)
    size_t v_row
    Py_ssize_t len            # positions stored
    Py_ssize_t cap            # rows that fit without growing / new blocks
    char* k                   # contiguous storage (NULL when pooled)
    char* v
    Pool* pool                # NULL unless pooled (then one reference held)
    int32_t* table            # block ids, in position order (pooled only)
    Py_ssize_t n_blocks
    Py_ssize_t table_cap
    Py_ssize_t shared_upto    # table[i] for i >= shared_upto is this cache's alone
    Py_ssize_t plan           # with_capacity plan, -1 when none
    Py_ssize_t base           # position of the first row held (0 unless windowed;
    #                           pooled: a multiple of block_size, table[0] holds it)
    Py_ssize_t window         # 0, or the sliding window (_window.pxi)
    Py_ssize_t resv           # windowed pooled: blocks held ahead (the reservation)
    int busy                  # claimed by a method call
    int state                 # STATE_*
    void* pool_prev           # Cache*: the pool's list of its caches
    void* pool_next


# -- _args.pxi: argument conversion --------------------------------------------------

cdef size_t _row_bytes(Py_ssize_t h, Py_ssize_t d, int dtype) noexcept nogil      # [no lock]


# -- _pool.pxi: the pool, and the check/apply pair that moves block ids ---------------

cdef Pool* pool_new(Py_ssize_t block_size, Py_ssize_t total, int nh, int hd, int vhd,
                    int dtype, bint prefix_cache) noexcept nogil    # [takes lock] registry
cdef void _pool_free_memory(Pool* p) noexcept nogil                 # [no lock]
cdef void pool_incref(Pool* p) noexcept nogil                       # [no lock] atomic
cdef void pool_decref(Pool* p) noexcept nogil                       # [takes lock] registry
# reference counts and the free list
cdef bint _published(Pool* p, int32_t b) noexcept nogil             # [lock held]
cdef void _hold(Pool* p, int32_t b) noexcept nogil                  # [lock held]
cdef void _push_free(Pool* p, int32_t b) noexcept nogil             # [lock held]
cdef void _unhold(Pool* p, int32_t b) noexcept nogil                # [lock held]
cdef int32_t _take(Pool* p, int owner) noexcept nogil               # [lock held]
cdef void _untake(Pool* p, int32_t b) noexcept nogil                # [lock held]
# the one check/apply pair, and the calls built on it
cdef int _req_check(BlockReq* r) noexcept nogil                     # [lock held]
cdef void _req_apply(BlockReq* r) noexcept nogil                    # [lock held]
cdef int pools_update(BlockReq* reqs, Py_ssize_t n,
                      Py_ssize_t* failed) noexcept nogil            # [takes lock] each pool's
cdef int pool_drop(Pool* p, const int32_t* ids, Py_ssize_t n) noexcept nogil     # [takes lock]
cdef int pool_take(Pool* p, Py_ssize_t n, int32_t* out, int owner,
                   BlockReq* r) noexcept nogil                      # [takes lock]
cdef Py_ssize_t pool_free_count(Pool* p) noexcept nogil             # [takes lock]
cdef Py_ssize_t pool_refuse(Pool* p) noexcept nogil                 # [takes lock]
# the pool's list of caches
cdef void pool_link(Pool* p, Cache** cs, Py_ssize_t n) noexcept nogil            # [takes lock]
cdef void _pool_unlink(Pool* p, Cache* c) noexcept nogil            # [takes lock]
# fork (pthread_atfork): every pool lock, in address order
cdef void _fork_prepare() noexcept nogil                            # [takes lock] all, kept
cdef void _fork_release() noexcept nogil                            # [lock held] all, released


# -- _check.pxi: the invariant checker (KvBlockPool.check) ---------------------------

cdef int pool_check(Pool* p, Py_ssize_t* where) noexcept nogil     # [takes lock]
cdef int _check_locked(Pool* p, int32_t* mark,
                       Py_ssize_t* where) noexcept nogil            # [lock held]


# -- _prefix.pxi: the prefix cache's index --------------------------------------------

cdef Prefix* prefix_new(Py_ssize_t total, Py_ssize_t block_size) noexcept nogil  # [no lock]
cdef void prefix_free(Prefix* x) noexcept nogil                     # [no lock]
cdef void _lru_remove(Prefix* x, int32_t e) noexcept nogil          # [lock held]
cdef void _lru_append(Prefix* x, int32_t e) noexcept nogil          # [lock held]
cdef bint _in_lru(Prefix* x, int32_t e) noexcept nogil              # [lock held]
cdef void prefix_held(Pool* p, int32_t b) noexcept nogil            # [lock held]
cdef void prefix_unheld(Pool* p, int32_t b) noexcept nogil          # [lock held]
cdef Py_ssize_t _bucket(Prefix* x, uint64_t key) noexcept nogil     # [lock held]
cdef int32_t _find(Pool* p, uint64_t key, int32_t parent, int32_t salt, int32_t layers,
                   const int32_t* tokens) noexcept nogil            # [lock held]
cdef void _unlink(Pool* p, int32_t e) noexcept nogil                # [lock held]
cdef void prefix_evict(Pool* p) noexcept nogil                      # [lock held]
cdef Py_ssize_t prefix_match(Pool* p, const uint64_t* keys, const int32_t* tokens,
                             Py_ssize_t n, int32_t layers, int32_t salt,
                             int32_t* out) noexcept nogil           # [lock held]
cdef void prefix_blocks(Pool* p, const int32_t* entries, Py_ssize_t n, int32_t layers,
                        int32_t* out) noexcept nogil                # [lock held]
cdef bint _distinct_unpublished(Pool* p, int32_t** tables, int32_t layers,
                                Py_ssize_t i) noexcept nogil        # [lock held]
cdef int32_t _entry_add(Pool* p, uint64_t key, int32_t parent, int32_t salt, int32_t layers,
                        const int32_t* tok, int32_t** tables,
                        Py_ssize_t i) noexcept nogil                # [lock held]
cdef Py_ssize_t prefix_publish(Pool* p, int32_t** tables, int32_t layers,
                               const uint64_t* keys, const int32_t* tokens, Py_ssize_t n,
                               int32_t salt) noexcept nogil         # [lock held]
cdef void prefix_keys(const int32_t* tokens, Py_ssize_t n_blocks, Py_ssize_t bs,
                      int32_t layers, int32_t salt, uint64_t* keys) noexcept nogil  # [no lock]
cdef int pool_reserve(Pool* p, const uint64_t* keys, const int32_t* tokens, Py_ssize_t m_max,
                      int32_t layers, int32_t salt, Py_ssize_t per, int32_t* out,
                      Py_ssize_t stride, int32_t* scratch, Py_ssize_t* matched,
                      BlockReq* r) noexcept nogil                   # [takes lock]
cdef Py_ssize_t pool_publish(Pool* p, int32_t** tables, int32_t layers, const uint64_t* keys,
                             const int32_t* tokens, Py_ssize_t n,
                             int32_t salt) noexcept nogil           # [takes lock]


# -- _prefix_io.pxi: entries out of and into a pool (what ferrox_kv.store uses) ---------

cdef Py_ssize_t pool_export(Pool* p, int32_t* layers, int32_t* order, int32_t* salt,
                            int32_t* parent, int32_t* depth, int32_t* tokens,
                            int32_t* ids) noexcept nogil            # [takes lock]
cdef int pool_import_reserve(Pool* p, Import* t, bint fit,
                             bint only_free) noexcept nogil         # [takes lock]
cdef void pool_import_abort(Pool* p, Import* t) noexcept nogil      # [takes lock]
cdef Py_ssize_t pool_import_publish(Pool* p, Import* t,
                                    int32_t** tables) noexcept nogil    # [takes lock]


# -- _cache.pxi: rows of one cache (the caller has claimed it) -------------------------

cdef char* _k_row(Cache* c, Py_ssize_t r) noexcept nogil            # [no lock]
cdef char* _v_row(Cache* c, Py_ssize_t r) noexcept nogil            # [no lock]
cdef Py_ssize_t _run(Cache* c, Py_ssize_t r, Py_ssize_t end) noexcept nogil     # [no lock]
cdef bint _private_at(Cache* c, Py_ssize_t r) noexcept nogil        # [no lock]
cdef bint _aliases(Cache* c, const void* src, size_t nbytes) noexcept nogil     # [no lock]
cdef void _write_run(Cache* c, char* dst, size_t dst_row, const void* src, int nh,
                     int d, Py_ssize_t m, int kind) noexcept nogil  # [no lock]
cdef size_t _src_row(Cache* c, Py_ssize_t w, size_t stored, int kind) noexcept nogil  # [no lock]
cdef void cache_write(Cache* c, Py_ssize_t start, Py_ssize_t n,
                      const void* k, const void* v, int src) noexcept nogil  # [no lock]
cdef void cache_gather(Cache* c, Py_ssize_t start, Py_ssize_t n,
                       void* k_out, void* v_out, bint to_f32) noexcept nogil  # [no lock]
cdef void cache_detach(Cache* c) noexcept nogil                     # [takes lock]
cdef Py_ssize_t _blocks_for(Py_ssize_t rows, Py_ssize_t bs) noexcept nogil      # [no lock]


# -- _window.pxi: sliding-window caches (the caller has claimed the cache) -------------

cdef Py_ssize_t _window_blocks(Py_ssize_t window, Py_ssize_t max_chunk,
                               Py_ssize_t bs) noexcept nogil        # [no lock]
cdef bint _trim_due(Cache* c) noexcept nogil                        # [no lock]
cdef Py_ssize_t _trim_to(Cache* c, Py_ssize_t n) noexcept nogil     # [no lock]


# -- _attend.pxi, _testing.pxi ---------------------------------------------------------

cdef void _kv_of(Cache* c, fx_kv* kv) noexcept nogil                # [no lock]
cdef float _read_cache(Cache* c) noexcept nogil                     # [no lock]
cdef void _floor_unit(void* ctx, Py_ssize_t u, int slot) noexcept nogil         # [no lock]


@cython.final
cdef class KvBlockPool:
    cdef Pool* p
    cdef readonly Py_ssize_t n_kv_heads
    cdef readonly Py_ssize_t head_dim
    cdef readonly Py_ssize_t v_head_dim
    cdef dict _salts          # salt -> id, for the prefix cache
    cdef object _store        # an attached prefix store (KvBlockPool.attach), or None
    cdef object _arena_view(self, char* base, Py_ssize_t dim, size_t row, bint scales)
    cdef int32_t _salt_id(self, salt) except -1


@cython.final
cdef class _Rows:
    cdef char* k
    cdef char* v
    cdef Py_ssize_t cap
    cdef size_t nbytes        # of k's buffer (fx_big_free)


cdef class KvCache:
    cdef Cache c
    cdef _Rows rows           # contiguous storage (None when pooled / empty)
    cdef readonly Py_ssize_t n_kv_heads
    cdef readonly Py_ssize_t head_dim
    cdef readonly Py_ssize_t v_head_dim
    cdef int _set_geometry(self, n_kv_heads, head_dim, v_head_dim, dtype, rotate=*) except -1
    cdef void _copy_geometry(self, KvCache other) noexcept
    cdef void _set_rows(self, _Rows r) noexcept
    cdef object _rows_view(self, bint want_v)
    cdef object _claimed_view(self, bint want_v)
