/* _simd.h -- the ISA layer of the ferrox_kv C code: which x86-64 levels a
 * build dispatches to, compiler plumbing, and the vector helpers (8 floats
 * wide everywhere, 16 with AVX-512) with the row loads of every storage
 * dtype (_conv.h).  Header-only, every symbol static or a macro.
 *
 * Rules
 *   - Dispatch: on x86-64 glibc with gcc >= 11 (FX_ATTN_CLONES), code is
 *     built once per level it dispatches to: the attention kernel as one
 *     translation unit per level (_attn_base.c, _attn_v3.c, _attn_v4.c,
 *     their functions carrying target("arch=...")), the conversion loops
 *     with target_clones (FX_CLONES, _conv.c).  FX_ATTN_NO_CLONES, another
 *     compiler or another CPU: one build, for what the compiler targets.
 *   - Only outer functions carry target attributes; every helper here is a
 *     macro or always_inline, so it compiles for the target of the function
 *     it is expanded in.  Never put target attributes on the helpers (that
 *     stops them inlining), and never pass a vector to a function that is
 *     not inlined (the ABI differs between targets).
 *   - F16C (vcvtps2ph / vcvtph2ps) builtins are checked where they are
 *     expanded: they may sit in helpers that baseline code also includes,
 *     as long as only code built for x86-64-v3 or above reaches them.
 */
#ifndef FX_SIMD_H
#define FX_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "_conv.h"
#if defined(__GNUC__) && !defined(__clang__)
/* vectors never cross a real call (see above); the F16C builtins take and return them */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

/* target_clones needs ifunc (glibc) and gcc >= 11 for the arch=x86-64-vN
   names.  Only outer functions carry it; every helper they call is inline. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 \
    && defined(__GLIBC__) && !defined(FX_ATTN_NO_CLONES)
#define FX_ATTN_CLONES 1
#define FX_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FX_ATTN_CLONES 0
#define FX_CLONES
#endif

/* F16C: float32 -> float16 stores (fx_st8_f16c, _conv.c) and float16
   loads (fxa_load_f16c, the kernel), only in code built for x86-64-v3 or
   above. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) \
    && (FX_ATTN_CLONES || (defined(__F16C__) && defined(__AVX__)))
#define FX_HAVE_F16C 1
#include <immintrin.h>
typedef short fx_v8s __attribute__((vector_size(16), aligned(1), may_alias));
typedef float fx_v8fu __attribute__((vector_size(32), aligned(4), may_alias));
/* 8 float32 at src -> 8 float16 at dst, round to nearest even */
#define fx_st8_f16c(dst, src) \
    ((void)(*(fx_v8s *)(void *)(dst) = __builtin_ia32_vcvtps2ph256(*(const fx_v8fu *)(const void *)(src), 0)))
#else
#define FX_HAVE_F16C 0
#endif

/* The x86-64 level this CPU runs: 4 with AVX-512 (x86-64-v4), 3 with
   AVX2+FMA (the test an ifunc resolver makes), else
   0; 0 without clones. */
static inline FX_UNUSED int fx_cpu_level(void)
{
#if FX_ATTN_CLONES
    static int v = -1;
    int x = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (x < 0) {
        __builtin_cpu_init();
        x = __builtin_cpu_supports("x86-64-v4") ? 4 : __builtin_cpu_supports("x86-64-v3") ? 3 : 0;
        __atomic_store_n(&v, x, __ATOMIC_RELAXED);
    }
    return x;
#else
    return 0;
#endif
}
static inline FX_UNUSED int fx_cpu_v3(void) { return fx_cpu_level() >= 3; }
/* AVX-512 VNNI (vpdpbusd) on a CPU at x86-64-v4; 0 without clones. */
static inline FX_UNUSED int fx_cpu_vnni(void)
{
#if FX_ATTN_CLONES
    static int v = -1;
    int x = __atomic_load_n(&v, __ATOMIC_RELAXED);
    if (x < 0) {
        x = fx_cpu_level() >= 4 && __builtin_cpu_supports("avx512vnni");
        __atomic_store_n(&v, x, __ATOMIC_RELAXED);
    }
    return x;
#else
    return 0;
#endif
}


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
/* r[i][j] becomes r[j][i] (8 x 8): pairs interleaved, then pairs of
   pairs, then 128-bit halves; 24 shuffles. */
FX_INLINE void fxa_transpose8(fxa_v8 *r)
{
    fxa_v8 t[8], u[8];
    int i;
    for (i = 0; i < 8; i += 2) {
        t[i] = FX_SHUF8(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = FX_SHUF8(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (i = 0; i < 8; i += 4) {
        u[i] = FX_SHUF8(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = FX_SHUF8(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = FX_SHUF8(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = FX_SHUF8(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (i = 0; i < 4; i++) {
        r[i] = FX_SHUF8(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = FX_SHUF8(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}
/* 2^y for y <= 0 (relative error < 1e-7).  y < -125 (and -inf) gives
   exactly 0, so no result is denormal; NaN gives NaN (a NaN score makes its
   query NaN, as in SDPA).  y = n + f, n = round(y); 2^f =
   e^(f ln2) by the Cephes expf polynomial on |f ln2| <= ln2/2; 2^n is built
   in the exponent field.  Same steps as the scalar fxa_exp2f below.
   FXA_EXP2(V, VI, y): the same on vectors of type V (VI: its lanes as
   int32), so that every width computes the same bits per lane. */
#define FXA_EXP2(V, VI, y) __extension__({                                             \
    const V y_ = (y);                                                                   \
    const VI keep_ = y_ >= -125.0f;                                                     \
    const V yc_ = (V)((VI)y_ & keep_); /* dropped lanes: 0, harmless */                \
    const VI n_ = __builtin_convertvector(yc_ - 0.5f, VI); /* = round(yc_) */           \
    const V g_ = (yc_ - __builtin_convertvector(n_, V)) * 0.693147180559945f;           \
    V p_ = g_ * 1.9875691500e-4f + 1.3981999507e-3f;                                    \
    p_ = p_ * g_ + 8.3334519073e-3f;                                                   \
    p_ = p_ * g_ + 4.1665795894e-2f;                                                   \
    p_ = p_ * g_ + 1.6666665459e-1f;                                                   \
    p_ = p_ * g_ + 5.0000001201e-1f;                                                   \
    p_ = (g_ * g_) * p_ + g_ + 1.0f;                                                   \
    (V)(((VI)(p_ * (V)((n_ + 127) << 23)) & keep_) | ((VI)y_ & (y_ != y_))); })
#define fxa_exp2(y) FXA_EXP2(fxa_v8, fxa_v8i, y)

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
/* int4 (_conv.h's layout): the 8 values at value offset e (a multiple
   of 8) are the low or the high nibbles of 8 bytes of their group, each
   minus 8, times the group's scale. */
typedef uint8_t fxa_v8ub __attribute__((vector_size(8)));
typedef uint8_t fxa_v8ubu __attribute__((vector_size(8), aligned(1), may_alias));
#define fxa_load_i4(row, e, sc) __extension__({                                                      \
    const size_t e4_ = (e);                                                                         \
    const fxa_v8ub b4_ = *(const fxa_v8ubu *)(const void *)((row) + (e4_ >> 5) * 16 + (e4_ & 15));  \
    const fxa_v8ub n4_ = (e4_ & 16) ? (fxa_v8ub)(b4_ >> 4) : (fxa_v8ub)(b4_ & 15);                   \
    __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(n4_, fxa_v8w), fxa_v8i) - 8, \
                            fxa_v8) * fxa_splat(sc); })
/* float16, exact, as fx_f16_to_f32 */
#define fxa_load_f16(p) __extension__({                                                              \
    const fxa_v8i x_ = __builtin_convertvector(*(const fxa_v8h *)(const void *)(p), fxa_v8i);          \
    const fxa_v8i em_ = x_ & 0x7fff, v_ = em_ << 13, small_ = em_ < 0x400, big_ = em_ >= 0x7c00;     \
    const fxa_v8i sub_ = (fxa_v8i)(__builtin_convertvector(em_, fxa_v8) * 0x1p-24f);                 \
    const fxa_v8i m_ = (sub_ & small_) | ((v_ | 0x7f800000) & big_) | ((v_ + 0x38000000) & ~(small_ | big_)); \
    (fxa_v8)(m_ | ((x_ & 0x8000) << 16)); })
#if FX_HAVE_F16C
/* float16 through F16C (see the rules at the top) */
#define FXA_HAVE_F16C 1
#define fxa_load_f16c(p) ((fxa_v8)__builtin_ia32_vcvtph2ps256(*(const fx_v8s *)(const void *)(p)))
#else
#define FXA_HAVE_F16C 0
#define fxa_load_f16c(p) fxa_load_f16(p)
#endif

/* 16-float vectors: AVX-512, built only into code for x86-64-v4
   (_attn_v4.c) or a build for AVX-512.  Loads as above, 16 values.
   fxa16_fold8: to 8 lanes, the same lane sums. */
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 12) && (FX_ATTN_CLONES || defined(__AVX512F__))
#define FXA_HAVE_W16 1
typedef float fxa_v16 __attribute__((vector_size(64)));
typedef float fxa_v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t fxa_v16i __attribute__((vector_size(64)));
#define fxa16_load(p) ((fxa_v16)*(const fxa_v16u *)(const void *)(p))
#define fxa16_store(p, v) ((void)(*(fxa_v16u *)(void *)(p) = (v)))
#define fxa16_splat(x) __extension__({                                                           \
    const float x16_ = (x);                                                                       \
    (fxa_v16){x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_, x16_}; })
#define fxa16_fold8(v) FX_FOLD(fxa_v16, fxa_v8, v)
#define fxa16_exp2(y) FXA_EXP2(fxa_v16, fxa_v16i, y)
#define FX_JOIN16(lo, hi) __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define fxa16_load_f32(p) fxa16_load(p)
/* The widening loads below are single AVX-512 instructions (vpmovsxbd,
   vpmovzxbd, vpmovzxwd, vcvtph2ps on 16 lanes): gcc 12 turns the same
   conversions written as vector casts into 8-lane steps joined by inserts,
   so gcc gets the builtins; clang makes one instruction of each cast. */
typedef char fxa_v16c __attribute__((vector_size(16)));
typedef char fxa_v16cu __attribute__((vector_size(16), aligned(1), may_alias));
typedef short fxa_v16hs __attribute__((vector_size(32)));
typedef short fxa_v16hsu __attribute__((vector_size(32), aligned(1), may_alias));
#if defined(__clang__)
typedef signed char fxa_v16sc __attribute__((vector_size(16)));
typedef unsigned char fxa_v16uc __attribute__((vector_size(16)));
typedef unsigned short fxa_v16uh __attribute__((vector_size(32)));
#define fxa16_sx8(b) __builtin_convertvector((fxa_v16sc)(b), fxa_v16i)
#define fxa16_zx8(b) __builtin_convertvector((fxa_v16uc)(b), fxa_v16i)
#define fxa16_zx16(h) __builtin_convertvector((fxa_v16uh)(h), fxa_v16i)
#define fxa16_load_f16c(p) FX_JOIN16(fxa_load_f16c(p), fxa_load_f16c((p) + 16))
#else
#define fxa16_sx8(b) ((fxa_v16i)__builtin_ia32_pmovsxbd512_mask((b), (fxa_v16i){0}, (unsigned short)0xffff))
#define fxa16_zx8(b) ((fxa_v16i)__builtin_ia32_pmovzxbd512_mask((b), (fxa_v16i){0}, (unsigned short)0xffff))
#define fxa16_zx16(h) ((fxa_v16i)__builtin_ia32_pmovzxwd512_mask((h), (fxa_v16i){0}, (unsigned short)0xffff))
#define fxa16_load_f16c(p) \
    ((fxa_v16)__builtin_ia32_vcvtph2ps512_mask(*(const fxa_v16hsu *)(const void *)(p), fxa16_splat(0.0f), \
                                               (unsigned short)0xffff, 4))
#endif
#define fxa16_load_bf16(p) ((fxa_v16)(fxa16_zx16(*(const fxa_v16hsu *)(const void *)(p)) << 16))
#define fxa16_load_i8(p, sc) \
    (__builtin_convertvector(fxa16_sx8(*(const fxa_v16cu *)(const void *)(p)), fxa_v16) * fxa16_splat(sc))
typedef uint8_t fxa_v16ub __attribute__((vector_size(16)));
typedef uint8_t fxa_v16ubu __attribute__((vector_size(16), aligned(1), may_alias));
/* int4: the 16 values at value offset e (a multiple of 16), as fxa_load_i4 */
#define fxa16_load_i4(row, e, sc) __extension__({                                                       \
    const size_t e16_ = (e);                                                                           \
    const fxa_v16ub b16_ = *(const fxa_v16ubu *)(const void *)((row) + (e16_ >> 5) * 16);              \
    const fxa_v16ub n16_ = (e16_ & 16) ? (fxa_v16ub)(b16_ >> 4) : (fxa_v16ub)(b16_ & 15);               \
    __builtin_convertvector(fxa16_zx8((fxa_v16c)n16_) - 8, fxa_v16) * fxa16_splat(sc); })
#define fxa16_load_f16(p) FX_JOIN16(fxa_load_f16(p), fxa_load_f16((p) + 16))
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
FX_INLINE void fxa_transpose8(fxa_v8 *r)
{
    int i, j;
    for (i = 0; i < 8; i++)
        for (j = i + 1; j < 8; j++) {
            const float x = r[i].x[j];
            r[i].x[j] = r[j].x[i];
            r[j].x[i] = x;
        }
}
static float fxa_exp2f(float y);
FX_INLINE fxa_v8 fxa_exp2(fxa_v8 y) { int i; for (i = 0; i < 8; i++) y.x[i] = fxa_exp2f(y.x[i]); return y; }
#define fxa_load_f32(p) fxa_load(p)
FX_INLINE fxa_v8 fxa_load_bf16(const char *p) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = fx_bf16_to_f32(fx_ld16(p + 2 * i)); return v; }
FX_INLINE fxa_v8 fxa_load_f16(const char *p) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = fx_f16_to_f32(fx_ld16(p + 2 * i)); return v; }
FX_INLINE fxa_v8 fxa_load_i8(const char *p, float sc) { fxa_v8 v; int i; for (i = 0; i < 8; i++) v.x[i] = (float)((const int8_t *)p)[i] * sc; return v; }
FX_INLINE fxa_v8 fxa_load_i4(const char *row, size_t e, float sc)
{
    const unsigned char *b = (const unsigned char *)row + (e >> 5) * 16 + (e & 15);
    fxa_v8 v;
    int i;
    for (i = 0; i < 8; i++) v.x[i] = (float)((int)((e & 16) ? b[i] >> 4 : b[i] & 15) - 8) * sc;
    return v;
}
#define FXA_HAVE_F16C 0
#define fxa_load_f16c(p) fxa_load_f16(p)
#define FXA_HAVE_W16 0
#endif

/* The loads of the kernel: 8 values (FXA_LD), 16 (FXA_LD16) or one (fxa_ld1) at value
   offset e of a row; sc: the int8 / int4 group's scale.  dt is a constant in every
   instantiation, so each load compiles to its dtype's instructions alone.
   FXA_F16C: float16 read by F16C (only in code built for x86-64-v3). */
#define FXA_F16C FX_F16C
#define FXA_LD(dt, row, e, sc)                                                                   \
    ((dt) == FX_F32 ? fxa_load_f32((const float *)(const void *)(row) + (e))                         \
     : (dt) == FX_BF16 ? fxa_load_bf16((row) + 2 * (size_t)(e))                                  \
     : (dt) == FX_I8 ? fxa_load_i8((row) + (e), (sc))                                            \
     : FX_IS_I4(dt) ? fxa_load_i4((row), (size_t)(e), (sc))                                      \
     : (dt) == FXA_F16C ? fxa_load_f16c((row) + 2 * (size_t)(e)) : fxa_load_f16((row) + 2 * (size_t)(e)))
#define FXA_LD16(dt, row, e, sc)                                                                 \
    ((dt) == FX_F32 ? fxa16_load_f32((const float *)(const void *)(row) + (e))                       \
     : (dt) == FX_BF16 ? fxa16_load_bf16((row) + 2 * (size_t)(e))                                \
     : (dt) == FX_I8 ? fxa16_load_i8((row) + (e), (sc))                                          \
     : FX_IS_I4(dt) ? fxa16_load_i4((row), (size_t)(e), (sc))                                    \
     : (dt) == FXA_F16C ? fxa16_load_f16c((row) + 2 * (size_t)(e)) : fxa16_load_f16((row) + 2 * (size_t)(e)))
FX_INLINE float fxa_ld1(const int dt, const char *row, size_t e, float sc)
{
    float x;
    switch (dt) {
    case FX_F32: memcpy(&x, row + 4 * e, 4); return x;
    case FX_BF16: return fx_bf16_to_f32(fx_ld16(row + 2 * e));
    case FX_I8: return (float)((const int8_t *)row)[e] * sc;
    case FX_I4: case FX_I4H: {
        const unsigned char b = ((const unsigned char *)row)[(e >> 5) * 16 + (e & 15)];
        return (float)((int)((e & 16) ? b >> 4 : b & 15) - 8) * sc;
    }
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

#endif /* FX_SIMD_H */
