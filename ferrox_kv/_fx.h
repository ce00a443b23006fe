/* Small C helpers of the ferrox_kv core: atomics, checked arithmetic, memory
 * advice and the prefix cache's hash; the storage dtypes (FX_F32 ...) and
 * the row conversions come from _conv.h. Declared for Cython in _core.pxd. */
#ifndef FERROX_KV_FX_H
#define FERROX_KV_FX_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_conv.h"

/* How this extension was built (setup.py defines FERROX_KV_BUILD). */
#ifndef FERROX_KV_BUILD
#define FERROX_KV_BUILD "unknown"
#endif
static const char *fx_build_flags = FERROX_KV_BUILD;
#if defined(__clang__)
static const char *fx_compiler = "clang " __clang_version__;
#elif defined(__GNUC__)
static const char *fx_compiler = "gcc " __VERSION__;
#else
static const char *fx_compiler = "unknown";
#endif

/* The registry of live pools (fork handling); pool locks are taken after it. */
static pthread_mutex_t fx_registry_lock = PTHREAD_MUTEX_INITIALIZER;

/* A cache is claimed by one call at a time: 1 if this call got it. */
static inline int fx_try_claim(int *flag) {
    int expected = 0;
    return __atomic_compare_exchange_n(flag, &expected, 1, 0,
                                       __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}
static inline void fx_unclaim(int *flag) { __atomic_store_n(flag, 0, __ATOMIC_RELEASE); }

static inline long fx_incref(long *p) { return __atomic_add_fetch(p, 1, __ATOMIC_RELAXED); }
static inline long fx_decref(long *p) { return __atomic_sub_fetch(p, 1, __ATOMIC_ACQ_REL); }

/* Per-block counters are written under the pool lock and read without it by
 * the cache that holds the block (to decide whether a write must copy it
 * first), so both sides use atomic accesses. */
static inline int32_t fx_load(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void fx_store(int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }

/* 1 when a * b overflows size_t. */
static inline int fx_mul(size_t a, size_t b, size_t *out) { return __builtin_mul_overflow(a, b, out); }

/* Buffers of K/V rows (pool arenas, contiguous rows).  From FX_BIG_MIN
 * bytes they are mapped directly, 2 MiB aligned and advised for transparent
 * huge pages: a decode reads each layer's rows from memory once a step, and
 * with 4 KiB pages every page costs it a page walk.  malloc cannot promise
 * huge pages: glibc serves requests below its mmap threshold (which rises
 * to 32 MiB once a large block is freed) from reused heap memory, already
 * faulted in 4 KiB pages.  Mapped pages are zero and stay lazily allocated,
 * so untouched rows cost nothing.  Buffers smaller than one huge page come
 * from calloc (zero) or malloc.  fx_big_free takes the nbytes the buffer was
 * allocated with. */
#define FX_BIG_MIN ((size_t)2 << 20)
#define FX_BIG_ALIGN ((size_t)2 << 20)

/* nbytes rounded up to whole pages (4 KiB, or 16 / 64 KiB on some arm64 kernels) */
static inline size_t fx_big_len(size_t nbytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (nbytes + page - 1) & ~(page - 1);
}

static inline void *fx_big_alloc(size_t nbytes, int zero) {
    size_t len, span;
    char *m, *p;
    if (nbytes < FX_BIG_MIN) return zero ? calloc(nbytes ? nbytes : 1, 1) : malloc(nbytes ? nbytes : 1);
    if (nbytes > SIZE_MAX - 2 * FX_BIG_ALIGN) return NULL;
    len = fx_big_len(nbytes);
    span = len + FX_BIG_ALIGN;
    m = (char *)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    p = (char *)(((uintptr_t)m + FX_BIG_ALIGN - 1) & ~(uintptr_t)(FX_BIG_ALIGN - 1));
    if (p > m) munmap(m, (size_t)(p - m));
    if (m + span > p + len) munmap(p + len, (size_t)(m + span - (p + len)));
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE);
#endif
    return p;
}

static inline void fx_big_free(void *p, size_t nbytes) {
    if (p == NULL) return;
    if (nbytes < FX_BIG_MIN) free(p);
    else munmap(p, fx_big_len(nbytes));
}

/* 1 when [a, a + an) and [b, b + bn) share a byte. */
static inline int fx_overlap(const void *a, size_t an, const void *b, size_t bn) {
    const char *x = (const char *)a, *y = (const char *)b;
    return an && bn && x < y + bn && y < x + an;
}

/* The prefix cache's key of one block: a chained hash over the parent's key,
 * the block's token ids, the layer count and the salt id. A key only finds
 * candidates; a hit is always verified against the stored tokens.
 * fx_constant_hash (a test hook) makes every key equal, to force collisions. */
static int fx_constant_hash = 0;

static inline uint64_t fx_mix64(uint64_t x) {          /* splitmix64 finaliser */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline uint64_t fx_block_key(uint64_t parent, const int32_t *tokens, ptrdiff_t n,
                                    uint64_t layers, uint64_t salt) {
    uint64_t h = fx_mix64(parent ^ 0x9e3779b97f4a7c15ULL);
    ptrdiff_t i;
    if (fx_constant_hash) return 42;
    h = fx_mix64(h ^ (layers * 0xff51afd7ed558ccdULL));
    h = fx_mix64(h ^ (salt * 0xc4ceb9fe1a85ec53ULL));
    for (i = 0; i < n; i++)
        h = fx_mix64(h + (uint64_t)(uint32_t)tokens[i] + 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1));
    return h;
}

/* Copy n whole blocks of `block` bytes between an arena and a packed buffer:
 * block ids[i * stride] of the arena and bytes [i * block, (i + 1) * block) of
 * `buf`, into the arena when `into_arena`, out of it otherwise. The caller
 * holds every block (none is freed or rewritten meanwhile); no GIL needed. */
static inline void fx_copy_blocks(char *arena, size_t block, const int32_t *ids, ptrdiff_t n,
                                  ptrdiff_t stride, char *buf, int into_arena) {
    ptrdiff_t i;
    for (i = 0; i < n; i++) {
        char *a = arena + (size_t)ids[i * stride] * block;
        if (into_arena) memcpy(a, buf + (size_t)i * block, block);
        else memcpy(buf + (size_t)i * block, a, block);
    }
}

#endif
