/* _attn.h -- causal scaled-dot-product attention (grouped-query heads) of
 * q_len float32 query positions against one sequence's K/V rows, read in
 * place from a contiguous or paged cache of any storage dtype (_conv.h:
 * float32, float16, bfloat16, int8 with float16 scales), accumulated in
 * float32, with torch SDPA's numerics; an int8 cache reads each query
 * vector quantised to int8 (one scale per vector) and dots it with K in
 * integers.  The kernel's rules and loop nest
 * are in _attn_kernel.h; it is built once per x86-64 level (_attn_base.c,
 * _attn_v3.c, _attn_v4.c) and fx_attend (_attn.c) calls the widest level
 * the CPU has.  No allocation, no libc calls besides memset/memcpy: safe to
 * call without the GIL, from any thread. */
#ifndef FX_ATTN_H
#define FX_ATTN_H

#include <stddef.h>
#include <stdint.h>
#include "_conv.h"

/* Where one sequence's K/V rows are, in bytes. Row r (0 <= r < len):
   contiguous (table == NULL): K row at k + r*k_row, V row at v + r*v_row
   paged: K row at k + (size_t)table[r / block_size] * k_block + (r % block_size) * k_row
          (V likewise with v_block, v_row)
   A K row is n_kv_heads * head_dim values of dtype (kv head g at value
   offset g*head_dim; FX_I8: then the float16 scales), fx_row_bytes(n_kv_heads,
   head_dim, dtype) bytes; a V row likewise with v_head_dim.  */
typedef struct {
    const void *k, *v;        /* first byte of the contiguous buffer / of the arena */
    const int32_t *table;     /* NULL: contiguous */
    ptrdiff_t block_size;     /* rows per block (paged only) */
    size_t k_block, v_block;  /* BYTES per block (paged only) */
    size_t k_row, v_row;      /* BYTES per row */
    ptrdiff_t len;            /* rows stored */
    int dtype;                /* FX_F32 ... FX_I8, the same for K and V */
} fx_kv;

typedef struct {
    int n_kv_heads, head_dim, v_head_dim;
    int n_heads;              /* multiple of n_kv_heads; query head j reads kv head j / (n_heads/n_kv_heads) */
    ptrdiff_t q_len;          /* 1 <= q_len <= len */
    float scale;
    ptrdiff_t window;         /* 0: none; else query at position p sees rows p-window+1 .. p */
    ptrdiff_t start;          /* first visible row (left padding); 0 normally */
    /* A part of the call (fx_attend_batch splits calls this way; all zero:
       the whole call).  kv heads [kv_lo, kv_hi) only (kv_hi 0: all); rows
       [row_lo, row_hi) only (row_hi 0: all); with ml, out gets each query
       vector's unnormalised sum of p.V and ml[2e], ml[2e+1] its running max
       and sum, e = t * n_heads + query head. */
    int kv_lo, kv_hi;
    ptrdiff_t row_lo, row_hi;
    float *ml;
} fx_attn_args;

/* Floats of scratch fx_attend needs for these arguments. */
FX_API size_t fx_attend_scratch_floats(const fx_attn_args *a);

/* q: (q_len, n_heads, head_dim); out: (q_len, n_heads, v_head_dim), both
   C-contiguous.  Query t sits at position p = len - q_len + t and sees rows
   max(start, window ? p-window+1 : 0) .. p; a query that sees no row gets
   zeros.  scratch: fx_attend_scratch_floats(a) floats, any contents. */
FX_API void fx_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);

/* fx_attend over n sequences (q and out: q_stride and o_stride floats per
   sequence; starts: each one's start, or NULL for 0), on at most `threads`
   threads, the caller included (_workers.h).  The split into units of
   (sequence, query block, kv heads, context chunk) depends only on
   `threads`, the shapes and fx_attend_set_split, never on how many pool
   threads are free, so a given count gives the same bits on every run.  A
   decode splits over sequences, then context chunks, then kv heads (a row
   holds every head, so a unit of all heads reads memory in order); a
   split over chunks equals the unsplit result within float32 rounding.  A
   prefill splits over sequences, kv heads, then query blocks.  Sequence
   and head splits give the unsplit bits; a query block changes the
   kernel's pass shape (its chunk alignment and packing), so it equals the
   unsplit result within float32 rounding.  Returns the threads the call was split over (1: the
   caller alone), or -1 when its scratch could not be allocated (nothing
   was written). */
FX_API int fx_attend_batch(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                           const float *q, size_t q_stride, float *out, size_t o_stride, int threads);

/* fx_attend_batch in two steps, for callers that must not allocate while
   they run it (a thread without the GIL may not call malloc while another
   forks: AddressSanitizer's allocator has no fork handler).
   fx_attend_batch_work: the bytes of work memory the call would use.
   fx_attend_batch_in: the call, with work_bytes of the caller's memory at
   work (any contents, aligned for float).  Where a knob moved in between
   (the worker count, fx_attend_set_split) and the call's split needs more,
   it runs on the caller alone; -1 only if work_bytes is short of that too
   (nothing written). */
FX_API size_t fx_attend_batch_work(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                                   int threads);
FX_API int fx_attend_batch_in(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                              const float *q, size_t q_stride, float *out, size_t o_stride, int threads, void *work,
                              size_t work_bytes);

/* The split's sizes: calls over fewer context bytes (K and V rows, all
   sequences) than split_bytes run on the caller alone; a decode's context
   chunks hold at least chunk_rows rows.  Tests set (0, 1) to split tiny
   calls. */
FX_API void fx_attend_set_split(ptrdiff_t split_bytes, ptrdiff_t chunk_rows);
FX_API void fx_attend_get_split(ptrdiff_t *split_bytes, ptrdiff_t *chunk_rows);

/* Floats per vector fx_attend uses for these head dims on this CPU: 16
   with AVX-512 when both head dims are multiples of 16, else 8. */
FX_API int fx_attend_width(const fx_attn_args *a);

/* Widest vectors fx_attend may use (8 or 16): tests and benchmarks lower it
   to run the x86-64-v3 path on an AVX-512 machine.  Returns the old width.
   Not for use while another thread attends. */
FX_API int fx_attend_set_max_width(int w);

/* Highest x86-64 level fx_attend may run (4, 3, or 0 for the baseline):
   tests and benchmarks lower it to run a lower level's instantiation on
   this CPU.  Returns the old level.  Same caveat as the width. */
FX_API int fx_attend_set_max_level(int level);

/* Whether int8 scores may use AVX-512 VNNI where the CPU has it (1, the
   default) or must take the AVX2 integer tile (0): tests and benchmarks
   compare the two.  Returns the old setting.  Same caveat as the width. */
FX_API int fx_attend_set_vnni(int on);

/* Which code path fx_attend runs on this CPU (for head dims that are
   multiples of 16; others run the 8-float path below it), and how it reads
   rows of dtype (NULL for an unknown dtype). */
FX_API const char *fx_attend_simd_path(void);
/* The levels this build carries an instantiation for. */
FX_API const char *fx_attend_levels(void);
FX_API const char *fx_attend_load_path(int dtype);

#endif /* FX_ATTN_H */
