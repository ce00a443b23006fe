/* _conv.h -- the storage dtypes of K/V rows, one row's conversions
 * (inline), and the row loops of _conv.c that convert many rows.  Pure C:
 * the ISA layer (_simd.h) builds on it, not the other way round.
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
 *   FX_I4    int4 (head_dim a multiple of 32): each group of 32 dims of a
 *            head is 16 bytes, byte i holding dim i in its low nibble and
 *            dim i+16 in its high one, as q + 8 (q in -7 .. 7; the q4_0
 *            layout), then n_heads * head_dim/32 float16 scales (unaligned):
 *            4.5 bits per value.  Scale and rounding as FX_I8 with 7 for
 *            127 (fx_q_group); an all-zero, NaN or inf group stores nibble
 *            8 (q = 0).
 *   FX_I4H   FX_I4 of the head's values rotated first: each head's
 *            head_dim values are multiplied by the orthonormal block-
 *            diagonal Hadamard matrix of fx_hadamard_block(head_dim)-sized
 *            blocks (fx_fwht), and reading a row (fx_row_to_f32) rotates
 *            back (the matrix is its own inverse).  The same bytes per row;
 *            the attention kernel rotates each query alike and its output
 *            back.
 * Rows are packed (row stride = fx_row_bytes) and read and written with
 * unaligned accesses.  Same-dtype copies are memcpy of row bytes.
 *
 * One loop per job: fx_row_from_f32 / fx_row_to_f32 / fx_row_from_half are
 * always_inline and instantiated with the dtype a constant by the row loops
 * of _conv.c, which alone carry the target_clones dispatch.  float16 stores
 * from float32 go through F16C's vcvtps2ph where the CPU runs the v3 clone
 * (its rounding is fx_f32_to_f16's, bit for bit); the int8 group loops are
 * branch-free so that every clone vectorises them.
 */
#ifndef FX_CONV_H
#define FX_CONV_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

enum { FX_F32 = 0, FX_F16 = 1, FX_BF16 = 2, FX_I8 = 3, FX_I4 = 4, FX_I4H = 5 };

#define FX_I8_GROUP 32
/* The largest Hadamard block of FX_I4H rows (a power of two). */
#define FX_HAD_MAX 512

/* The dtypes stored as integers with float16 group scales; the int4 ones. */
#define FX_QUANT(dt) ((dt) == FX_I8 || (dt) == FX_I4 || (dt) == FX_I4H)
#define FX_IS_I4(dt) ((dt) == FX_I4 || (dt) == FX_I4H)

/* Compiler plumbing shared by every ferrox_kv C file. */
#if defined(__GNUC__) || defined(__clang__)
#define FX_INLINE static inline __attribute__((always_inline))
#define FX_UNUSED __attribute__((unused))
#define FX_API __attribute__((visibility("hidden"))) /* across this extension's objects only */
#elif defined(_MSC_VER)
#define FX_INLINE static __forceinline
#define FX_UNUSED
#define FX_API
#else
#define FX_INLINE static inline
#define FX_UNUSED
#define FX_API
#endif

/* The float16 dtype read through F16C by the attention kernel; never stored. */
#define FX_F16C 6

/* float16 scale groups per head, and bytes per stored row. */
static inline FX_UNUSED size_t fx_i8_groups(int head_dim) { return ((size_t)head_dim + FX_I8_GROUP - 1) / FX_I8_GROUP; }
static inline FX_UNUSED size_t fx_row_bytes(int n_heads, int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    switch (dtype) {
    case FX_F32: return 4 * n;
    case FX_F16: case FX_BF16: return 2 * n;
    case FX_I8: return n + 2 * (size_t)n_heads * fx_i8_groups(head_dim);
    case FX_I4: case FX_I4H: return n / 2 + 2 * (size_t)n_heads * fx_i8_groups(head_dim);
    default: return 0;
    }
}

/* Bytes of n_values stored values (a quantised row's values come before
   its scales); FX_F16C as FX_F16. */
static inline FX_UNUSED size_t fx_value_bytes(size_t n_values, int dtype)
{
    switch (dtype) {
    case FX_F32: return 4 * n_values;
    case FX_F16: case FX_BF16: case FX_F16C: return 2 * n_values;
    case FX_I4: case FX_I4H: return n_values / 2;
    default: return n_values;
    }
}

/* The Hadamard block of an FX_I4H head of head_dim values (a multiple of
   32): the largest power of two that divides head_dim, at most FX_HAD_MAX
   (head_dim 128: one block of 128; 96: three of 32; 1024: two of 512). */
static inline FX_UNUSED int fx_hadamard_block(int head_dim)
{
    int b = head_dim & -head_dim;
    return b > FX_HAD_MAX ? FX_HAD_MAX : b;
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

/* One group of n <= 32 values quantised to qmax (127: int8, 7: int4):
   q[0..n), its scale in *scale.  The
   loops run over a zero-padded group of 32 with no branch, so that the
   compiler vectorises them in every clone: amax is the largest |x| bit
   pattern (for |x| the integer order is the float order, and a NaN or an
   inf is >= 0x7f800000); rounding to nearest even adds and subtracts
   1.5 * 2^23 with x's sign (|x / s| <= qmax < 2^22). */
FX_INLINE void fx_q_group(const float *x, int n, const float qmax, int8_t *q, uint16_t *scale)
{
    float t[FX_I8_GROUP], sf;
    int8_t qt[FX_I8_GROUP];
    uint32_t amax = 0;
    uint16_t h;
    int i;
    memset(t, 0, sizeof t);
    memcpy(t, x, (size_t)n * sizeof(float));
    for (i = 0; i < FX_I8_GROUP; i++) {
        const uint32_t a = fx_f2u(t[i]) & 0x7fffffffu;
        amax = a > amax ? a : amax;
    }
    if (amax == 0 || amax >= 0x7f800000u) {
        memset(q, 0, (size_t)n);
        *scale = amax > 0x7f800000u ? 0x7e00u : amax ? 0x7c00u : 0;
        return;
    }
    h = fx_f32_to_f16(fx_u2f(amax) / qmax);
    if (h >= 0x7c00u) h = 0x7bffu;
    sf = fx_f16_to_f32(h);
    if (h < 0x7bffu && !(fx_u2f(amax) / sf <= qmax)) sf = fx_f16_to_f32(++h);
    for (i = 0; i < FX_I8_GROUP; i++) {
        const float v = t[i] / sf, big = fx_u2f(0x4b400000u | (fx_f2u(v) & 0x80000000u));
        float r = (v + big) - big;
        r = r > qmax ? qmax : r;
        r = r < -qmax ? -qmax : r;
        qt[i] = (int8_t)(int32_t)r;
    }
    memcpy(q, qt, (size_t)n);
    *scale = h;
}

/* In place, x (n values, n a multiple of b) times the orthonormal block-
   diagonal Hadamard matrix of b x b blocks (b a power of two): a fast
   Walsh-Hadamard transform per block, n log2(b) additions, then the
   factor 1/sqrt(b) (exact for even log2 b).  Its own inverse. */
FX_INLINE void fx_fwht(float *x, int n, int b)
{
    float f = 1.0f;
    int i, j, h, k = 0, o;
    for (h = 1; h < b; h <<= 1) k++;
    for (i = 0; i < k / 2; i++) f *= 0.5f;
    if (k & 1) f *= 0.70710678118654752f;
    for (o = 0; o < n; o += b)
        for (h = 1; h < b; h <<= 1)
            for (i = o; i < o + b; i += 2 * h)
                for (j = i; j < i + h; j++) {
                    const float u = x[j], w = x[j + h];
                    x[j] = u + w;
                    x[j + h] = u - w;
                }
    for (i = 0; i < n; i++) x[i] *= f;
}

/* One block of b <= FX_HAD_MAX values of an int4 head (t, clobbered; b a
   multiple of 32) at value offset e of a row whose scales start at byte
   sbase: rotated when rot, then quantised group by group. */
FX_INLINE void fx_q4_block(char *row, size_t sbase, size_t e, float *t, int b, int rot)
{
    int8_t q[FX_I8_GROUP];
    int j, i;
    if (rot) fx_fwht(t, b, b);
    for (j = 0; j < b; j += FX_I8_GROUP) {
        const size_t g = (e + (size_t)j) / FX_I8_GROUP;
        unsigned char *dst = (unsigned char *)row + 16 * g;
        uint16_t s;
        fx_q_group(t + j, FX_I8_GROUP, 7.0f, q, &s);
        for (i = 0; i < 16; i++) dst[i] = (unsigned char)((q[i] + 8) | ((q[i + 16] + 8) << 4));
        fx_st16(row + sbase + 2 * g, s);
    }
}

/* An int4 row (n_heads heads of head_dim values, from float32 values, or
   from float16 / bfloat16 ones when half is not NULL: src_dtype says which). */
FX_INLINE void fx_row_i4_from(char *dst, const float *src, const uint16_t *half, int src_dtype, int n_heads,
                            int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    const int b = dtype == FX_I4H ? fx_hadamard_block(head_dim) : FX_HAD_MAX < head_dim ? FX_HAD_MAX : head_dim;
    float t[FX_HAD_MAX];
    size_t e;
    int d, len;
    for (e = 0; e < n; e += (size_t)len) {
        const int left = head_dim - (int)(e % (size_t)head_dim);
        len = b < left ? b : left;
        if (half) for (d = 0; d < len; d++) t[d] = src_dtype == FX_F16 ? fx_f16_to_f32(half[e + d]) : fx_bf16_to_f32(half[e + d]);
        else memcpy(t, src + e, (size_t)len * sizeof(float));
        fx_q4_block(dst, n / 2, e, t, len, dtype == FX_I4H);
    }
}

/* An int4 row to float32 (rotated back for FX_I4H). */
FX_INLINE void fx_row_i4_to_f32(float *dst, const char *src, int n_heads, int head_dim, int dtype)
{
    const size_t n = (size_t)n_heads * (size_t)head_dim;
    const unsigned char *u = (const unsigned char *)src;
    size_t g;
    int i, h;
    for (g = 0; g < n / FX_I8_GROUP; g++) {
        const float s = fx_f16_to_f32(fx_ld16(src + n / 2 + 2 * g));
        for (i = 0; i < 16; i++) {
            dst[FX_I8_GROUP * g + (size_t)i] = (float)((int)(u[16 * g + (size_t)i] & 15) - 8) * s;
            dst[FX_I8_GROUP * g + 16 + (size_t)i] = (float)((int)(u[16 * g + (size_t)i] >> 4) - 8) * s;
        }
    }
    if (dtype == FX_I4H)
        for (h = 0; h < n_heads; h++) fx_fwht(dst + (size_t)h * head_dim, head_dim, fx_hadamard_block(head_dim));
}

/* One stored row of each dtype from / to float32 (n_heads * head_dim values). */
FX_INLINE void fx_row_from_f32(char *dst, const float *src, int n_heads, int head_dim, int dtype)
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
                fx_q_group(src + (size_t)g * head_dim + d0, len, 127.0f, (int8_t *)dst + (size_t)g * head_dim + d0, &s);
                fx_st16(dst + n + 2 * ((size_t)g * ng + (size_t)j), s);
            }
        break;
    }
    case FX_I4: case FX_I4H: fx_row_i4_from(dst, src, NULL, FX_F32, n_heads, head_dim, dtype); break;
    }
}

FX_INLINE void fx_row_to_f32(float *dst, const char *src, int n_heads, int head_dim, int dtype)
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
    case FX_I4: case FX_I4H: fx_row_i4_to_f32(dst, src, n_heads, head_dim, dtype); break;
    }
}

/* One row of float16 (src_dtype FX_F16) or bfloat16 (FX_BF16) values ->
   a stored row of dtype, through float32 (exact) in groups of 32. */
FX_INLINE void fx_row_from_half(char *dst, const uint16_t *src, int n_heads, int head_dim, int src_dtype, int dtype)
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
                fx_q_group(tmp, len, 127.0f, (int8_t *)dst + (size_t)g * head_dim + d0, &sc);
                fx_st16(dst + n + 2 * ((size_t)g * ng + (size_t)j), sc);
            }
        return;
    }
    if (FX_IS_I4(dtype)) {
        fx_row_i4_from(dst, NULL, src, src_dtype, n_heads, head_dim, dtype);
        return;
    }
    for (i = 0; i < n; i++) {
        const float x = src_dtype == FX_F16 ? fx_f16_to_f32(src[i]) : fx_bf16_to_f32(src[i]);
        if (dtype == FX_F32) memcpy(dst + 4 * i, &x, 4);
        else fx_st16(dst + 2 * i, dtype == FX_F16 ? fx_f32_to_f16(x) : fx_f32_to_bf16(x));
    }
}

/* The row loops (_conv.c).  n_rows float32 rows (src_row_floats apart) ->
   stored rows of dtype (dst_row bytes apart). */
FX_API void fx_rows_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row_floats, ptrdiff_t n_rows,
                             int n_heads, int head_dim, int dtype);
/* n_rows stored rows of dtype (src_row bytes apart) -> float32 rows
   (dst_row_floats apart). */
FX_API void fx_rows_to_f32(float *dst, size_t dst_row_floats, const void *src, size_t src_row, ptrdiff_t n_rows,
                           int n_heads, int head_dim, int dtype);
/* n_rows float16 / bfloat16 rows (src_row_elems apart) -> stored rows of
   dtype (dst_row bytes apart); a straight copy when the dtypes agree. */
FX_API void fx_rows_from_half(void *dst, size_t dst_row, const uint16_t *src, size_t src_row_elems, ptrdiff_t n_rows,
                              int n_heads, int head_dim, int src_dtype, int dtype);
/* The read floor of the benchmarks: every float of n rows of `width`
   floats, `stride` floats apart, read once and summed, built for the same
   SIMD levels as the row loops. */
FX_API float fx_read_rows(const float *p, ptrdiff_t n, ptrdiff_t width, ptrdiff_t stride);

#endif /* FX_CONV_H */
