/* _attn.h -- causal scaled-dot-product attention (grouped-query heads) of
 * q_len float32 query positions against one sequence's K/V rows, read in
 * place from a contiguous or paged cache of any storage dtype (_conv.h:
 * float32, float16, bfloat16, int8 with float16 scales), accumulated in
 * float32.  Header-only, every symbol static: #include it into the
 * translation unit that calls it.
 *
 * Rules the code follows
 *   - One pass over the visible rows with an online softmax (running max m,
 *     running sum l; accumulators rescaled once per chunk, only when m
 *     grows).  Scores are kept in base 2: with c = scale*log2(e), q is
 *     pre-multiplied by c when |c| <= 1 (f = 1), else by sign(c) (f = |c|;
 *     2 and |c|/2 beyond FLT_MAX), and p = 2^((s - m) * f).  s - m <= 0 and
 *     f > 0, so the exponent argument is never positive: any finite scale x
 *     score gives the exact softmax (scale=1e38 over equal scores is their
 *     mean), with no overflow.
 *   - Numerics follow torch's SDPA: a NaN in q, in a visible K row or in a
 *     visible V row makes the outputs of the query vectors that read it NaN;
 *     a +inf score is NaN (inf - inf), a -inf score has weight 0, and a
 *     query whose visible scores are all -inf is NaN.  A query that sees no
 *     row (window, start) gets zeros.  NaN costs nothing in the hot loop:
 *     exp2 passes NaN through, and the max ignores it.
 *   - The dtype changes only the row load (FXA_LD): float32 as is, float16
 *     by F16C's vcvtph2ps (x86-64-v3) or an exact integer conversion,
 *     bfloat16 by a zero-extend and a 16-bit shift, int8 by a widen times
 *     its group's scale (the chunk's scales are converted to float once per
 *     chunk).  The loop nest is one always_inline body, instantiated per
 *     dtype with the dtype a constant.
 *   - Rows are walked in chunks of FX_ATTN_CHUNK described by per-row
 *     pointers, so contiguous and paged caches share one path and a chunk
 *     may straddle blocks.  Query vectors sharing a kv head are processed
 *     in tiles of 4 (GQA heads of one position, or several positions):
 *     each K/V vector loaded feeds 4 queries.  Where many query vectors
 *     share a kv head (prefill) its K slice is packed transposed, so the
 *     scores of a tile come out as vectors over rows, with no horizontal
 *     sum.  See fx_attend for the loop nest.
 *   - Nothing of context size is allocated: the caller's scratch
 *     (fx_attend_scratch_floats) holds scaled queries, accumulators, m, l
 *     and one chunk of scores.  No allocation, no libc calls besides
 *     memset/memcpy: safe to call without the GIL.
 *   - SIMD through vector helpers (GCC/clang vector extensions: SSE2 on the
 *     x86-64 baseline, AVX2+FMA in the x86-64-v3 clone, NEON on aarch64; a
 *     plain C fallback for other compilers), 8 floats wide; the q.k and p.V
 *     tiles (_attn_tile.h) also come 16 wide for AVX-512.  On x86-64 glibc
 *     with gcc >= 11, fx_attend() carries
 *     target_clones("arch=x86-64-v3", "default"); every helper is
 *     always_inline, so each clone gets its own copy of the whole loop nest.
 *     Two other outer functions are built for one target each and called
 *     by fx_attend when the CPU has it: fxa_attend_v4
 *     (target("arch=x86-64-v4"): every dtype on 16-float vectors, for head
 *     dims that are multiples of 16) and fxa_attend_f16c
 *     (target("arch=x86-64-v3")): the float16 instantiation with F16C
 *     (gcc 12 neither vectorises _Float16 conversions nor lets an F16C
 *     intrinsic inline into a clone that also builds for the baseline).
 *     Never put target attributes on the helpers (that stops them
 *     inlining), and never pass a vector to a function that is not inlined
 *     (the ABI differs between the clones).
 *   - The speed depends on floating-point contraction: GNU C's default
 *     -ffp-contract=fast turns a*b+c into FMA in the v3 clone (ISO modes,
 *     -std=c99/c11, turn it off).  Do not build with -ffast-math.
 */
#ifndef FX_ATTN_H
#define FX_ATTN_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "_conv.h"
#if defined(__GNUC__) && !defined(__clang__)
/* vectors never cross a real call (see below); the F16C builtin returns one */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#ifdef FX_ATTN_LIBM_EXP
#include <math.h>
#endif

/* ---- tuning knobs (compile-time; defaults measured, see REPORT.md) ---- */
#ifndef FX_ATTN_CHUNK      /* rows per chunk: multiple of 8 in [8, 256] */
#define FX_ATTN_CHUNK 48
#endif
#ifndef FX_ATTN_QBLOCK     /* query vectors (positions x query heads) per pass */
#define FX_ATTN_QBLOCK 256
#endif
#ifndef FX_ATTN_PACK_MIN   /* pack K/V slices when more query vectors share a kv head */
#define FX_ATTN_PACK_MIN 32
#endif
#ifndef FX_ATTN_RGA        /* unpacked: rows per group in the score phase */
#define FX_ATTN_RGA 24
#endif
#ifndef FX_ATTN_RGC        /* unpacked: rows per group in the p.V phase */
#define FX_ATTN_RGC 8
#endif
#if FX_ATTN_CHUNK % 8 != 0 || FX_ATTN_CHUNK < 8 || FX_ATTN_CHUNK > 256
#error "FX_ATTN_CHUNK must be a multiple of 8 in [8, 256]"
#endif
#if FX_ATTN_RGA < 1 || FX_ATTN_RGC < 1
#error "FX_ATTN_RGA and FX_ATTN_RGC must be positive"
#endif

/* ---- public types ----------------------------------------------------- */
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
} fx_attn_args;

/* ---- compiler plumbing ------------------------------------------------ */
#if defined(__GNUC__) || defined(__clang__)
#define FX_INLINE static inline __attribute__((always_inline))
#define FX_UNUSED __attribute__((unused))
#elif defined(_MSC_VER)
#define FX_INLINE static __forceinline
#define FX_UNUSED
#else
#define FX_INLINE static inline
#define FX_UNUSED
#endif

/* FX_CLONES, FX_ATTN_CLONES: _conv.h. */

#if defined(__GNUC__) || defined(__clang__)
#define FX_NEG_INF (-__builtin_inff())
#else
#include <math.h>
#define FX_NEG_INF (-INFINITY)
#endif

/* ---- 8-lane float vector helpers --------------------------------------
 * Only these helpers know the representation; the kernel uses nothing else.
 * GNU backend: vector extensions, written as macros (GNU statement
 * expressions) so that no function takes or returns a 32-byte vector: such
 * a function has a different ABI with and without AVX (gcc -Wpsabi), which
 * matters here because the two clones share the helpers. */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(FX_ATTN_NO_VECEXT)
#define FX_VECEXT 1
typedef float fxa_v8 __attribute__((vector_size(32)));
typedef float fxa_v4 __attribute__((vector_size(16)));
typedef int32_t fxa_v8i __attribute__((vector_size(32)));
typedef float fxa_v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t fxa_v4i __attribute__((vector_size(16)));
#if defined(__clang__) || __GNUC__ >= 12
#define FX_SHUF4(a, b, i, j, k, l) __builtin_shufflevector(a, b, i, j, k, l)
#define FX_SHUF8(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define FX_SHUF4(a, b, i, j, k, l) __builtin_shuffle(a, b, (fxa_v4i){i, j, k, l})
#define FX_SHUF8(a, b, ...) __builtin_shuffle(a, b, (fxa_v8i){__VA_ARGS__})
#endif

#define fxa_load(p) (*(const fxa_v8u *)(p))
#define fxa_store(p, v) ((void)(*(fxa_v8u *)(p) = (v)))
#define fxa_splat(x) __extension__({ const float x_ = (x); (fxa_v8){x_, x_, x_, x_, x_, x_, x_, x_}; })
#define fxa_add(a, b) ((a) + (b))
#define fxa_sub(a, b) ((a) - (b))
#define fxa_mul(a, b) ((a) * (b))
#define fxa_fma(a, b, c) ((a) * (b) + (c)) /* contracted to FMA where the target has it */
#define fxa_max(a, b) __extension__({                                   \
    const fxa_v8 a_ = (a), b_ = (b);                                     \
    const fxa_v8i lt_ = a_ < b_;                                         \
    (fxa_v8)(((fxa_v8i)a_ & ~lt_) | ((fxa_v8i)b_ & lt_)); })
/* lane j of v where lo <= base + j < hi, else -inf */
#define fxa_mask_range(v, base, lo, hi) __extension__({                                        \
    const fxa_v8 i_ = fxa_splat((float)(base)) + (fxa_v8){0, 1, 2, 3, 4, 5, 6, 7};               \
    const fxa_v8i k_ = (i_ >= fxa_splat((float)(lo))) & (i_ < fxa_splat((float)(hi)));          \
    (fxa_v8)(((fxa_v8i)(v) & k_) | ((fxa_v8i)fxa_splat(FX_NEG_INF) & ~k_)); })
/* v (of vector type T) folded to its half type H: low half + high half,
   the same lane sums */
#define FX_FOLD(T, H, v) __extension__({                                \
    const T v_ = (v);                                                    \
    H lo_, hi_;                                                          \
    memcpy(&lo_, &v_, sizeof lo_);                                      \
    memcpy(&hi_, (const char *)&v_ + sizeof lo_, sizeof hi_);           \
    lo_ + hi_; })
#define fxa_fold(v) FX_FOLD(fxa_v8, fxa_v4, v)
#define fxa_hsum(v) __extension__({                                     \
    fxa_v4 s_ = fxa_fold(v);                                              \
    s_ += FX_SHUF4(s_, s_, 2, 3, 0, 1);                                 \
    s_ += FX_SHUF4(s_, s_, 1, 0, 3, 2);                                 \
    s_[0]; })
#define fxa_max4(a, b) __extension__({                                 \
    const fxa_v4 a4_ = (a), b4_ = (b);                                   \
    const fxa_v4i lt4_ = a4_ < b4_;                                      \
    (fxa_v4)(((fxa_v4i)a4_ & ~lt4_) | ((fxa_v4i)b4_ & lt4_)); })
#define fxa_hmax(v) __extension__({                                     \
    const fxa_v8 h_ = (v);                                               \
    fxa_v4 lo_, hi_, x_;                                                 \
    memcpy(&lo_, &h_, sizeof lo_);                                      \
    memcpy(&hi_, (const char *)&h_ + sizeof lo_, sizeof hi_);           \
    x_ = fxa_max4(lo_, hi_);                                             \
    x_ = fxa_max4(x_, FX_SHUF4(x_, x_, 2, 3, 0, 1));                     \
    x_ = fxa_max4(x_, FX_SHUF4(x_, x_, 1, 0, 3, 2));                     \
    x_[0]; })
/* out[i] = sum of the lanes of a[i], i < 8: three rounds of pairwise adds
   within 128-bit halves (the hadd pattern), then the two halves: 21
   instructions with AVX. */
#define FX_HADD8(a, b) (FX_SHUF8(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + FX_SHUF8(a, b, 1, 3, 9, 11, 5, 7, 13, 15))
FX_INLINE void fxa_hsum8x8(const fxa_v8 *a, float *out)
{
    const fxa_v8 u = FX_HADD8(FX_HADD8(a[0], a[1]), FX_HADD8(a[2], a[3]));
    const fxa_v8 w = FX_HADD8(FX_HADD8(a[4], a[5]), FX_HADD8(a[6], a[7]));
    fxa_store(out, FX_SHUF8(u, w, 0, 1, 2, 3, 8, 9, 10, 11) + FX_SHUF8(u, w, 4, 5, 6, 7, 12, 13, 14, 15));
}
/* out[i] = sum of the lanes of a[i], i < 4 */
FX_INLINE void fxa_hsum4x8(const fxa_v8 *a, float *out)
{
    const fxa_v4 s = fxa_fold(FX_HADD8(FX_HADD8(a[0], a[1]), FX_HADD8(a[2], a[3])));
    memcpy(out, &s, sizeof s);
}
/* 2^y for y <= 0 (relative error < 1e-7).  y < -125 (and -inf) gives
   exactly 0, so no result is denormal; NaN gives NaN (a NaN score makes its
   query NaN, as in SDPA).  y = n + f, n = round(y); 2^f =
   e^(f ln2) by the Cephes expf polynomial on |f ln2| <= ln2/2; 2^n is built
   in the exponent field.  Same steps as the scalar fxa_exp2f below. */
#define fxa_exp2(y) __extension__({                                                    \
    const fxa_v8 y_ = (y);                                                              \
    const fxa_v8i keep_ = y_ >= -125.0f;                                                \
    const fxa_v8 yc_ = (fxa_v8)((fxa_v8i)y_ & keep_); /* dropped lanes: 0, harmless */         \
    const fxa_v8i n_ = __builtin_convertvector(yc_ - 0.5f, fxa_v8i); /* = round(yc_) */   \
    const fxa_v8 g_ = (yc_ - __builtin_convertvector(n_, fxa_v8)) * 0.693147180559945f;   \
    fxa_v8 p_ = g_ * 1.9875691500e-4f + 1.3981999507e-3f;                               \
    p_ = p_ * g_ + 8.3334519073e-3f;                                                   \
    p_ = p_ * g_ + 4.1665795894e-2f;                                                   \
    p_ = p_ * g_ + 1.6666665459e-1f;                                                   \
    p_ = p_ * g_ + 5.0000001201e-1f;                                                   \
    p_ = (g_ * g_) * p_ + g_ + 1.0f;                                                   \
    (fxa_v8)(((fxa_v8i)(p_ * (fxa_v8)((n_ + 127) << 23)) & keep_) | ((fxa_v8i)y_ & (y_ != y_))); })

/* Row loads: 8 values of a stored row as float32 (unaligned). */
#define fxa_load_f32(p) ((fxa_v8)fxa_load(p))
typedef uint16_t fxa_v8h __attribute__((vector_size(16), aligned(1), may_alias));
typedef int8_t fxa_v8b __attribute__((vector_size(8), aligned(1), may_alias));
#define fxa_load_bf16(p) ((fxa_v8)(__builtin_convertvector(*(const fxa_v8h *)(const void *)(p), fxa_v8i) << 16))
/* int8 widens through int16 and int32: gcc 12 turns a direct int8 -> float
   conversion of 8 lanes into 8 scalar conversions (vpmovsxbw/vpmovsxwd +
   vcvtdq2ps in v3, punpck + cvtdq2ps in the baseline this way). */
typedef int16_t fxa_v8w __attribute__((vector_size(16)));
#define fxa_load_i8(p, sc)                                                                                     \
    (__builtin_convertvector(__builtin_convertvector(__builtin_convertvector(*(const fxa_v8b *)(const void *)(p), \
                                                                             fxa_v8w), fxa_v8i), fxa_v8) *      \
     fxa_splat(sc))
/* float16, exact, as fx_f16_to_f32 */
#define fxa_load_f16(p) __extension__({                                                              \
    const fxa_v8i x_ = __builtin_convertvector(*(const fxa_v8h *)(const void *)(p), fxa_v8i);          \
    const fxa_v8i em_ = x_ & 0x7fff, v_ = em_ << 13, small_ = em_ < 0x400, big_ = em_ >= 0x7c00;     \
    const fxa_v8i sub_ = (fxa_v8i)(__builtin_convertvector(em_, fxa_v8) * 0x1p-24f);                 \
    const fxa_v8i m_ = (sub_ & small_) | ((v_ | 0x7f800000) & big_) | ((v_ + 0x38000000) & ~(small_ | big_)); \
    (fxa_v8)(m_ | ((x_ & 0x8000) << 16)); })
#if defined(__x86_64__) && (FX_ATTN_CLONES || (defined(__F16C__) && defined(__AVX__)))
/* F16C.  The builtin is checked at expansion, so it may sit in helpers the
   baseline also inlines, as long as only code built for x86-64-v3 (the
   FXA_F16C instantiation, see fx_attend) reaches it. */
#include <immintrin.h>
#define FXA_HAVE_F16C 1
typedef short fxa_v8s __attribute__((vector_size(16), aligned(1), may_alias));
#define fxa_load_f16c(p) ((fxa_v8)__builtin_ia32_vcvtph2ps256(*(const fxa_v8s *)(const void *)(p)))
#else
#define FXA_HAVE_F16C 0
#define fxa_load_f16c(p) fxa_load_f16(p)
#endif

/* 16-float vectors: AVX-512, built only into the x86-64-v4 instantiation
   (fxa_attend_v4) or a build for AVX-512.  Loads as above, 16 values; the
   float16 ones join two 8-value conversions.  fxa16_fold8: to 8 lanes,
   the same lane sums. */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 12) && (FX_ATTN_CLONES || defined(__AVX512F__))
#define FXA_HAVE_W16 1
typedef float fxa_v16 __attribute__((vector_size(64)));
typedef float fxa_v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t fxa_v16i __attribute__((vector_size(64)));
typedef int16_t fxa_v16w __attribute__((vector_size(32)));
typedef uint16_t fxa_v16h __attribute__((vector_size(32), aligned(1), may_alias));
typedef int8_t fxa_v16b __attribute__((vector_size(16), aligned(1), may_alias));
#define fxa16_load(p) ((fxa_v16)*(const fxa_v16u *)(const void *)(p))
#define fxa16_store(p, v) ((void)(*(fxa_v16u *)(void *)(p) = (v)))
#define fxa16_splat(x) __extension__({                                                           \
    const float x16_ = (x);                                                                       \
    (fxa_v16){x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_}; })
#define fxa16_fold8(v) FX_FOLD(fxa_v16, fxa_v8, v)
#define FX_JOIN16(lo, hi) __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define fxa16_load_f32(p) fxa16_load(p)
#define fxa16_load_bf16(p) ((fxa_v16)(__builtin_convertvector(*(const fxa_v16h *)(const void *)(p), fxa_v16i) << 16))
#define fxa16_load_i8(p, sc)                                                                                    \
    (__builtin_convertvector(__builtin_convertvector(__builtin_convertvector(*(const fxa_v16b *)(const void *)(p), \
                                                                             fxa_v16w), fxa_v16i), fxa_v16) *    \
     fxa16_splat(sc))
#define fxa16_load_f16(p) FX_JOIN16(fxa_load_f16(p), fxa_load_f16((p) + 16))
#define fxa16_load_f16c(p) FX_JOIN16(fxa_load_f16c(p), fxa_load_f16c((p) + 16))
#else
#define FXA_HAVE_W16 0
#endif

#else /* plain C fallback: same interface, element loops */
typedef struct { float x[8]; } fxa_v8;
FX_INLINE fxa_v8 fxa_load(const float *p) { fxa_v8 v; memcpy(v.x, p, sizeof v.x); return v; }
FX_INLINE void fxa_store(float *p, fxa_v8 v) { memcpy(p, v.x, sizeof v.x); }
FX_INLINE fxa_v8 fxa_splat(float x) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = x; return v; }
FX_INLINE fxa_v8 fxa_add(fxa_v8 a, fxa_v8 b) { int i; for (i = 0; i < 8; i++) a.x[i] += b.x[i]; return a; }
FX_INLINE fxa_v8 fxa_sub(fxa_v8 a, fxa_v8 b) { int i; for (i = 0; i < 8; i++) a.x[i] -= b.x[i]; return a; }
FX_INLINE fxa_v8 fxa_mul(fxa_v8 a, fxa_v8 b) { int i; for (i = 0; i < 8; i++) a.x[i] *= b.x[i]; return a; }
FX_INLINE fxa_v8 fxa_fma(fxa_v8 a, fxa_v8 b, fxa_v8 c) { int i; for (i = 0; i < 8; i++) c.x[i] += a.x[i] * b.x[i]; return c; }
FX_INLINE fxa_v8 fxa_max(fxa_v8 a, fxa_v8 b) { int i; for (i = 0; i < 8; i++) a.x[i] = a.x[i] < b.x[i] ? b.x[i] : a.x[i]; return a; }
FX_INLINE fxa_v8 fxa_mask_range(fxa_v8 v, int base, int lo, int hi) { int i; for (i = 0; i < 8; i++) if (base + i < lo || base + i >= hi) v.x[i] = FX_NEG_INF; return v; }
FX_INLINE float fxa_hsum(fxa_v8 v) { return ((v.x[0] + v.x[4]) + (v.x[2] + v.x[6])) + ((v.x[1] + v.x[5]) + (v.x[3] + v.x[7])); }
FX_INLINE float fxa_hmax(fxa_v8 v) { float m = v.x[0]; int i; for (i = 1; i < 8; i++) m = v.x[i] > m ? v.x[i] : m; return m; }
FX_INLINE void fxa_hsum8x8(const fxa_v8 *a, float *out) { int i; for (i = 0; i < 8; i++) out[i] = fxa_hsum(a[i]); }
FX_INLINE void fxa_hsum4x8(const fxa_v8 *a, float *out) { int i; for (i = 0; i < 4; i++) out[i] = fxa_hsum(a[i]); }
static float fxa_exp2f(float y);
FX_INLINE fxa_v8 fxa_exp2(fxa_v8 y) { int i; for (i = 0; i < 8; i++) y.x[i] = fxa_exp2f(y.x[i]); return y; }
#define fxa_load_f32(p) fxa_load(p)
FX_INLINE fxa_v8 fxa_load_bf16(const char *p) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = fx_bf16_to_f32(fx_ld16(p + 2 * i)); return v; }
FX_INLINE fxa_v8 fxa_load_f16(const char *p) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = fx_f16_to_f32(fx_ld16(p + 2 * i)); return v; }
FX_INLINE fxa_v8 fxa_load_i8(const char *p, float sc) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = (float)((const int8_t *)p)[i] * sc; return v; }
#define FXA_HAVE_F16C 0
#define fxa_load_f16c(p) fxa_load_f16(p)
#define FXA_HAVE_W16 0
#endif

/* The loads of the kernel: 8 values (FXA_LD), 16 (FXA_LD16) or one (fxa_ld1) at value
   offset e of a row; sc: the int8 group's scale.  dt is a constant in every
   instantiation, so each load compiles to its dtype's instructions alone.
   FXA_F16C: float16 read by F16C (only in code built for x86-64-v3). */
#define FXA_F16C FX_F16C /* _conv.h */
#define FXA_LD(dt, row, e, sc)                                                                   \
    ((dt) == FX_F32 ? fxa_load_f32((const float *)(const void *)(row) + (e))                         \
     : (dt) == FX_BF16 ? fxa_load_bf16((row) + 2 * (size_t)(e))                                  \
     : (dt) == FX_I8 ? fxa_load_i8((row) + (e), (sc))                                            \
     : (dt) == FXA_F16C ? fxa_load_f16c((row) + 2 * (size_t)(e)) : fxa_load_f16((row) + 2 * (size_t)(e)))
#define FXA_LD16(dt, row, e, sc)                                                                 \
    ((dt) == FX_F32 ? fxa16_load_f32((const float *)(const void *)(row) + (e))                       \
     : (dt) == FX_BF16 ? fxa16_load_bf16((row) + 2 * (size_t)(e))                                \
     : (dt) == FX_I8 ? fxa16_load_i8((row) + (e), (sc))                                          \
     : (dt) == FXA_F16C ? fxa16_load_f16c((row) + 2 * (size_t)(e)) : fxa16_load_f16((row) + 2 * (size_t)(e)))
FX_INLINE float fxa_ld1(const int dt, const char *row, size_t e, float sc)
{
    float x;
    switch (dt) {
    case FX_F32: memcpy(&x, row + 4 * e, 4); return x;
    case FX_BF16: return fx_bf16_to_f32(fx_ld16(row + 2 * e));
    case FX_I8: return (float)((const int8_t *)row)[e] * sc;
    default: return fx_f16_to_f32(fx_ld16(row + 2 * e));
    }
}

/* Scalar 2^y, same method and range rules as fxa_exp2. */
static inline FX_UNUSED float fxa_exp2f(float y)
{
    float g, p, s;
    int32_t n, e;
    if (y != y) return y;
    if (!(y >= -125.0f)) return 0.0f;
    n = (int32_t)(y - 0.5f);
    g = (y - (float)n) * 0.693147180559945f;
    p = g * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * g + 8.3334519073e-3f;
    p = p * g + 4.1665795894e-2f;
    p = p * g + 1.6666665459e-1f;
    p = p * g + 5.0000001201e-1f;
    p = (g * g) * p + g + 1.0f;
    e = (n + 127) << 23;
    memcpy(&s, &e, sizeof s);
    return p * s;
}

/* ---- kernel pieces ---------------------------------------------------- */
#define FX_C FX_ATTN_CHUNK
/* floats per d of a packed, transposed K slice: whole groups of 48 rows
   (the 3 vectors of a transposed score tile at either width) */
#define FX_KT ((FX_C + 47) / 48 * 48)
/* stride of a score row: a chunk plus the overhang of a last row group */
#define FX_CS (FX_C + 16 > FX_KT ? FX_C + 16 : FX_KT)
#define FX_LOG2E 1.4426950408889634f

/* Row pointers of one chunk (first byte of each K and V row); entries past
   the chunk's last row repeat it, so whole groups of (up to 12) rows can be
   read without leaving the cache.  FX_I8: ks/vs point at each row's scales
   converted to float (kv head g, group j at [g*groups + j]). */
#define FX_CP (FX_C + 12)
typedef struct {
    const char *k[FX_CP], *v[FX_CP];
    const float *ks[FX_CP], *vs[FX_CP];
} fxa_rows;

/* Floats of the per-chunk scale buffer (FX_I8). */
#define FXA_SCALE_FLOATS(a) \
    ((size_t)FX_C * (size_t)(a)->n_kv_heads * (fx_i8_groups((a)->head_dim) + fx_i8_groups((a)->v_head_dim)))

FX_INLINE void fxa_chunk_rows(const fx_kv *kv, const fx_attn_args *a, ptrdiff_t c0, int n, fxa_rows *c,
                              float *sbuf, const int dt)
{
    const char *kb = (const char *)kv->k, *vb = (const char *)kv->v;
    int i;
    for (i = 0; i < n; i++) c->ks[i] = c->vs[i] = NULL;
    if (!kv->table) {
        for (i = 0; i < n; i++) {
            c->k[i] = kb + (size_t)(c0 + i) * kv->k_row;
            c->v[i] = vb + (size_t)(c0 + i) * kv->v_row;
        }
    } else {
        ptrdiff_t b = c0 / kv->block_size, o = c0 % kv->block_size;
        for (i = 0; i < n; i++) {
            const size_t blk = (size_t)kv->table[b];
            c->k[i] = kb + blk * kv->k_block + (size_t)o * kv->k_row;
            c->v[i] = vb + blk * kv->v_block + (size_t)o * kv->v_row;
            if (++o == kv->block_size) { o = 0; b++; }
        }
    }
    if (dt == FX_I8) {
        const size_t nk = (size_t)a->n_kv_heads * fx_i8_groups(a->head_dim);
        const size_t nv = (size_t)a->n_kv_heads * fx_i8_groups(a->v_head_dim);
        const size_t kvals = (size_t)a->n_kv_heads * (size_t)a->head_dim;
        const size_t vvals = (size_t)a->n_kv_heads * (size_t)a->v_head_dim;
        size_t j;
        /* 8 scales per vector conversion (exact, as fx_f16_to_f32): a row
           holds n_kv_heads * groups of them, 64 at 8 x 128 */
        for (i = 0; i < n; i++) {
            float *ks = sbuf + (size_t)i * (nk + nv), *vs = ks + nk;
            for (j = 0; j + 8 <= nk; j += 8) fxa_store(ks + j, fxa_load_f16(c->k[i] + kvals + 2 * j));
            for (; j < nk; j++) ks[j] = fx_f16_to_f32(fx_ld16(c->k[i] + kvals + 2 * j));
            for (j = 0; j + 8 <= nv; j += 8) fxa_store(vs + j, fxa_load_f16(c->v[i] + vvals + 2 * j));
            for (; j < nv; j++) vs[j] = fx_f16_to_f32(fx_ld16(c->v[i] + vvals + 2 * j));
            c->ks[i] = ks;
            c->vs[i] = vs;
        }
    }
    for (i = n; i < FX_CP; i++) {
        c->k[i] = c->k[n - 1];
        c->v[i] = c->v[n - 1];
        c->ks[i] = c->ks[n - 1];
        c->vs[i] = c->vs[n - 1];
    }
}

/* The int8 scale of row r's group holding dim d of the head whose scales
   start at soff (0 for other dtypes). */
#define FXA_SC(dt, s, r, soff, d) ((dt) == FX_I8 ? (s)[r][(soff) + ((size_t)(d) >> 5)] : 0.0f)

/* The width-dependent tiles (_attn_tile.h): fxa_qk_tile_8, fxa_pv_tile_8
   on 8-float vectors everywhere; fxa_qk_tile_16, fxa_pv_tile_16 on 16-float
   vectors where FXA_HAVE_W16.  FXA_QK_TILE / FXA_PV_TILE pick one by W, a
   constant in every instantiation of the loop nest. */
#define FXT_W 8
#define FXT_V fxa_v8
#define FXT_LOAD fxa_load
#define FXT_STORE fxa_store
#define FXT_SPLAT fxa_splat
#define FXT_LD FXA_LD
#define FXT_FOLD8(v) (v)
#include "_attn_tile.h"
#if FXA_HAVE_W16
#define FXT_W 16
#define FXT_V fxa_v16
#define FXT_LOAD fxa16_load
#define FXT_STORE fxa16_store
#define FXT_SPLAT fxa16_splat
#define FXT_LD FXA_LD16
#define FXT_FOLD8 fxa16_fold8
#include "_attn_tile.h"
#define FXA_QK_TILE(W, ...) ((W) == 16 ? fxa_qk_tile_16(__VA_ARGS__) : fxa_qk_tile_8(__VA_ARGS__))
#define FXA_QKT_TILE(W, ...) ((W) == 16 ? fxa_qkt_tile_16(__VA_ARGS__) : fxa_qkt_tile_8(__VA_ARGS__))
#define FXA_PV_TILE(W, ...) ((W) == 16 ? fxa_pv_tile_16(__VA_ARGS__) : fxa_pv_tile_8(__VA_ARGS__))
#else
#define FXA_QK_TILE(W, ...) ((void)(W), fxa_qk_tile_8(__VA_ARGS__))
#define FXA_QKT_TILE(W, ...) ((void)(W), fxa_qkt_tile_8(__VA_ARGS__))
#define FXA_PV_TILE(W, ...) ((void)(W), fxa_pv_tile_8(__VA_ARGS__))
#endif

/* Online-softmax step of one query vector over one chunk.  s: its scores
   (base 2) for the chunk's rows, of which only [a, b) are visible (and only
   those need be valid).  Leaves p = 2^((s - m_new) f) on [a, b) and 0
   elsewhere on [0, n8), sets *alpha = 2^((m_old - m_new) f) (1 if the max
   did not grow or nothing is visible, 0 on the first visible chunk) and
   updates m, l.  The max ignores NaN; while it is -inf (every visible score
   so far -inf or NaN) p is 2^(s f): 0 for -inf, NaN for NaN. */
FX_INLINE void fxa_softmax_step(float *s, int a, int b, int n8, float *m, float *l, float *alpha, float f)
{
    const int g0 = a & ~7, g1 = (b + 7) & ~7;
    fxa_v8 mx = fxa_splat(FX_NEG_INF), sum = fxa_splat(0.0f);
    float mc;
    int r;
    *alpha = 1.0f;
    if (a >= b) {
        for (r = 0; r < n8; r += 8) fxa_store(s + r, fxa_splat(0.0f));
        return;
    }
    for (r = 0; r < g0; r += 8) fxa_store(s + r, fxa_splat(0.0f));
    for (r = g1; r < n8; r += 8) fxa_store(s + r, fxa_splat(0.0f));
    /* only the end groups can hold invisible rows: -inf there gives p = 0 */
    if (a > g0) fxa_store(s + g0, fxa_mask_range(fxa_load(s + g0), g0, a, b));
    if (b < g1) fxa_store(s + g1 - 8, fxa_mask_range(fxa_load(s + g1 - 8), g1 - 8, a, b));
    for (r = g0; r < g1; r += 8) mx = fxa_max(mx, fxa_load(s + r));
    mc = fxa_hmax(mx);
    if (mc > *m) {
#ifdef FX_ATTN_LIBM_EXP
        *alpha = expf((*m - mc) * f * 0.693147180559945f);
#else
        *alpha = fxa_exp2f((*m - mc) * f); /* m = -inf before the first visible row: 0 */
#endif
        *m = mc;
    }
    mc = *m == FX_NEG_INF ? 0.0f : *m;
#ifdef FX_ATTN_LIBM_EXP
    for (r = g0; r < g1; r++) s[r] = expf((s[r] - mc) * f * 0.693147180559945f);
    for (r = g0; r < g1; r += 8) sum = fxa_add(sum, fxa_load(s + r));
#else
    for (r = g0; r < g1; r += 8) {
        const fxa_v8 pr = fxa_exp2(fxa_mul(fxa_sub(fxa_load(s + r), fxa_splat(mc)), fxa_splat(f)));
        fxa_store(s + r, pr);
        sum = fxa_add(sum, pr);
    }
#endif
    *l = *l * *alpha + fxa_hsum(sum);
}

/* Query vectors of one pass are numbered kv-head-major: i = h*nvg + pos*G + jj
   (h-th kv head of the pass, position pos within the pass, query head jj
   within the group), so the vectors sharing a kv head are consecutive.
   Tiles are runs of 4 (then 2, 1) consecutive vectors of one kv head. */
#define FX_TILE_T(left) ((left) >= 4 ? 4 : (left) >= 2 ? 2 : 1)

/* Rows [ua, ub) of the chunk that some vector of tile i0 .. i0+T-1 sees
   (ua >= ub: none). */
FX_INLINE void fxa_tile_rows(const float *fa, const float *fb, ptrdiff_t i0, int T, int *ua, int *ub)
{
    int t;
    *ua = FX_C;
    *ub = 0;
    for (t = 0; t < T; t++)
        if (fa[i0 + t] < fb[i0 + t]) {
            *ua = (int)fa[i0 + t] < *ua ? (int)fa[i0 + t] : *ua;
            *ub = (int)fb[i0 + t] > *ub ? (int)fb[i0 + t] : *ub;
        }
}

/* Phase A: scores of every tile of nh kv heads (nvg vectors each, the
   first one numbered i1) for rows [r, r1) of the chunk.  The slice of the
   h-th of these heads is at value offset koff0 + h*head_dim of c->k[row]
   (int8 scales at c->ks[row] + soff0 + h*groups). */
FX_INLINE void fxa_phase_scores(const fx_attn_args *a, ptrdiff_t nvg, int nh, ptrdiff_t i1, size_t koff0,
                               size_t soff0, const fxa_rows *c, int r, int r1, const float *qs, float *sc,
                               const float *fa, const float *fb, const int dt, const int W)
{
    const int hd = a->head_dim;
    const size_t ng = fx_i8_groups(hd);
    int h;
    for (h = 0; h < nh; h++) {
        const size_t koff = koff0 + (size_t)h * (size_t)hd, soff = soff0 + (size_t)h * ng;
        const ptrdiff_t iend = i1 + (h + 1) * nvg;
        ptrdiff_t i0;
        for (i0 = i1 + h * nvg; i0 < iend; i0 += FX_TILE_T(iend - i0)) {
            const int T = FX_TILE_T(iend - i0), R = 12 / T;
            const float *q = qs + (size_t)i0 * hd;
            int ua, ub, rr;
            fxa_tile_rows(fa, fb, i0, T, &ua, &ub);
            ua = ua > r ? ua : r;
            ub = ub < r1 ? ub : r1;
            for (rr = ua; rr < ub; rr += R) { /* the last group may run past ub: padded rows */
                float *s = sc + (size_t)i0 * FX_CS + rr;
                if (T == 4) FXA_QK_TILE(W, 4, 3, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                else if (T == 2) FXA_QK_TILE(W, 2, 6, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                else FXA_QK_TILE(W, 1, 12, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
            }
        }
    }
}

/* Phase A on a packed head: scores of the tiles of vectors i1 .. i1+nvg
   against the transposed K slice kt (FX_KT floats per dimension), for the
   groups of 3W rows that hold a row the tile sees. */
FX_INLINE void fxa_phase_scores_t(int hd, ptrdiff_t nvg, ptrdiff_t i1, const float *kt, const float *qs, float *sc,
                                  const float *fa, const float *fb, const int W)
{
    const ptrdiff_t iend = i1 + nvg;
    ptrdiff_t i0;
    for (i0 = i1; i0 < iend; i0 += FX_TILE_T(iend - i0)) {
        const int T = FX_TILE_T(iend - i0);
        int ua, ub, rr;
        float *s = sc + (size_t)i0 * FX_CS;
        const float *q = qs + (size_t)i0 * hd;
        fxa_tile_rows(fa, fb, i0, T, &ua, &ub);
        for (rr = ua / (3 * W) * (3 * W); rr < ub; rr += 3 * W) {
            if (T == 4) FXA_QKT_TILE(W, 4, q, hd, kt, rr, s);
            else if (T == 2) FXA_QKT_TILE(W, 2, q, hd, kt, rr, s);
            else FXA_QKT_TILE(W, 1, q, hd, kt, rr, s);
        }
    }
}

/* Phase C: acc += p.V for the same tiles and rows [r, r1), rescaling each
   tile's accumulators by alpha in the row group that holds its first
   visible row.  V slices at value offset voff0 + h*v_head_dim of c->v[row]
   (int8 scales at c->vs[row] + soff0 + h*groups). */
FX_INLINE void fxa_phase_pv(const fx_attn_args *a, ptrdiff_t nvg, int nh, ptrdiff_t i1, size_t voff0, size_t soff0,
                           const fxa_rows *c, int r, int r1, float *acc, const float *sc, const float *al,
                           const float *fa, const float *fb, const int dt, const int W)
{
    const int dv = a->v_head_dim;
    const size_t ng = fx_i8_groups(dv);
    int h;
    for (h = 0; h < nh; h++) {
        const size_t voff = voff0 + (size_t)h * (size_t)dv, soff = soff0 + (size_t)h * ng;
        const ptrdiff_t iend = i1 + (h + 1) * nvg;
        ptrdiff_t i0;
        for (i0 = i1 + h * nvg; i0 < iend; i0 += FX_TILE_T(iend - i0)) {
            const int T = FX_TILE_T(iend - i0);
            float *o = acc + (size_t)i0 * dv;
            const float *p = sc + (size_t)i0 * FX_CS, *alp = al + i0;
            int ua, ub, lo, hi, first, ca, cb, t;
            fxa_tile_rows(fa, fb, i0, T, &ua, &ub);
            lo = ua > r ? ua : r;
            hi = ub < r1 ? ub : r1;
            if (lo >= hi) continue;
            first = ua >= r;
            /* rows every vector of the tile sees: the tile reads them once for all */
            ca = lo;
            cb = hi;
            for (t = 0; t < T; t++) {
                ca = (int)fa[i0 + t] > ca ? (int)fa[i0 + t] : ca;
                cb = (int)fb[i0 + t] < cb ? (int)fb[i0 + t] : cb;
            }
            if (ca == lo && cb == hi) {
                if (T == 4) FXA_PV_TILE(W, 4, o, dv, alp, first, p, c->v, c->vs, voff, soff, lo, hi, dt);
                else if (T == 2) FXA_PV_TILE(W, 2, o, dv, alp, first, p, c->v, c->vs, voff, soff, lo, hi, dt);
                else FXA_PV_TILE(W, 1, o, dv, alp, first, p, c->v, c->vs, voff, soff, lo, hi, dt);
                continue;
            }
            /* vectors of different positions see different rows (causal
               edge, window, start): each reads only its own rows (p = 0 on a
               row it does not see would still turn a NaN in V into NaN) */
            if (ca < cb) {
                if (T == 4) FXA_PV_TILE(W, 4, o, dv, alp, first, p, c->v, c->vs, voff, soff, ca, cb, dt);
                else if (T == 2) FXA_PV_TILE(W, 2, o, dv, alp, first, p, c->v, c->vs, voff, soff, ca, cb, dt);
            }
            for (t = 0; t < T; t++) {
                float *ot = o + (size_t)t * dv;
                const float *pt = p + (size_t)t * FX_CS;
                const int a0 = (int)fa[i0 + t] > lo ? (int)fa[i0 + t] : lo;
                const int b0 = (int)fb[i0 + t] < hi ? (int)fb[i0 + t] : hi;
                if (ca < cb) {
                    if (a0 < ca) FXA_PV_TILE(W, 1, ot, dv, alp + t, 0, pt, c->v, c->vs, voff, soff, a0, ca, dt);
                    if (cb < b0) FXA_PV_TILE(W, 1, ot, dv, alp + t, 0, pt, c->v, c->vs, voff, soff, cb, b0, dt);
                } else {
                    FXA_PV_TILE(W, 1, ot, dv, alp + t, first, pt, c->v, c->vs, voff, soff, a0, b0 > a0 ? b0 : a0, dt);
                }
            }
        }
    }
}

/* One kv head's slice of a row as float32 (fxa_pack_head).  The packed
   head: K of the chunk's n rows transposed into kt (fxa_phase_scores_t
   reads it), V as contiguous rows that pk points at (padding entries
   repeat the last row; the p.V tiles read pk as FX_F32). */
FX_INLINE void fxa_unpack_slice(float *dst, const char *row, const float *scales, int g, int hd, const int dt)
{
    const size_t off = (size_t)g * (size_t)hd, soff = (size_t)g * fx_i8_groups(hd);
    int d = 0;
    if (dt == FX_F32) {
        memcpy(dst, row + 4 * off, (size_t)hd * sizeof(float));
        return;
    }
    for (; d + 8 <= hd; d += 8) fxa_store(dst + d, FXA_LD(dt, row, off + (size_t)d, dt == FX_I8 ? scales[soff + ((size_t)d >> 5)] : 0.0f));
    for (; d < hd; d++) dst[d] = fxa_ld1(dt, row, off + (size_t)d, dt == FX_I8 ? scales[soff + ((size_t)d >> 5)] : 0.0f);
}

FX_INLINE void fxa_pack_head(const fxa_rows *c, int n, int g, int hd, int dv, float *kt, float *krow, float *vbuf,
                             fxa_rows *pk, const int dt)
{
    int r, d;
    /* K transposed (kt[d*FX_KT + r]), rows past n zero */
    for (r = 0; r < n; r++) {
        fxa_unpack_slice(krow, c->k[r], c->ks[r], g, hd, dt);
        for (d = 0; d < hd; d++) kt[(size_t)d * FX_KT + r] = krow[d];
    }
    if (n < FX_KT)
        for (d = 0; d < hd; d++) memset(kt + (size_t)d * FX_KT + n, 0, (size_t)(FX_KT - n) * sizeof(float));
    for (r = 0; r < n; r++) {
        fxa_unpack_slice(vbuf + (size_t)r * dv, c->v[r], c->vs[r], g, dv, dt);
        pk->k[r] = NULL;
        pk->v[r] = (const char *)(vbuf + (size_t)r * dv);
        pk->ks[r] = pk->vs[r] = NULL;
    }
    for (r = n; r < FX_CP; r++) {
        pk->k[r] = NULL;
        pk->v[r] = pk->v[n - 1];
        pk->ks[r] = pk->vs[r] = NULL;
    }
}

/* Shape of a pass: nq query positions x nh kv heads (x G query heads),
   about FX_ATTN_QBLOCK query vectors.  Everything in one pass when it fits;
   else positions first (each K/V slice is then reused by more queries),
   then kv heads. */
static inline FX_UNUSED void fxa_pass_shape(const fx_attn_args *a, ptrdiff_t *nq, int *nh)
{
    const int G = a->n_heads / a->n_kv_heads;
    if ((ptrdiff_t)a->n_heads * a->q_len <= FX_ATTN_QBLOCK) {
        *nq = a->q_len;
        *nh = a->n_kv_heads;
        return;
    }
    *nq = FX_ATTN_QBLOCK / G < 1 ? 1 : FX_ATTN_QBLOCK / G;
    if (*nq > a->q_len) *nq = a->q_len;
    *nh = (int)(FX_ATTN_QBLOCK / (*nq * G));
    if (*nh < 1) *nh = 1;
    if (*nh > a->n_kv_heads) *nh = a->n_kv_heads;
}

/* A kv head's K/V slices are packed into contiguous buffers when more than
   FX_ATTN_PACK_MIN query vectors (8 tiles) of a pass share them. */
#define FX_PACKS(nvg) ((nvg) > FX_ATTN_PACK_MIN)

/* Floats of scratch fx_attend needs, for the nv query vectors of a pass:
   scaled queries, output accumulators, one chunk of scores, m, l, alpha and
   the visible row range of each vector; plus one chunk of one head's K
   (transposed, FX_KT rows, and one row) and V when they are packed, and
   one chunk's int8 scales as float. */
static inline FX_UNUSED size_t fx_attend_scratch_floats(const fx_attn_args *a)
{
    ptrdiff_t nq;
    int nh;
    size_t nvg, nv;
    fxa_pass_shape(a, &nq, &nh);
    nvg = (size_t)nq * (size_t)(a->n_heads / a->n_kv_heads);
    nv = nvg * (size_t)nh;
    return nv * ((size_t)a->head_dim + (size_t)a->v_head_dim + FX_CS + 5) +
           (FX_PACKS(nvg) ? (size_t)(FX_KT + 1) * (size_t)a->head_dim + (size_t)FX_C * (size_t)a->v_head_dim : 0) +
           FXA_SCALE_FLOATS(a);
}

/* q: (q_len, n_heads, head_dim); out: (q_len, n_heads, v_head_dim), both
   C-contiguous.  Query t sits at position p = len - q_len + t and sees rows
   max(start, window ? p-window+1 : 0) .. p; a query that sees no row gets
   zeros.  scratch: fx_attend_scratch_floats(a) floats, any contents.
   kv->dtype selects the instantiation of the one loop nest below.

   Loop nest.  Passes over (block of query positions) x (block of kv heads),
   see fxa_pass_shape; the pass keeps its queries, accumulators, m and l in
   scratch, and walks the rows its queries see in chunks of FX_C rows:
     up to FX_ATTN_PACK_MIN query vectors per kv head (decode, short q_len)
       A  scores   for row groups of RGA rows: for kv heads: its tiles
       B  softmax  every query vector: chunk max, alpha, p, l
       C  p.V      for row groups of RGC rows: for kv heads: its tiles
       K and V are read row after row across all heads, close to memory
       order: the hardware prefetcher streams them, and a head's slices in
       consecutive rows (4 KiB apart: same L1 sets) are never needed more
       than a row group at a time.
     more (prefill, MQA with G > 32)
       for kv heads: pack the chunk's K slice transposed and its V slice
       contiguously, then A (on the transposed K: no horizontal sums), B, C
       over the whole chunk for every tile of the head (the packed slices
       stay in L1 across the tiles that reuse them). */
FX_INLINE void fxa_attend_body(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch,
                               const int dt, const int W)
{
    const int H = a->n_heads, Hkv = a->n_kv_heads, G = a->n_heads / a->n_kv_heads;
    const int hd = a->head_dim, dv = a->v_head_dim;
    const size_t ngk = fx_i8_groups(hd), ngv = fx_i8_groups(dv);
    const ptrdiff_t first = kv->len - a->q_len;
    const float c = a->scale * FX_LOG2E;
    /* q is scaled by qscale, exponents by f (see the rules at the top) */
    const int small = c <= 1.0f && c >= -1.0f, finite = c <= 3.4028234e38f && c >= -3.4028234e38f;
    const float qscale = small ? c : (c > 0 ? 1.0f : -1.0f) * (finite ? 1.0f : 2.0f);
    const float f = small ? 1.0f : finite ? (c > 0 ? c : -c) : (float)((a->scale > 0 ? (double)a->scale : -(double)a->scale) * 0.72134752044448170);
    fxa_rows rows, packed;
    ptrdiff_t qb, t0;
    int hb, g0;

    fxa_pass_shape(a, &qb, &hb);
    for (t0 = 0; t0 < a->q_len; t0 += qb)
        for (g0 = 0; g0 < Hkv; g0 += hb) {
            const ptrdiff_t nq = a->q_len - t0 < qb ? a->q_len - t0 : qb;
            const int nh = Hkv - g0 < hb ? Hkv - g0 : hb;
            const ptrdiff_t nvg = nq * G, nv = nvg * nh, p_last = first + t0 + nq - 1;
            float *qs = scratch, *acc = qs + (size_t)nv * hd, *sc = acc + (size_t)nv * dv;
            float *mm = sc + (size_t)nv * FX_CS, *ll = mm + nv, *al = ll + nv, *fa = al + nv, *fb = fa + nv;
            float *kt = fb + nv, *krow = kt + (size_t)FX_KT * hd, *vbuf = krow + hd;
            const int pack = FX_PACKS(nvg);
            float *sbuf = pack ? vbuf + (size_t)FX_C * dv : kt;
            ptrdiff_t lo, c0, i, pos;
            int h, jj, d;

            /* scaled queries, vector i = h*nvg + pos*G + jj (kv head g0+h, position t0+pos,
               query head (g0+h)*G + jj): a kv head's vectors are consecutive */
            for (h = 0, i = 0; h < nh; h++)
                for (pos = 0; pos < nq; pos++)
                    for (jj = 0; jj < G; jj++, i++) {
                        const float *src = q + ((size_t)(t0 + pos) * H + (size_t)(g0 + h) * G + jj) * hd;
                        for (d = 0; d < hd; d++) qs[(size_t)i * hd + d] = src[d] * qscale;
                        mm[i] = FX_NEG_INF;
                        ll[i] = 0.0f;
                    }
            memset(acc, 0, (size_t)nv * dv * sizeof(float));

            /* rows any query of this pass sees: lo of the first position .. p_last */
            lo = a->start;
            if (a->window > 0 && first + t0 - a->window + 1 > lo) lo = first + t0 - a->window + 1;
            for (c0 = lo; c0 <= p_last; c0 += FX_C) {
                const int n = (int)(p_last + 1 - c0 < FX_C ? p_last + 1 - c0 : FX_C), n8 = (n + 7) & ~7;
                int r;
                fxa_chunk_rows(kv, a, c0, n, &rows, sbuf, dt);
                /* rows [fa, fb) of this chunk each vector sees */
                for (h = 0, i = 0; h < nh; h++)
                    for (pos = 0; pos < nq; pos++) {
                        const ptrdiff_t p = first + t0 + pos;
                        ptrdiff_t vlo = a->start, x, y;
                        if (a->window > 0 && p - a->window + 1 > vlo) vlo = p - a->window + 1;
                        x = vlo - c0 < 0 ? 0 : vlo - c0 > n ? n : vlo - c0;
                        y = p + 1 - c0 < 0 ? 0 : p + 1 - c0 > n ? n : p + 1 - c0;
                        for (jj = 0; jj < G; jj++, i++) {
                            fa[i] = (float)x;
                            fb[i] = (float)y;
                        }
                    }
                if (!pack) {
                    for (r = 0; r < n; r += FX_ATTN_RGA)
                        fxa_phase_scores(a, nvg, nh, 0, (size_t)g0 * hd, (size_t)g0 * ngk, &rows, r,
                                        r + FX_ATTN_RGA < n ? r + FX_ATTN_RGA : n, qs, sc, fa, fb, dt, W);
                    for (i = 0; i < nv; i++)
                        fxa_softmax_step(sc + (size_t)i * FX_CS, (int)fa[i], (int)fb[i], n8, mm + i, ll + i, al + i, f);
                    for (r = 0; r < n; r += FX_ATTN_RGC)
                        fxa_phase_pv(a, nvg, nh, 0, (size_t)g0 * dv, (size_t)g0 * ngv, &rows, r,
                                    r + FX_ATTN_RGC < n ? r + FX_ATTN_RGC : n, acc, sc, al, fa, fb, dt, W);
                } else {
                    for (h = 0; h < nh; h++) {
                        fxa_pack_head(&rows, n, g0 + h, hd, dv, kt, krow, vbuf, &packed, dt);
                        fxa_phase_scores_t(hd, nvg, h * nvg, kt, qs, sc, fa, fb, W);
                        for (i = h * nvg; i < (h + 1) * nvg; i++)
                            fxa_softmax_step(sc + (size_t)i * FX_CS, (int)fa[i], (int)fb[i], n8, mm + i, ll + i,
                                            al + i, f);
                        fxa_phase_pv(a, nvg, 1, h * nvg, 0, 0, &packed, 0, n, acc, sc, al, fa, fb, FX_F32, W);
                    }
                }
            }

            /* out = acc / l, back in (position, head) order; zeros where nothing
               was visible; l = 0 with rows visible (all scores -inf) gives
               0 * inf = NaN, l = NaN gives NaN */
            for (h = 0, i = 0; h < nh; h++)
                for (pos = 0; pos < nq; pos++) {
                    const ptrdiff_t p = first + t0 + pos;
                    ptrdiff_t vlo = a->start;
                    if (a->window > 0 && p - a->window + 1 > vlo) vlo = p - a->window + 1;
                    for (jj = 0; jj < G; jj++, i++) {
                        float *dst = out + ((size_t)(t0 + pos) * H + (size_t)(g0 + h) * G + jj) * dv;
                        const float inv = vlo <= p ? 1.0f / ll[i] : 0.0f;
                        for (d = 0; d < dv; d++) dst[d] = acc[(size_t)i * dv + d] * inv;
                    }
                }
        }
}

/* The loop nest for kv->dtype at vector width W; f16: how float16 is read
   (FXA_F16C or FX_F16). */
FX_INLINE void fxa_attend_dtype(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch,
                                const int f16, const int W)
{
    switch (kv->dtype) {
    case FX_F16: fxa_attend_body(kv, a, q, out, scratch, f16, W); break;
    case FX_BF16: fxa_attend_body(kv, a, q, out, scratch, FX_BF16, W); break;
    case FX_I8: fxa_attend_body(kv, a, q, out, scratch, FX_I8, W); break;
    default: fxa_attend_body(kv, a, q, out, scratch, FX_F32, W); break;
    }
}

#if FX_ATTN_CLONES && FXA_HAVE_F16C
/* float16 through F16C: the one instantiation built for x86-64-v3 outside
   the clones (the baseline clone must not contain vcvtph2ps). */
__attribute__((target("arch=x86-64-v3"))) static FX_UNUSED void fxa_attend_f16c(const fx_kv *kv, const fx_attn_args *a,
                                                                                const float *q, float *out,
                                                                                float *scratch)
{
    fxa_attend_body(kv, a, q, out, scratch, FXA_F16C, 8);
}
#endif
#if FX_ATTN_CLONES && FXA_HAVE_W16
/* Every dtype on 16-float vectors, built for x86-64-v4 outside the clones
   (an x86-64-v4 clone of fx_attend would still run 8-float vectors). */
__attribute__((target("arch=x86-64-v4"))) static FX_UNUSED void fxa_attend_v4(const fx_kv *kv, const fx_attn_args *a,
                                                                              const float *q, float *out,
                                                                              float *scratch)
{
    fxa_attend_dtype(kv, a, q, out, scratch, FXA_F16C, 16);
}
#endif

/* Widest vectors fx_attend may use (8 or 16): tests and benchmarks lower it
   to run the x86-64-v3 path on an AVX-512 machine.  Not for use while
   another thread attends. */
static int fxa_max_width = 16;
#if defined(__GNUC__) || defined(__clang__)
#define FXA_MAX_WIDTH() __atomic_load_n(&fxa_max_width, __ATOMIC_RELAXED)
#define FXA_SWAP_MAX_WIDTH(w) __atomic_exchange_n(&fxa_max_width, (w), __ATOMIC_RELAXED)
#else
#define FXA_MAX_WIDTH() (*(volatile int *)&fxa_max_width)
static inline int FXA_SWAP_MAX_WIDTH(int w) { const int old = FXA_MAX_WIDTH(); fxa_max_width = w; return old; }
#endif
static inline FX_UNUSED int fx_attend_set_max_width(int w) { return FXA_SWAP_MAX_WIDTH(w >= 16 ? 16 : 8); }

/* Floats per vector fx_attend uses for these head dims on this CPU: 16
   with AVX-512 when both head dims are multiples of 16, else 8. */
static inline FX_UNUSED int fx_attend_width(const fx_attn_args *a)
{
    if (a->head_dim % 16 != 0 || a->v_head_dim % 16 != 0 || FXA_MAX_WIDTH() < 16)
        return 8;
#if FX_ATTN_CLONES && FXA_HAVE_W16
    return fx_cpu_level() >= 4 ? 16 : 8;
#elif FXA_HAVE_W16
    return 16;
#else
    return 8;
#endif
}

FX_CLONES static FX_UNUSED void fx_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out,
                                          float *scratch)
{
#if FX_ATTN_CLONES
#if FXA_HAVE_W16
    if (fx_attend_width(a) == 16) {
        fxa_attend_v4(kv, a, q, out, scratch);
        return;
    }
#endif
#if FXA_HAVE_F16C
    if (kv->dtype == FX_F16 && fx_cpu_v3()) {
        fxa_attend_f16c(kv, a, q, out, scratch);
        return;
    }
#endif
    fxa_attend_dtype(kv, a, q, out, scratch, FX_F16, 8);
#else /* one build: what the compiler targets */
    const int f16 = FXA_HAVE_F16C ? FXA_F16C : FX_F16;
    if (fx_attend_width(a) == 16) fxa_attend_dtype(kv, a, q, out, scratch, f16, 16);
    else fxa_attend_dtype(kv, a, q, out, scratch, f16, 8);
#endif
}

/* Which code path fx_attend runs on this CPU (for head dims that are
   multiples of 16; others run the 8-float path below it).  With clones:
   the libgcc feature bits the ifunc resolver tests; otherwise what the
   compiler was told to target. */
static inline FX_UNUSED const char *fx_attend_simd_path(void)
{
#if !defined(FX_VECEXT)
    return "scalar C (no vector extensions)";
#elif FX_ATTN_CLONES
    const int level = fx_cpu_level();
    if (FXA_HAVE_W16 && level >= 4 && FXA_MAX_WIDTH() >= 16) return "x86-64-v4 (AVX-512, 16-float vectors)";
    if (level >= 3) return "x86-64-v3 (AVX2+FMA)";
    return "baseline (SSE2)";
#elif FXA_HAVE_W16
    if (FXA_MAX_WIDTH() >= 16) return "x86-64 AVX-512 (16-float vectors, compile-time)";
    return "x86-64 AVX-512 (8-float vectors, compile-time)";
#elif defined(__AVX2__) && defined(__FMA__)
    return "x86-64-v3 (AVX2+FMA, compile-time)";
#elif defined(__SSE2__)
    return "baseline (SSE2)";
#elif defined(__ARM_NEON) || defined(__aarch64__)
    return "NEON";
#else
    return "generic vectors";
#endif
}

/* How fx_attend reads rows of dtype on this CPU (the vector code path
   around it is fx_attend_simd_path()); NULL for an unknown dtype. */
static inline FX_UNUSED const char *fx_attend_load_path(int dtype)
{
    switch (dtype) {
    case FX_F32: return "float32: vector loads";
    case FX_F16:
#if FX_ATTN_CLONES && FXA_HAVE_F16C
        if (fx_cpu_v3()) return "float16: F16C vcvtph2ps";
#elif FXA_HAVE_F16C
        return "float16: F16C vcvtph2ps (compile-time)";
#endif
        return "float16: exact integer conversion";
    case FX_BF16: return "bfloat16: zero-extend, shift 16";
    case FX_I8: return "int8: widen x group scale";
    default: return NULL;
    }
}

#endif /* FX_ATTN_H */
