/* _conv.c -- the row loops declared in _conv.h: conversions of many rows
 * between float32 / float16 / bfloat16 input and the stored dtypes, and the
 * benchmarks' read floor.  Each loop carries FX_CLONES (an x86-64-v3 clone
 * and the baseline, picked at load time) and instantiates the inline row
 * helpers of _conv.h with the dtype a constant. */
#include "_simd.h"

#if FX_HAVE_F16C
/* One float16 row of n values from float32 through F16C (code built for
   x86-64-v3 only); the tail rounds as vcvtps2ph does. */
FX_INLINE void fx_row_f16c_from_f32(char *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) fx_st8_f16c(dst + 2 * i, src + i);
    for (; i < n; i++) fx_st16(dst + 2 * i, fx_f32_to_f16(src[i]));
}
#endif

#define FX_ROWS_FROM(DT)                                                                                         \
    for (r = 0; r < n_rows; r++)                                                                                 \
        fx_row_from_f32((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_floats, n_heads, head_dim, DT); \
    break;
#if FX_ATTN_CLONES && FX_HAVE_F16C
/* float16 stores through F16C: the one instantiation built for x86-64-v3
   outside the clones (the baseline clone must not contain vcvtps2ph). */
__attribute__((target("arch=x86-64-v3"))) static void
fx_rows_from_f32_f16c(void *dst, size_t dst_row, const float *src, size_t src_row_floats, ptrdiff_t n_rows, int n_heads,
                      int head_dim)
{
    ptrdiff_t r;
    for (r = 0; r < n_rows; r++)
        fx_row_f16c_from_f32((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_floats,
                             (size_t)n_heads * (size_t)head_dim);
}
#endif

/* n_rows float32 rows (src_row_floats apart) -> stored rows of dtype
   (dst_row bytes apart). */
FX_CLONES void fx_rows_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row_floats,
                                                      ptrdiff_t n_rows, int n_heads, int head_dim, int dtype)
{
    ptrdiff_t r;
    switch (dtype) {
    case FX_F32: FX_ROWS_FROM(FX_F32)
    case FX_F16:
#if FX_ATTN_CLONES && FX_HAVE_F16C
        if (fx_cpu_v3()) {
            fx_rows_from_f32_f16c(dst, dst_row, src, src_row_floats, n_rows, n_heads, head_dim);
            break;
        }
        FX_ROWS_FROM(FX_F16)
#elif FX_HAVE_F16C
        for (r = 0; r < n_rows; r++)
            fx_row_f16c_from_f32((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_floats,
                                 (size_t)n_heads * (size_t)head_dim);
        break;
#else
        FX_ROWS_FROM(FX_F16)
#endif
    case FX_BF16: FX_ROWS_FROM(FX_BF16)
    case FX_I8: FX_ROWS_FROM(FX_I8)
    case FX_I4: FX_ROWS_FROM(FX_I4)
    case FX_I4H: FX_ROWS_FROM(FX_I4H)
    }
}
#undef FX_ROWS_FROM

/* n_rows stored rows of dtype (src_row bytes apart) -> float32 rows
   (dst_row_floats apart). */
FX_CLONES void fx_rows_to_f32(float *dst, size_t dst_row_floats, const void *src, size_t src_row,
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
    case FX_I4: FX_ROWS_TO(FX_I4)
    case FX_I4H: FX_ROWS_TO(FX_I4H)
#undef FX_ROWS_TO
    }
}

/* n_rows float16 / bfloat16 rows (src_row_elems apart) -> stored rows of
   dtype (dst_row bytes apart); a straight copy when the dtypes agree. */
FX_CLONES void fx_rows_from_half(void *dst, size_t dst_row, const uint16_t *src, size_t src_row_elems,
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
        case FX_I4: FX_ROWS_HALF(FX_F16, FX_I4)
        case FX_I4H: FX_ROWS_HALF(FX_F16, FX_I4H)
        }
    } else if (src_dtype == FX_BF16) {
        switch (dtype) {
        case FX_F32: FX_ROWS_HALF(FX_BF16, FX_F32)
        case FX_F16: FX_ROWS_HALF(FX_BF16, FX_F16)
        case FX_BF16: FX_ROWS_HALF(FX_BF16, FX_BF16)
        case FX_I8: FX_ROWS_HALF(FX_BF16, FX_I8)
        case FX_I4: FX_ROWS_HALF(FX_BF16, FX_I4)
        case FX_I4H: FX_ROWS_HALF(FX_BF16, FX_I4H)
        }
    }
#undef FX_ROWS_HALF
}


/* The read floor of the benchmarks: every float of n rows of `width`
 * floats, `stride` floats apart, read once and summed (8 lanes, so that it
 * vectorises), compiled for the same SIMD levels as the attention kernel. */
FX_CLONES float fx_read_rows(const float *p, ptrdiff_t n, ptrdiff_t width, ptrdiff_t stride) {
    float acc[32] = {0};              /* 4 independent 8-lane sums */
    float total = 0;
    ptrdiff_t r, i, j;
    for (r = 0; r < n; r++, p += stride) {
        for (i = 0; i + 32 <= width; i += 32)
            for (j = 0; j < 32; j++) acc[j] += p[i + j];
        for (; i < width; i++) total += p[i];
    }
    for (j = 0; j < 32; j++) total += acc[j];
    return total;
}
