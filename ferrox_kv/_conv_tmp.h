/* TEMPORARY scalar conversions to the storage contract, until the
 * precision-kernel branch's _fx.h/_conv.h lands (then this file goes). */
#ifndef FERROX_KV_CONV_TMP_H
#define FERROX_KV_CONV_TMP_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>

#ifndef FX_F32
enum { FX_F32 = 0, FX_F16 = 1, FX_BF16 = 2, FX_I8 = 3 };
#endif

static inline uint32_t fxt_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float fxt_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t fxt_f32_to_f16(float f) {
    uint32_t x = fxt_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u)                         /* inf, NaN (quiet) */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* rounds to >= 65520 */
    if (ax < 0x38800000u) {                        /* subnormal half or zero */
        uint32_t m, shift, q, rem, half;
        if (ax < 0x33000000u) return (uint16_t)sign;   /* < 2^-25: zero */
        m = (ax & 0x7fffffu) | 0x800000u;
        shift = 126 - (ax >> 23);
        q = m >> shift;
        rem = m & ((1u << shift) - 1);
        half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    {
        uint32_t r = ax - 0x38000000u;             /* rebias exponent 127 -> 15 */
        uint32_t q = r >> 13, rem = r & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
}

static inline float fxt_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return fxt_float(sign | 0x7f800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);   /* m * 2^-24 */
        return sign ? -v : v;
    }
    return fxt_float(sign | ((e + 112) << 23) | (m << 13));
}

static inline uint16_t fxt_f32_to_bf16(float f) {
    uint32_t x = fxt_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static inline float fxt_bf16_to_f32(uint16_t b) { return fxt_float((uint32_t)b << 16); }

static inline float fxt_half_to_f32(uint16_t h, int src_dtype) {
    return src_dtype == FX_BF16 ? fxt_bf16_to_f32(h) : fxt_f16_to_f32(h);
}

/* one int8 row from n_heads*head_dim floats */
static inline void fxt_q8_row(unsigned char *dst, const float *x, int n_heads, int head_dim) {
    int g, j, i, ng = (head_dim + 31) / 32;
    int8_t *q = (int8_t *)dst;
    unsigned char *sc = dst + (size_t)n_heads * head_dim;
    for (g = 0; g < n_heads; g++)
        for (j = 0; j < ng; j++) {
            int lo = g * head_dim + j * 32, hi = lo + 32;
            float amax = 0, s;
            int nan = 0;
            uint16_t hs;
            if (hi > (g + 1) * head_dim) hi = (g + 1) * head_dim;
            for (i = lo; i < hi; i++) {
                float a = fabsf(x[i]);
                if (a != a) nan = 1;
                else if (a > amax) amax = a;
            }
            if (nan) hs = 0x7e00u;
            else {
                hs = fxt_f32_to_f16(amax / 127.0f);
                if (amax != 0 && !isinf(amax) && amax / fxt_f16_to_f32(hs) > 127.0f) hs++;
            }
            memcpy(sc + 2 * ((size_t)g * ng + j), &hs, 2);
            s = fxt_f16_to_f32(hs);
            for (i = lo; i < hi; i++) {
                float v = (s != 0 && s == s) ? rintf(x[i] / s) : 0;
                if (!(v == v)) v = 0;
                if (v > 127) v = 127;
                if (v < -127) v = -127;
                q[i] = (int8_t)v;
            }
        }
}

static inline void fxt_store_row(void *dst, const float *x, int n_heads, int head_dim, int dtype) {
    size_t i, w = (size_t)n_heads * head_dim;
    if (dtype == FX_F32) { memcpy(dst, x, w * 4); return; }
    if (dtype == FX_I8) { fxt_q8_row((unsigned char *)dst, x, n_heads, head_dim); return; }
    for (i = 0; i < w; i++) {
        uint16_t h = dtype == FX_BF16 ? fxt_f32_to_bf16(x[i]) : fxt_f32_to_f16(x[i]);
        memcpy((char *)dst + 2 * i, &h, 2);
    }
}

static inline void fxt_load_row(float *out, const void *src, int n_heads, int head_dim, int dtype) {
    size_t i, w = (size_t)n_heads * head_dim;
    const unsigned char *s = (const unsigned char *)src;
    if (dtype == FX_F32) { memcpy(out, src, w * 4); return; }
    if (dtype == FX_I8) {
        int ng = (head_dim + 31) / 32;
        for (i = 0; i < w; i++) {
            size_t g = i / head_dim, j = (i % head_dim) / 32;
            uint16_t hs;
            memcpy(&hs, s + w + 2 * (g * ng + j), 2);
            out[i] = (float)(int8_t)s[i] * fxt_f16_to_f32(hs);
        }
        return;
    }
    for (i = 0; i < w; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        out[i] = fxt_half_to_f32(h, dtype);
    }
}

static void fx_rows_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row_floats,
                             ptrdiff_t n_rows, int n_heads, int head_dim, int dtype) {
    ptrdiff_t r;
    for (r = 0; r < n_rows; r++)
        fxt_store_row((char *)dst + (size_t)r * dst_row, src + (size_t)r * src_row_floats,
                      n_heads, head_dim, dtype);
}

static void fx_rows_to_f32(float *dst, size_t dst_row_floats, const void *src, size_t src_row,
                           ptrdiff_t n_rows, int n_heads, int head_dim, int dtype) {
    ptrdiff_t r;
    for (r = 0; r < n_rows; r++)
        fxt_load_row(dst + (size_t)r * dst_row_floats, (const char *)src + (size_t)r * src_row,
                     n_heads, head_dim, dtype);
}

static void fx_rows_from_half(void *dst, size_t dst_row, const uint16_t *src, size_t src_row_elems,
                              ptrdiff_t n_rows, int n_heads, int head_dim, int src_dtype, int dtype) {
    ptrdiff_t r;
    size_t i, w = (size_t)n_heads * head_dim;
    float *tmp = (float *)malloc(w * 4 + 4);
    if (tmp == NULL) return;
    for (r = 0; r < n_rows; r++) {
        const uint16_t *s = src + (size_t)r * src_row_elems;
        char *d = (char *)dst + (size_t)r * dst_row;
        if (src_dtype == dtype) { memcpy(d, s, w * 2); continue; }
        for (i = 0; i < w; i++) tmp[i] = fxt_half_to_f32(s[i], src_dtype);
        fxt_store_row(d, tmp, n_heads, head_dim, dtype);
    }
    free(tmp);
}

#endif
