/* bench_kern.c -- the wrappers bench_attn.c times, over the kernel as
 * shipped (linked from ferrox_kv/_attn*.c and _conv.c, see Makefile):
 * clones_* run fx_attend as dispatched on this CPU, base_* and v3_* cap the
 * level (fx_attend_set_max_level: the x86-64 baseline, and x86-64-v3 on
 * 8-float vectors), so one binary compares the three instantiations. */
#include <math.h>
#include "_simd.h"
#include "_attn.h"

#define DEF(K, LEVEL, WIDTH)                                                                                 \
    void K##_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);   \
    void K##_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch)    \
    {                                                                                                        \
        const int l = fx_attend_set_max_level(LEVEL), w = fx_attend_set_max_width(WIDTH);                   \
        fx_attend(kv, a, q, out, scratch);                                                                   \
        fx_attend_set_max_level(l);                                                                          \
        fx_attend_set_max_width(w);                                                                          \
    }                                                                                                        \
    const char *K##_path(void);                                                                              \
    const char *K##_path(void)                                                                               \
    {                                                                                                        \
        const int l = fx_attend_set_max_level(LEVEL), w = fx_attend_set_max_width(WIDTH);                   \
        const char *p = fx_attend_simd_path();                                                               \
        fx_attend_set_max_level(l);                                                                          \
        fx_attend_set_max_width(w);                                                                          \
        return p;                                                                                            \
    }                                                                                                        \
    size_t K##_scratch(const fx_attn_args *a);                                                               \
    size_t K##_scratch(const fx_attn_args *a) { return fx_attend_scratch_floats(a); }
DEF(clones, 4, 16)
DEF(base, 0, 8)
DEF(v3, 3, 8)

const char *clones_load_path(int dtype);
const char *clones_load_path(int dtype) { return fx_attend_load_path(dtype); }
void clones_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row, ptrdiff_t n, int h, int d, int dt);
void clones_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row, ptrdiff_t n, int h, int d, int dt)
{
    fx_rows_from_f32(dst, dst_row, src, src_row, n, h, d, dt);
}

/* Read floor: every stored K and V byte of the context read once (as
   floats: 4 bytes at a time, whatever the dtype), block by block in table
   order (contiguous: one block), summed with 4 vector accumulators.  Built with
   target_clones, as the row loops. */
FX_CLONES static float floor_sum(const fx_kv *kv, int nblocks)
{
    fxa_v8 s0 = fxa_splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
    int b;
    for (b = 0; b < nblocks; b++) {
        const float *src[2];
        size_t n[2], i;
        int w;
        src[0] = (const float *)(const void *)((const char *)kv->k + (kv->table ? (size_t)kv->table[b] * kv->k_block : 0));
        src[1] = (const float *)(const void *)((const char *)kv->v + (kv->table ? (size_t)kv->table[b] * kv->v_block : 0));
        n[0] = (kv->table ? kv->k_block : (size_t)kv->len * kv->k_row) / 4;
        n[1] = (kv->table ? kv->v_block : (size_t)kv->len * kv->v_row) / 4;
        for (w = 0; w < 2; w++)
            for (i = 0; i + 32 <= n[w]; i += 32) {
                s0 = fxa_add(s0, fxa_load(src[w] + i));
                s1 = fxa_add(s1, fxa_load(src[w] + i + 8));
                s2 = fxa_add(s2, fxa_load(src[w] + i + 16));
                s3 = fxa_add(s3, fxa_load(src[w] + i + 24));
            }
    }
    return fxa_hsum(fxa_add(fxa_add(s0, s1), fxa_add(s2, s3)));
}

float clones_floor(const fx_kv *kv, int nblocks);
float clones_floor(const fx_kv *kv, int nblocks) { return floor_sum(kv, nblocks); }

/* exp throughput: the kernel's vector 2^x (as it runs in fx_attend: inputs
   in base 2) against libm expf on the same values (scaled by ln 2). */
FX_CLONES static void exp2v_loop(const float *x, float *y, size_t n)
{
    size_t i;
    for (i = 0; i + 8 <= n; i += 8) fxa_store(y + i, fxa_exp2(fxa_load(x + i)));
}
FX_CLONES static void expf_loop(const float *x, float *y, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) y[i] = expf(x[i] * 0.693147180559945f);
}
void clones_exp2v(const float *x, float *y, size_t n);
void clones_expf(const float *x, float *y, size_t n);
void clones_exp2v(const float *x, float *y, size_t n) { exp2v_loop(x, y, n); }
void clones_expf(const float *x, float *y, size_t n) { expf_loop(x, y, n); }
