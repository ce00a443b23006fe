/* _conv.h -- the storage dtypes of K/V rows and the loops that convert rows
 * between them.  Header-only, every symbol static; included by _fx.h and
 * _attn.h.
 *
 * A row holds n_heads * head_dim values, kv head g at value offset
 * g*head_dim:
 *   FX_F32   4 bytes per value
 *   FX_F16   IEEE binary16, round to nearest even (as numpy's astype)
 *   FX_BF16  the top 16 bits of the float32, round to nearest even; a NaN
 *            stays NaN (quiet bit set)
 *   FX_I8    the int8 values, then n_heads * ceil(head_dim/32) float16
 *            scales (unaligned).  Group j of head g is dims 32j .. 32j+31 of
 *            the head (the last one may be shorter); its scale s is
 *            amax|x|/127 as float16, taken one float16 step up when the
 *            stored s would put |x|/s above 127, capped at 65504; q =
 *            clamp(rint(x/s), -127, 127); value = q * (float)s.  An all-zero
 *            group: s = 0, q = 0.  A NaN in the group: s = NaN; an inf: s =
 *            inf (so the group reads back as NaN), q = 0.
 * Rows are packed (row stride = fx_row_bytes) and read and written with
 * unaligned accesses.  Same-dtype copies are memcpy of row bytes.
 */
#ifndef FX_CONV_H
#define FX_CONV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { FX_F32 = 0, FX_F16 = 1, FX_BF16 = 2, FX_I8 = 3 };

#define FX_I8_GROUP 32

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

#if defined(__GNUC__) || defined(__clang__)
#define FX_CONV_UNUSED __attribute__((unused))
#else
#define FX_CONV_UNUSED
#endif

/* float16 scale groups per head, and bytes per stored row. */
static inline FX_CONV_UNUSED size_t fx_i8_groups(int head_dim) { return ((size_t)head_dim + FX_I8_GROUP - 1) / FX_I8_GROUP; }
static inline FX_CONV_UNUSED size_t fx_row_bytes(int n_heads, int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    switch (dtype) {
    case FX_F32: return 4 * n;
    case FX_F16: case FX_BF16: return 2 * n;
    case FX_I8: return n + 2 * (size_t)n_heads * fx_i8_groups(head_dim);
    default: return 0;
    }
}

static inline uint32_t fx_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float fx_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t fx_ld16(const void *p) { uint16_t h; memcpy(&h, p, 2); return h; }
static inline void fx_st16(void *p, uint16_t h) { memcpy(p, &h, 2); }

/* float16 -> float32, exact.  Subnormals are made by an int->float
   conversion, so a flush-to-zero mode (DAZ) cannot lose them. */
static inline float fx_f16_to_f32(uint16_t h)
{
    const uint32_t s = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    const uint32_t v = em << 13;
    const uint32_t m = em < 0x400u ? fx_f2u((float)em * 0x1p-24f)
                       : em >= 0x7c00u ? (v | 0x7f800000u) : v + 0x38000000u;
    return fx_u2f(m | s);
}

/* float32 -> float16, round to nearest even; beyond 65520 -> inf; NaN ->
   quiet NaN keeping the payload's top bits (what F16C's vcvtps2ph does). */
static inline uint16_t fx_f32_to_f16(float f)
{
    const uint32_t x = fx_f2u(f), s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    uint32_t r;
    if (a > 0x7f800000u) r = 0x7e00u | ((a >> 13) & 0x3ffu);
    else if (a >= 0x477ff000u) r = 0x7c00u;
    else if (a >= 0x38800000u) r = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    else r = fx_f2u(fx_u2f(a) + 0.5f) - 0x3f000000u; /* subnormal: the FP add rounds to even */
    return (uint16_t)(r | s);
}

static inline float fx_bf16_to_f32(uint16_t h) { return fx_u2f((uint32_t)h << 16); }

/* float32 -> bfloat16, round to nearest even; NaN -> quiet NaN. */
static inline uint16_t fx_f32_to_bf16(float f)
{
    const uint32_t x = fx_f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Round to nearest even for |v| < 2^22 (the adds round in the default mode). */
static inline float fx_rint_small(float v)
{
    const float big = 12582912.0f; /* 1.5 * 2^23 */
    return v >= 0 ? (v + big) - big : (v - big) + big;
}

/* One int8 group of n <= 32 values: q[0..n), its scale in *scale. */
static inline void fx_q8_group(const float *x, int n, int8_t *q, uint16_t *scale)
{
    float amax = 0.0f, sf;
    int i, bad = 0;
    uint16_t h;
    for (i = 0; i < n; i++) {
        const float a = x[i] < 0 ? -x[i] : x[i];
        bad |= !(a <= 3.4028234663852886e38f); /* NaN or inf */
        amax = a > amax ? a : amax;
    }
    if (bad || amax == 0.0f) {
        for (i = 0; i < n; i++) {
            const float a = x[i] < 0 ? -x[i] : x[i];
            if (a != a) amax = a;
        }
        for (i = 0; i < n; i++) q[i] = 0;
        *scale = amax != amax ? 0x7e00u : bad ? 0x7c00u : 0;
        return;
    }
    h = fx_f32_to_f16(amax / 127.0f);
    if (h >= 0x7c00u) h = 0x7bffu;
    sf = fx_f16_to_f32(h);
    if (h < 0x7bffu && !(amax / sf <= 127.0f)) sf = fx_f16_to_f32(++h);
    for (i = 0; i < n; i++) {
        float v = fx_rint_small(x[i] / sf);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
    *scale = h;
}

/* One stored row of each dtype from / to float32 (n_heads * head_dim values). */
static inline void fx_row_from_f32(char *dst, const float *src, int n_heads, int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    size_t i;
    switch (dtype) {
    case FX_F32: memcpy(dst, src, 4 * n); break;
    case FX_F16: for (i = 0; i < n; i++) fx_st16(dst + 2 * i, fx_f32_to_f16(src[i])); break;
    case FX_BF16: for (i = 0; i < n; i++) fx_st16(dst + 2 * i, fx_f32_to_bf16(src[i])); break;
    case FX_I8: {
        const size_t ng = fx_i8_groups(head_dim);
        int g, j;
        for (g = 0; g < n_heads; g++)
            for (j = 0; j < (int)ng; j++) {
                const int d0 = j * FX_I8_GROUP, len = head_dim - d0 < FX_I8_GROUP ? head_dim - d0 : FX_I8_GROUP;
                uint16_t s;
                fx_q8_group(src + (size_t)g * head_dim + d0, len, (int8_t *)dst + (size_t)g * head_dim + d0, &s);
                fx_st16(dst + n + 2 * ((size_t)g * ng + (size_t)j), s);
            }
        break;
    }
    }
}

static inline void fx_row_to_f32(float *dst, const char *src, int n_heads, int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    size_t i;
    switch (dtype) {
    case FX_F32: memcpy(dst, src, 4 * n); break;
    case FX_F16: for (i = 0; i < n; i++) dst[i] = fx_f16_to_f32(fx_ld16(src + 2 * i)); break;
    case FX_BF16: for (i = 0; i < n; i++) dst[i] = fx_bf16_to_f32(fx_ld16(src + 2 * i)); break;
    case FX_I8: {
        const size_t ng = fx_i8_groups(head_dim);
        int g, d;
        for (g = 0; g < n_heads; g++)
            for (d = 0; d < head_dim; d++) {
                const float s = fx_f16_to_f32(fx_ld16(src + n + 2 * ((size_t)g * ng + (size_t)(d / FX_I8_GROUP))));
                dst[(size_t)g * head_dim + d] = (float)((const int8_t *)src)[(size_t)g * head_dim + d] * s;
            }
        break;
    }
    }
}

/* n_rows float32 rows (src_row_floats apart) -> stored rows of dtype
   (dst_row bytes apart). */
FX_CLONES static FX_CONV_UNUSED void fx_rows_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row_floats,
                                                      ptrdiff_t n_rows, int n_heads, int head_dim, int dtype)
{
    ptrdiff_t r;
    switch (dtype) {
#define FX_ROWS_FROM(DT)                                                                                         \
    for (r = 0; r < n_rows; r++)                                                                                 \
        fx_row_from_f32((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_floats, n_heads, head_dim, DT); \
    break;
    case FX_F32: FX_ROWS_FROM(FX_F32)
    case FX_F16: FX_ROWS_FROM(FX_F16)
    case FX_BF16: FX_ROWS_FROM(FX_BF16)
    case FX_I8: FX_ROWS_FROM(FX_I8)
#undef FX_ROWS_FROM
    }
}

/* n_rows stored rows of dtype (src_row bytes apart) -> float32 rows
   (dst_row_floats apart). */
FX_CLONES static FX_CONV_UNUSED void fx_rows_to_f32(float *dst, size_t dst_row_floats, const void *src, size_t src_row,
                                                    ptrdiff_t n_rows, int n_heads, int head_dim, int dtype)
{
    ptrdiff_t r;
    switch (dtype) {
#define FX_ROWS_TO(DT)                                                                                          \
    for (r = 0; r < n_rows; r++)                                                                                \
        fx_row_to_f32(dst + (size_t)r * dst_row_floats, (const char *)src + (size_t)r * src_row, n_heads, head_dim, DT); \
    break;
    case FX_F32: FX_ROWS_TO(FX_F32)
    case FX_F16: FX_ROWS_TO(FX_F16)
    case FX_BF16: FX_ROWS_TO(FX_BF16)
    case FX_I8: FX_ROWS_TO(FX_I8)
#undef FX_ROWS_TO
    }
}

/* One row of float16 (src_dtype FX_F16) or bfloat16 (FX_BF16) values ->
   a stored row of dtype, through float32 (exact) in groups of 32. */
static inline void fx_row_from_half(char *dst, const uint16_t *src, int n_heads, int head_dim, int src_dtype, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    float tmp[FX_I8_GROUP];
    size_t i;
    if (src_dtype == dtype) {
        memcpy(dst, src, 2 * n);
        return;
    }
    if (dtype == FX_I8) {
        const size_t ng = fx_i8_groups(head_dim);
        int g, j, d;
        for (g = 0; g < n_heads; g++)
            for (j = 0; j < (int)ng; j++) {
                const int d0 = j * FX_I8_GROUP, len = head_dim - d0 < FX_I8_GROUP ? head_dim - d0 : FX_I8_GROUP;
                const uint16_t *s = src + (size_t)g * head_dim + d0;
                uint16_t sc;
                for (d = 0; d < len; d++) tmp[d] = src_dtype == FX_F16 ? fx_f16_to_f32(s[d]) : fx_bf16_to_f32(s[d]);
                fx_q8_group(tmp, len, (int8_t *)dst + (size_t)g * head_dim + d0, &sc);
                fx_st16(dst + n + 2 * ((size_t)g * ng + (size_t)j), sc);
            }
        return;
    }
    for (i = 0; i < n; i++) {
        const float x = src_dtype == FX_F16 ? fx_f16_to_f32(src[i]) : fx_bf16_to_f32(src[i]);
        if (dtype == FX_F32) memcpy(dst + 4 * i, &x, 4);
        else fx_st16(dst + 2 * i, dtype == FX_F16 ? fx_f32_to_f16(x) : fx_f32_to_bf16(x));
    }
}

/* n_rows float16 / bfloat16 rows (src_row_elems apart) -> stored rows of
   dtype (dst_row bytes apart); a straight copy when the dtypes agree. */
FX_CLONES static FX_CONV_UNUSED void fx_rows_from_half(void *dst, size_t dst_row, const uint16_t *src, size_t src_row_elems,
                                                       ptrdiff_t n_rows, int n_heads, int head_dim, int src_dtype,
                                                       int dtype)
{
    ptrdiff_t r;
#define FX_ROWS_HALF(S, D)                                                                                  \
    for (r = 0; r < n_rows; r++)                                                                            \
        fx_row_from_half((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_elems, n_heads, head_dim, S, D); \
    return;
    if (src_dtype == FX_F16) {
        switch (dtype) {
        case FX_F32: FX_ROWS_HALF(FX_F16, FX_F32)
        case FX_F16: FX_ROWS_HALF(FX_F16, FX_F16)
        case FX_BF16: FX_ROWS_HALF(FX_F16, FX_BF16)
        case FX_I8: FX_ROWS_HALF(FX_F16, FX_I8)
        }
    } else if (src_dtype == FX_BF16) {
        switch (dtype) {
        case FX_F32: FX_ROWS_HALF(FX_BF16, FX_F32)
        case FX_F16: FX_ROWS_HALF(FX_BF16, FX_F16)
        case FX_BF16: FX_ROWS_HALF(FX_BF16, FX_BF16)
        case FX_I8: FX_ROWS_HALF(FX_BF16, FX_I8)
        }
    }
#undef FX_ROWS_HALF
}

#endif /* FX_CONV_H */
