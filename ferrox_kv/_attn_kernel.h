/* _attn_kernel.h -- the loop nest of the attention kernel declared in
 * _attn.h, for the translation units that instantiate it: _attn_base.c,
 * _attn_v3.c and _attn_v4.c (one per x86-64 level), and _attn.c (the
 * dispatch; it uses the pass shape only).  Every symbol here is static or
 * a macro; FXA_ENTRY defines one level's entry point.
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
 *   - int8 caches attend with each query vector quantised to int8 (one
 *     scale per vector, fxa_quantise_q), on every level and path, so the
 *     result never depends on which runs; where the level has AVX2
 *     (FXA_HAVE_I8DOT) the decode's scores are integer dot products of it
 *     with the stored K, exact in int32 (fxa_qk_tile_i8; with AVX-512 VNNI,
 *     fxa_qk_tile_vnni in an instance of its own).
 *   - Rows are walked in chunks of FX_ATTN_CHUNK described by per-row
 *     pointers, so contiguous and paged caches share one path and a chunk
 *     may straddle blocks.  Query vectors sharing a kv head are processed
 *     in tiles of 4 (GQA heads of one position, or several positions):
 *     each K/V vector loaded feeds 4 queries (8 in the score tiles of a
 *     packed head on 16-float vectors, FX_TILE_TP).  Where many query vectors
 *     share a kv head (prefill) its K slice is packed transposed, so the
 *     scores of a tile come out as vectors over rows, with no horizontal
 *     sum.  See fx_attend for the loop nest.
 *   - Nothing of context size is allocated: the caller's scratch
 *     (fx_attend_scratch_floats) holds scaled queries, accumulators, m, l
 *     and one chunk of scores.  No allocation, no libc calls besides
 *     memset/memcpy: safe to call without the GIL.
 *   - SIMD through the vector helpers of _simd.h, 8 floats wide; the q.k
 *     and p.V tiles (_attn_tile.h) also come 16 wide for AVX-512.  Each
 *     (dtype, width) instantiation of the loop nest is a function of its
 *     own (FXA_ENTRY): gcc's time on one function grows faster than the
 *     function, so four bodies apart compile several times faster than
 *     four bodies in one switch.  _attn.c calls the entry of the widest
 *     level the CPU has: fxa_attend_v4 (16-float vectors, head dims that
 *     are multiples of 16), fxa_attend_v3 (AVX2+FMA, float16 by F16C),
 *     fxa_attend_base (the x86-64 baseline, or what the compiler targets
 *     in a build without dispatch).
 *   - The speed depends on floating-point contraction: GNU C's default
 *     -ffp-contract=fast turns a*b+c into FMA in the v3 clone (ISO modes,
 *     -std=c99/c11, turn it off).  Do not build with -ffast-math.
 */
#ifndef FX_ATTN_KERNEL_H
#define FX_ATTN_KERNEL_H

#include "_simd.h"
#include "_attn.h"
#ifdef FX_ATTN_LIBM_EXP
#include <math.h>
#endif

/* ---- tuning knobs (compile-time; defaults measured, see REPORT.md) ---- */
#ifndef FX_ATTN_CHUNK      /* rows per chunk: multiple of 8 in [8, 256] */
#define FX_ATTN_CHUNK 48
#endif
#ifndef FX_ATTN_QBLOCK     /* query vectors (positions x query heads) per pass */
#define FX_ATTN_QBLOCK 512
#endif
#ifndef FX_ATTN_PACK_MIN   /* pack K/V slices when more query vectors share a kv head */
#define FX_ATTN_PACK_MIN 32
#endif
#ifndef FX_ATTN_RGA        /* unpacked: rows per group in the score phase */
#define FX_ATTN_RGA 24
#endif
#ifndef FX_ATTN_RGC        /* unpacked: rows per group in the p.V phase */
#define FX_ATTN_RGC 24
#endif
#ifndef FX_ATTN_PREFETCH   /* 1: passes prefetch the next chunk's rows (fxa_pf): unpacked ones over
                              16-bit, int8, int4 rows, packed ones over rows of every dtype */
#define FX_ATTN_PREFETCH 1
#endif
#if FX_ATTN_CHUNK % 8 != 0 || FX_ATTN_CHUNK < 8 || FX_ATTN_CHUNK > 256
#error "FX_ATTN_CHUNK must be a multiple of 8 in [8, 256]"
#endif
#if FX_ATTN_RGA < 1 || FX_ATTN_RGC < 1
#error "FX_ATTN_RGA and FX_ATTN_RGC must be positive"
#endif

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
   read without leaving the cache.  FX_I8, FX_I4: ks/vs point at each row's scales
   converted to float (kv head g, group j at [g*groups + j]). */
#define FX_CP (FX_C + 12)
typedef struct {
    const char *k[FX_CP], *v[FX_CP];
    const float *ks[FX_CP], *vs[FX_CP];
} fxa_rows;

/* Floats of the per-chunk scale buffer (FX_I8, FX_I4). */
#define FXA_SCALE_FLOATS(a) \
    ((size_t)FX_C * (size_t)(a)->n_kv_heads * (fx_i8_groups((a)->head_dim) + fx_i8_groups((a)->v_head_dim)))

/* k[i], v[i] = the K and V rows of position p0 + i, for i < n. */
FX_INLINE void fxa_row_addrs(const fx_kv *kv, ptrdiff_t p0, int n, const char **k, const char **v)
{
    const char *kb = (const char *)kv->k, *vb = (const char *)kv->v;
    int i;
    if (!kv->table) {
        for (i = 0; i < n; i++) {
            k[i] = kb + (size_t)(p0 + i) * kv->k_row;
            v[i] = vb + (size_t)(p0 + i) * kv->v_row;
        }
    } else {
        ptrdiff_t b = p0 / kv->block_size, o = p0 % kv->block_size;
        for (i = 0; i < n; i++) {
            const size_t blk = (size_t)kv->table[b];
            k[i] = kb + blk * kv->k_block + (size_t)o * kv->k_row;
            v[i] = vb + blk * kv->v_block + (size_t)o * kv->v_row;
            if (++o == kv->block_size) { o = 0; b++; }
        }
    }
}

FX_INLINE void fxa_chunk_rows(const fx_kv *kv, const fx_attn_args *a, ptrdiff_t c0, int n, fxa_rows *c,
                              float *sbuf, const int dt)
{
    int i;
    for (i = 0; i < n; i++) c->ks[i] = c->vs[i] = NULL;
    fxa_row_addrs(kv, c0, n, c->k, c->v);
    if (FX_QUANT(dt)) {
        const size_t nk = (size_t)a->n_kv_heads * fx_i8_groups(a->head_dim);
        const size_t nv = (size_t)a->n_kv_heads * fx_i8_groups(a->v_head_dim);
        const size_t kvals = fx_value_bytes((size_t)a->n_kv_heads * (size_t)a->head_dim, dt);
        const size_t vvals = fx_value_bytes((size_t)a->n_kv_heads * (size_t)a->v_head_dim, dt);
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

#ifndef FXA_PREFETCH_L2 /* tests/c/test_pf.c records the walk instead */
#if defined(__GNUC__) || defined(__clang__)
#define FXA_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#else
#define FXA_PREFETCH_L2(p) ((void)(p))
#endif
#endif

/* A walk, in memory order, over the cache lines the kernel will read: up
   to three segments of rows, and of each row the bytes [b0, b1) of the
   pass's kv heads' values, then [s0, s1) of their int8 / int4 group scales
   (empty for other dtypes).  Each step of a phase (unpacked phase A: R
   rows of a tile; phase C: a tile and row group; packed phase A: a tile)
   prefetches the walk's next m lines into L2, m set so that the walk ends
   with the phase where every vector sees every row of the chunk (a little
   short otherwise; a packed phase A steps on every tile, so its walk
   always ends), so that rows from memory arrive while the kernel
   computes.  Spread this way the requests keep arriving at the rate the
   kernel reads; a row group's lines issued at once gained less
   (benchmarks/NOTES.md).  In unpacked passes float32 rows are left to the
   hardware prefetcher, which keeps pace with them; a packed pass reads
   one head's slice of each row, which it does not follow. */
typedef struct {
    const char *const *row;
    int n;
    size_t b0, b1, s0, s1;
} fxa_pfseg;

typedef struct {
    fxa_pfseg seg[3];
    int nseg, i, x, part, m;
    uintptr_t at, end; /* the next line's address, the range's end (integers: at may precede the row) */
} fxa_pf;

/* Appends rows row[0 .. n) of K (head dim hd = head_dim) or V (v_head_dim),
   kv heads [g0, g0 + nh), to the walk. */
FX_INLINE void fxa_pf_add(fxa_pf *pf, const char *const *row, int n, const fx_attn_args *a, int g0, int nh, int hd,
                          const int dt)
{
    fxa_pfseg *sg = pf->seg + pf->nseg;
    const size_t vals = fx_value_bytes((size_t)a->n_kv_heads * (size_t)hd, dt), ng = fx_i8_groups(hd);
    if (n <= 0) return;
    sg->row = row;
    sg->n = n;
    sg->b0 = fx_value_bytes((size_t)g0 * (size_t)hd, dt);
    sg->b1 = fx_value_bytes((size_t)(g0 + nh) * (size_t)hd, dt);
    sg->s0 = sg->s1 = 0;
    if (FX_QUANT(dt)) {
        sg->s0 = vals + 2 * (size_t)g0 * ng;
        sg->s1 = vals + 2 * (size_t)(g0 + nh) * ng;
    }
    pf->nseg++;
}

/* The walk at the start of its current range: the line of its first byte. */
FX_INLINE void fxa_pf_range(fxa_pf *pf)
{
    const fxa_pfseg *sg = pf->seg + pf->i;
    const char *row = sg->row[pf->x];
    pf->at = (uintptr_t)(row + (pf->part ? sg->s0 : sg->b0)) & ~(uintptr_t)63;
    pf->end = (uintptr_t)(row + (pf->part ? sg->s1 : sg->b1));
}

/* Sets the walk to its first line, m lines a step over `steps` steps. */
FX_INLINE void fxa_pf_start(fxa_pf *pf, size_t steps)
{
    size_t lines = 0;
    int i;
    for (i = 0; i < pf->nseg; i++) {
        const fxa_pfseg *sg = pf->seg + i;
        const size_t per_row = (sg->b1 - sg->b0 + 63) / 64 + 1 + (sg->s1 > sg->s0 ? (sg->s1 - sg->s0 + 63) / 64 + 1 : 0);
        lines += per_row * (size_t)sg->n; /* at most: a range may straddle one more line */
    }
    pf->i = pf->x = pf->part = 0;
    pf->m = 0;
    if (!pf->nseg || !steps) return;
    pf->m = (int)((lines + steps - 1) / steps);
    fxa_pf_range(pf);
}

FX_INLINE void fxa_pf_step(fxa_pf *pf)
{
    int m = pf->m;
    while (m-- > 0 && pf->i < pf->nseg) {
        const fxa_pfseg *sg = pf->seg + pf->i;
        FXA_PREFETCH_L2((const char *)pf->at);
        pf->at += 64;
        if (pf->at < pf->end) continue;
        if (!pf->part && sg->s1 > sg->s0) {
            pf->part = 1;
        } else {
            pf->part = 0;
            if (++pf->x == sg->n) {
                pf->x = 0;
                if (++pf->i == pf->nseg) break;
            }
        }
        fxa_pf_range(pf);
    }
}

/* The int8 / int4 scale of row r's group holding dim d of the head whose
   scales start at soff (0 for other dtypes). */
#define FXA_SC(dt, s, r, soff, d) (FX_QUANT(dt) ? (s)[r][(soff) + ((size_t)(d) >> 5)] : 0.0f)

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
#define FXT_PIN(v) ((void)0)
#include "_attn_tile.h"
#if FXA_HAVE_W16
#define FXT_W 16
#define FXT_V fxa_v16
#define FXT_LOAD fxa16_load
#define FXT_STORE fxa16_store
#define FXT_SPLAT fxa16_splat
#define FXT_LD FXA_LD16
#define FXT_FOLD8 fxa16_fold8
#define FXT_PIN(v) __asm__("" : "+v"(v))
#include "_attn_tile.h"
#define FXA_QK_TILE(W, ...) ((W) == 16 ? fxa_qk_tile_16(__VA_ARGS__) : fxa_qk_tile_8(__VA_ARGS__))
#define FXA_QKT_TILE(W, ...) ((W) == 16 ? fxa_qkt_tile_16(__VA_ARGS__) : fxa_qkt_tile_8(__VA_ARGS__))
#define FXA_PV_TILE(W, ...) ((W) == 16 ? fxa_pv_tile_16(__VA_ARGS__) : fxa_pv_tile_8(__VA_ARGS__))
#else
#define FXA_QK_TILE(W, ...) ((void)(W), fxa_qk_tile_8(__VA_ARGS__))
#define FXA_QKT_TILE(W, ...) ((void)(W), fxa_qkt_tile_8(__VA_ARGS__))
#define FXA_PV_TILE(W, ...) ((void)(W), fxa_pv_tile_8(__VA_ARGS__))
#endif

/* Integer q.k for int8 rows (FXA_I8DOT, x86-64-v3 and above): the query
   vectors of an int8 cache are quantised once per pass (fxa_quantise_q:
   qi, one factor qf per vector), and each 32-value group of a K row is
   dotted with them in 16-bit pairs and 32-bit lanes, exactly: |k|, |q| <=
   127 (the stored and the quantised ranges), so vpmaddubsw's pair sums
   stay <= 2 * 127^2 < 2^15 and never saturate (|k| times q with k's sign:
   the instruction takes one unsigned operand).  Each group's exact sum is
   then converted and weighed by its K scale in float32, and the score
   times qf:  s[t*FX_CS + r] = qf_t * sum_j ks_rj * (qi_t . k_rj).
   GCC builtins rather than <immintrin.h> functions: they are checked where
   they are expanded (see _simd.h's rules).  A head dim that is not a
   multiple of 32 ends with a scalar integer group.  int4 rows (dt FX_I4,
   head dims multiples of 32) take the same tile: each group's 16 bytes
   unpack to 32 int8 lanes (low nibbles, then high ones, minus 8), and
   |k| <= 7 keeps the pair sums further from saturation. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(FX_VECEXT) \
    && (FX_ATTN_CLONES || defined(__AVX2__))
#define FXA_HAVE_I8DOT 1
typedef char fxa_v32b __attribute__((vector_size(32)));
typedef char fxa_v32bu __attribute__((vector_size(32), aligned(1), may_alias));
typedef short fxa_v16s __attribute__((vector_size(32)));
typedef unsigned char fxa_v16ubk __attribute__((vector_size(16)));
typedef unsigned char fxa_v16ubku __attribute__((vector_size(16), aligned(1), may_alias));
/* The 32 int8 values of an int4 group at byte p. */
#define FXA_I4_GROUP32(p) __extension__({                                                              \
    const fxa_v16ubk b_ = *(const fxa_v16ubku *)(const void *)(p);                                     \
    (fxa_v32b)__builtin_shufflevector(b_ & 15, b_ >> 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, \
                                      15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) - 8; })
FX_INLINE void fxa_qk_tile_i8(const int T, const int R, const int8_t *qi, const float *qf, int hd,
                              const char *const *k, const float *const *ks, size_t koff, size_t soff, float *s,
                              const int dt)
{
    const int ng = hd / FX_I8_GROUP;
    const fxa_v16s ones = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    fxa_v8 acc[12];
    float sum[12];
    int t, r, j, d;
    for (t = 0; t < 12; t++) acc[t] = fxa_splat(0.0f);
    for (j = 0; j < ng; j++)
        for (r = 0; r < R; r++) {
            const fxa_v32b kv = FX_IS_I4(dt) ? FXA_I4_GROUP32(k[r] + koff / 2 + (size_t)j * 16)
                                             : (fxa_v32b)*(const fxa_v32bu *)(const void *)(k[r] + koff + (size_t)j * FX_I8_GROUP);
            const fxa_v32b ka = __builtin_ia32_pabsb256(kv);
            const fxa_v8 sc = fxa_splat(ks[r][soff + (size_t)j]);
            for (t = 0; t < T; t++) {
                const fxa_v32b qv = *(const fxa_v32bu *)(const void *)(qi + (size_t)t * hd + (size_t)j * FX_I8_GROUP);
                const fxa_v16s p16 = __builtin_ia32_pmaddubsw256(ka, __builtin_ia32_psignb256(qv, kv));
                const fxa_v8i p32 = __builtin_ia32_pmaddwd256(p16, ones);
                acc[t * R + r] = fxa_fma(__builtin_convertvector(p32, fxa_v8), sc, acc[t * R + r]);
            }
        }
    fxa_hsum8x8(acc, sum);
    fxa_hsum4x8(acc + 8, sum + 8);
    if (!FX_IS_I4(dt) && ng * FX_I8_GROUP < hd)
        for (r = 0; r < R; r++) {
            const int8_t *kr = (const int8_t *)(const void *)(k[r] + koff);
            const float sc = ks[r][soff + (size_t)ng];
            for (t = 0; t < T; t++) {
                int32_t x = 0;
                for (d = ng * FX_I8_GROUP; d < hd; d++) x += (int32_t)qi[(size_t)t * hd + d] * kr[d];
                sum[t * R + r] += (float)x * sc;
            }
        }
    for (t = 0; t < T; t++)
        for (r = 0; r < R; r++) s[t * FX_CS + r] = sum[t * R + r] * qf[t];
}
#else
#define FXA_HAVE_I8DOT 0
#endif

/* Integer q.k on AVX-512 VNNI (idot 2: fxa_attend_v4_i8vnni, or a build for
   a CPU with it), int8 rows whose head dim is a multiple of 64: one
   vpdpbusd dots 64 values, two 32-value groups, 4 products per int32 lane.
   Its first operand is unsigned, so the query is stored biased (qu = qi +
   128, fxa_quantise_q) and each row's 128 * (sum of k) is taken off by
   starting the lane's sum at -128 * sum k: the int32 lanes equal those of
   fxa_qk_tile_i8, exactly.  Lanes 0-7 hold the first group, weighed by its
   K scale, lanes 8-15 the second; their float sums differ from the 8-lane
   tile's in rounding order only. */
#if FXA_HAVE_I8DOT && FXA_HAVE_W16
#define FXA_HAVE_VNNI 1
typedef int32_t fxa_v16iu __attribute__((vector_size(64), aligned(1), may_alias));
FX_INLINE void fxa_qk_tile_vnni(const int T, const int R, const int8_t *qu, const float *qf, int hd,
                                const char *const *k, const float *const *ks, size_t koff, size_t soff, float *s)
{
    const fxa_v16i zero = {0}, bias = zero + (int32_t)0x80808080u; /* 128 in each byte */
    fxa_v16 acc[12];
    fxa_v8 acc8[12];
    float sum[12];
    int t, r, j;
    for (t = 0; t < 12; t++) acc[t] = fxa16_splat(0.0f);
    for (j = 0; j < hd; j += 2 * FX_I8_GROUP)
        for (r = 0; r < R; r++) {
            const fxa_v16i kv = *(const fxa_v16iu *)(const void *)(k[r] + koff + (size_t)j);
            const fxa_v16i neg = zero - __builtin_ia32_vpdpbusd_v16si(zero, bias, kv);
            const float *s2 = ks[r] + soff + (size_t)(j / FX_I8_GROUP);
            const fxa_v16 sc = FX_JOIN16(fxa_splat(s2[0]), fxa_splat(s2[1]));
            for (t = 0; t < T; t++) {
                const fxa_v16i qv = *(const fxa_v16iu *)(const void *)(qu + (size_t)t * hd + (size_t)j);
                const fxa_v16i p = __builtin_ia32_vpdpbusd_v16si(neg, qv, kv);
                acc[t * R + r] = fxa_fma(__builtin_convertvector(p, fxa_v16), sc, acc[t * R + r]);
            }
        }
    for (t = 0; t < 12; t++) acc8[t] = fxa16_fold8(acc[t]);
    fxa_hsum8x8(acc8, sum);
    fxa_hsum4x8(acc8 + 8, sum + 8);
    for (t = 0; t < T; t++)
        for (r = 0; r < R; r++) s[t * FX_CS + r] = sum[t * R + r] * qf[t];
}
#else
#define FXA_HAVE_VNNI 0
#endif
/* The VNNI tile runs for this call: int8 rows, a head dim it takes. */
#define FXA_VNNI(idot, dt, hd) (FXA_HAVE_VNNI && (idot) == 2 && (dt) == FX_I8 && (hd) % 64 == 0)

/* The query vectors an int8 cache reads (every level, every path, so that
   the result does not depend on which one runs): each vector x of head_dim
   raw values becomes qi = clamp(rint(x / sx), -127, 127), sx = max|x| /
   127 in float32, and the kernel attends with qi * sx (qs, times the
   scale's factor qscale; qf = sx * qscale for the integer tile).  A vector
   holding a NaN or an inf gets NaN (qs and qf): its scores are NaN, as
   inf times a finite K value or NaN makes them in SDPA.  All zero, or no
   value of magnitude 2^-119 or more (so that sx is a normal float, also
   where the thread flushes denormals): zeros, whose scores differ from the
   exact ones by less than 2^-119 times |k|.  biased: qi holds qi + 128 as
   unsigned bytes, for the VNNI tile. */
FX_INLINE void fxa_quantise_q(const float *x, int hd, float qscale, float *qs, int8_t *qi, float *qf,
                              const int biased)
{
    uint32_t amax = 0;
    float sx;
    int d;
    for (d = 0; d < hd; d++) {
        const uint32_t u = fx_f2u(x[d]) & 0x7fffffffu;
        amax = u > amax ? u : amax;
    }
    if (amax < 0x04000000u || amax >= 0x7f800000u) {
        const float fill = amax >= 0x7f800000u ? fx_u2f(0x7fc00000u) : 0.0f;
        for (d = 0; d < hd; d++) {
            qs[d] = fill;
            qi[d] = (int8_t)(biased ? -128 : 0); /* 0, biased */
        }
        *qf = fill;
        return;
    }
    sx = fx_u2f(amax) / 127.0f;
    for (d = 0; d < hd; d++) {
        /* round to nearest even by 1.5 * 2^23 with v's sign (|v| < 2^22) */
        const float v = x[d] / sx, big = fx_u2f(0x4b400000u | (fx_f2u(v) & 0x80000000u));
        float rv = (v + big) - big;
        rv = rv > 127.0f ? 127.0f : rv < -127.0f ? -127.0f : rv;
        qi[d] = (int8_t)((int32_t)rv ^ (biased ? -128 : 0)); /* biased: bit 7 flipped, qi + 128 */
        qs[d] = rv * sx * qscale;
    }
    *qf = sx * qscale;
}

/* Online-softmax step of one query vector over one chunk.  s: its scores
   (base 2) for the chunk's rows, of which only [a, b) are visible (and only
   those need be valid).  Leaves p = 2^((s - m_new) f) on [a, b) and 0
   elsewhere on [0, n8), sets *alpha = 2^((m_old - m_new) f) (1 if the max
   did not grow or nothing is visible, 0 on the first visible chunk) and
   updates m, l.  The max ignores NaN; while it is -inf (every visible score
   so far -inf or NaN) p is 2^(s f): 0 for -inf, NaN for NaN.  W: the
   call's vector width (16: p in steps of 16 lanes where they fit). */
FX_INLINE void fxa_softmax_step(float *s, int a, int b, int n8, float *m, float *l, float *alpha, float f,
                                const int W)
{
    const int g0 = a & ~7, g1 = (b + 7) & ~7;
    fxa_v8 mx = fxa_splat(FX_NEG_INF), sum = fxa_splat(0.0f);
    float mc;
    int r;
    (void)W;
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
    r = g0;
#if FXA_HAVE_W16
    if (W == 16) /* 16 lanes at once where they fit: the same p, the sum in another order */
        for (; r + 16 <= g1; r += 16) {
            const fxa_v16 pr = fxa16_exp2((fxa16_load(s + r) - fxa16_splat(mc)) * fxa16_splat(f));
            fxa16_store(s + r, pr);
            sum = fxa_add(sum, fxa16_fold8(pr));
        }
#endif
    for (; r < g1; r += 8) {
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
   Tiles are runs of 4 (then 2, 1) consecutive vectors of one kv head
   (FX_TILE_T; a packed head's score tiles on 16-float vectors: FX_TILE_TP). */
#define FX_TILE_T(left) ((left) >= 4 ? 4 : (left) >= 2 ? 2 : 1)
/* Rows per score tile of T vectors: 4 x 4 (16 accumulators) for the float
   tile on 16-float vectors (32 registers); 4 x 3 for 8-float vectors (16
   registers) and the integer tiles; 2 x 6, 1 x 12 */
#define FX_TILE_R(T, W, idot) ((T) == 4 && (W) == 16 && !(idot) ? 4 : 12 / (T))

/* Phase A's steps over n rows: per kv head, its tiles (FX_TILE_T) times
   the FX_TILE_R-row groups of each RGA-row group, as fxa_phase_scores
   walks them. */
FX_INLINE size_t fxa_steps_a(ptrdiff_t nvg, int nh, int n, const int W, const int idot)
{
    size_t steps = 0;
    ptrdiff_t i0;
    int r;
    for (i0 = 0; i0 < nvg; i0 += FX_TILE_T(nvg - i0)) {
        const int T = FX_TILE_T(nvg - i0), R = FX_TILE_R(T, W, idot);
        for (r = 0; r < n; r += FX_ATTN_RGA) {
            const int rows = n - r < FX_ATTN_RGA ? n - r : FX_ATTN_RGA;
            steps += (size_t)((rows + R - 1) / R);
        }
    }
    return steps * (size_t)nh;
}

/* Vectors per score tile on a packed head: 8 on 16-float vectors, else
   as FX_TILE_T (so FX_TILE_TP(left, 8) is FX_TILE_T(left)). */
#define FX_TILE_TP(left, W) ((W) == 16 && (left) >= 8 ? 8 : FX_TILE_T(left))

/* Phase A's steps on a packed head: its tiles (FX_TILE_TP). */
FX_INLINE size_t fxa_steps_t(ptrdiff_t nvg, const int W)
{
    size_t tiles = 0;
    ptrdiff_t i0;
    for (i0 = 0; i0 < nvg; i0 += FX_TILE_TP(nvg - i0, W)) tiles++;
    return tiles;
}

/* Phase C's steps over n rows: per kv head, its tiles (FX_TILE_T, at any
   width) times the RGC-row groups. */
FX_INLINE size_t fxa_steps_c(ptrdiff_t nvg, int nh, int n)
{
    return fxa_steps_t(nvg, 8) * (size_t)nh * (size_t)((n + FX_ATTN_RGC - 1) / FX_ATTN_RGC);
}

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
                               size_t soff0, const fxa_rows *c, int r, int r1, const float *qs, const int8_t *qi,
                               const float *qf, float *sc, const float *fa, const float *fb, const int dt,
                               const int W, const int idot, fxa_pf *pf)
{
    const int hd = a->head_dim;
    const size_t ng = fx_i8_groups(hd);
    int h;
    (void)qi, (void)qf, (void)idot;
    for (h = 0; h < nh; h++) {
        const size_t koff = koff0 + (size_t)h * (size_t)hd, soff = soff0 + (size_t)h * ng;
        const ptrdiff_t iend = i1 + (h + 1) * nvg;
        ptrdiff_t i0;
        for (i0 = i1 + h * nvg; i0 < iend; i0 += FX_TILE_T(iend - i0)) {
            const int T = FX_TILE_T(iend - i0), R = FX_TILE_R(T, W, idot);
            const float *q = qs + (size_t)i0 * hd;
            int ua, ub, rr;
            fxa_tile_rows(fa, fb, i0, T, &ua, &ub);
            ua = ua > r ? ua : r;
            ub = ub < r1 ? ub : r1;
            for (rr = ua; rr < ub; rr += R) { /* the last group may run past ub: padded rows */
                float *s = sc + (size_t)i0 * FX_CS + rr;
                fxa_pf_step(pf);
#if FXA_HAVE_VNNI
                if (FXA_VNNI(idot, dt, hd)) {
                    const int8_t *qt = qi + (size_t)i0 * hd;
                    if (T == 4) fxa_qk_tile_vnni(4, 3, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s);
                    else if (T == 2) fxa_qk_tile_vnni(2, 6, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s);
                    else fxa_qk_tile_vnni(1, 12, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s);
                    continue;
                }
#endif
#if FXA_HAVE_I8DOT
                if (idot) {
                    const int8_t *qt = qi + (size_t)i0 * hd;
                    if (T == 4) fxa_qk_tile_i8(4, 3, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                    else if (T == 2) fxa_qk_tile_i8(2, 6, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                    else fxa_qk_tile_i8(1, 12, qt, qf + i0, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                    continue;
                }
#endif
                if (T == 4 && R == 4) FXA_QK_TILE(W, 4, 4, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                else if (T == 4) FXA_QK_TILE(W, 4, 3, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                else if (T == 2) FXA_QK_TILE(W, 2, 6, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
                else FXA_QK_TILE(W, 1, 12, q, hd, c->k + rr, c->ks + rr, koff, soff, s, dt);
            }
        }
    }
}

/* Phase A on a packed head: scores of the tiles of vectors i1 .. i1+nvg
   against the transposed K slice kt (FX_KT floats per dimension), for the
   groups of 3W rows that hold a row the tile sees.  Tiles of FX_TILE_TP
   vectors, each a step of the walk pf (fxa_steps_t of them). */
FX_INLINE void fxa_phase_scores_t(int hd, ptrdiff_t nvg, ptrdiff_t i1, const float *kt, const float *qs, float *sc,
                                  const float *fa, const float *fb, const int W, fxa_pf *pf)
{
    const ptrdiff_t iend = i1 + nvg;
    ptrdiff_t i0;
    for (i0 = i1; i0 < iend; i0 += FX_TILE_TP(iend - i0, W)) {
        const int T = FX_TILE_TP(iend - i0, W);
        int ua, ub, rr;
        float *s = sc + (size_t)i0 * FX_CS;
        const float *q = qs + (size_t)i0 * hd;
        fxa_pf_step(pf);
        fxa_tile_rows(fa, fb, i0, T, &ua, &ub);
        for (rr = ua / (3 * W) * (3 * W); rr < ub; rr += 3 * W) {
            if (T == 8) FXA_QKT_TILE(W, 8, q, hd, kt, rr, s);
            else if (T == 4) FXA_QKT_TILE(W, 4, q, hd, kt, rr, s);
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
                           const float *fa, const float *fb, const int dt, const int W, fxa_pf *pf)
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
            if (pf) fxa_pf_step(pf);
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
    for (; d + 8 <= hd; d += 8) fxa_store(dst + d, FXA_LD(dt, row, off + (size_t)d, FX_QUANT(dt) ? scales[soff + ((size_t)d >> 5)] : 0.0f));
    for (; d < hd; d++) dst[d] = fxa_ld1(dt, row, off + (size_t)d, FX_QUANT(dt) ? scales[soff + ((size_t)d >> 5)] : 0.0f);
}

FX_INLINE void fxa_pack_head(const fxa_rows *c, int n, int g, int hd, int dv, float *kt, float *krow, float *vbuf,
                             fxa_rows *pk, const int dt)
{
    int r, d, i;
    /* K transposed (kt[d*FX_KT + r]), rows past n zero: 8 rows at a time
       by 8 x 8 transposes (float32 rows read in place, others unpacked to
       krow, 8 head slices); a last group of fewer rows reads zero rows */
    for (r = 0; r < n; r += 8) {
        const float *src[8];
        fxa_v8 t[8];
        for (i = 0; i < 8; i++) {
            float *own = krow + (size_t)i * (size_t)hd;
            if (r + i < n && dt == FX_F32) {
                src[i] = (const float *)(const void *)c->k[r + i] + (size_t)g * (size_t)hd;
                continue;
            }
            if (r + i < n) fxa_unpack_slice(own, c->k[r + i], c->ks[r + i], g, hd, dt);
            else memset(own, 0, (size_t)hd * sizeof(float));
            src[i] = own;
        }
        for (d = 0; d + 8 <= hd; d += 8) {
            for (i = 0; i < 8; i++) t[i] = fxa_load(src[i] + d);
            fxa_transpose8(t);
            for (i = 0; i < 8; i++) fxa_store(kt + (size_t)(d + i) * FX_KT + r, t[i]);
        }
        for (; d < hd; d++)
            for (i = 0; i < 8; i++) kt[(size_t)d * FX_KT + r + i] = src[i][d];
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
   FX_ATTN_PACK_MIN query vectors (8 tiles of 4) of a pass share them. */
#define FX_PACKS(nvg) ((nvg) > FX_ATTN_PACK_MIN)

/* Floats of scratch fx_attend needs, for the nv query vectors of a pass:
   scaled queries, output accumulators, one chunk of scores, m, l, alpha and
   the visible row range of each vector; plus one chunk of one head's K
   (transposed, FX_KT rows, and 8 rows unpacked) and V when they are packed, one
   chunk's int8 scales as float, and the quantised queries (int8 caches:
   a factor per vector and head_dim bytes). */
static inline FX_UNUSED size_t fxa_scratch_floats(const fx_attn_args *a)
{
    ptrdiff_t nq;
    int nh;
    size_t nvg, nv;
    fxa_pass_shape(a, &nq, &nh);
    nvg = (size_t)nq * (size_t)(a->n_heads / a->n_kv_heads);
    nv = nvg * (size_t)nh;
    return nv * ((size_t)a->head_dim + (size_t)a->v_head_dim + FX_CS + 5) +
           (FX_PACKS(nvg) ? (size_t)(FX_KT + 8) * (size_t)a->head_dim + (size_t)FX_C * (size_t)a->v_head_dim : 0) +
           FXA_SCALE_FLOATS(a) + nv + (nv * (size_t)a->head_dim + 3) / 4;
}

/* How a scale enters the kernel (see the rules at the top): q is
   multiplied by the returned factor, exponents by *f, so that a score s
   against the running max m weighs 2^((s - m) f). */
FX_INLINE float fxa_exp_scales(float scale, float *f)
{
    const float c = scale * FX_LOG2E;
    const int small = c <= 1.0f && c >= -1.0f, finite = c <= 3.4028234e38f && c >= -3.4028234e38f;
    *f = small ? 1.0f : finite ? (c > 0 ? c : -c) : (float)((scale > 0 ? (double)scale : -(double)scale) * 0.72134752044448170);
    return small ? c : (c > 0 ? 1.0f : -1.0f) * (finite ? 1.0f : 2.0f);
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
       K and V are read row group after row group across all heads, close
       to memory order: the hardware prefetcher streams float32 rows, the
       others are prefetched a chunk ahead (see fxa_pf), and
       a head's slices of a row group are not needed after its tiles.
     more (prefill, MQA with G > 32)
       for kv heads: pack the chunk's K slice transposed and its V slice
       contiguously, then A (on the transposed K: no horizontal sums; it
       prefetches the head's slices of the next chunk, fxa_pf), B, C
       over the whole chunk for every tile of the head (the packed slices
       stay in L1 across the tiles that reuse them). */
FX_INLINE void fxa_attend_body(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch,
                               const int dt, const int W, const int idot)
{
    const int H = a->n_heads, Hkv = a->n_kv_heads, G = a->n_heads / a->n_kv_heads;
    const int hd = a->head_dim, dv = a->v_head_dim;
    const size_t ngk = fx_i8_groups(hd), ngv = fx_i8_groups(dv);
    const ptrdiff_t first = kv->len - a->q_len;
    const int rot = kv->dtype == FX_I4H; /* FX_I4H: q rotated as K was, the output back as V was */
    float f;
    const float qscale = fxa_exp_scales(a->scale, &f);
    fxa_rows rows, packed;
    ptrdiff_t qb, t0;
    int hb, g0;

    /* the part of the call these arguments ask for (see fx_attn_args) */
    const int kv_hi = a->kv_hi > 0 ? a->kv_hi : Hkv;
    const ptrdiff_t rlo = a->row_lo, rhi = a->row_hi > 0 ? a->row_hi : kv->len;
    const ptrdiff_t vstart = a->start > rlo ? a->start : rlo;

    fxa_pass_shape(a, &qb, &hb);
    for (t0 = 0; t0 < a->q_len; t0 += qb)
        for (g0 = a->kv_lo; g0 < kv_hi; g0 += hb) {
            const ptrdiff_t nq = a->q_len - t0 < qb ? a->q_len - t0 : qb;
            const int nh = kv_hi - g0 < hb ? kv_hi - g0 : hb;
            const ptrdiff_t nvg = nq * G, nv = nvg * nh, p_last = first + t0 + nq - 1;
            const ptrdiff_t c_last = p_last < rhi - 1 ? p_last : rhi - 1;
            float *qs = scratch, *acc = qs + (size_t)nv * hd, *sc = acc + (size_t)nv * dv;
            float *mm = sc + (size_t)nv * FX_CS, *ll = mm + nv, *al = ll + nv, *fa = al + nv, *fb = fa + nv;
            float *kt = fb + nv, *krow = kt + (size_t)FX_KT * hd, *vbuf = krow + (size_t)8 * hd;
            const int pack = FX_PACKS(nvg);
            float *sbuf = pack ? vbuf + (size_t)FX_C * dv : kt;
            float *qf = sbuf + FXA_SCALE_FLOATS(a); /* int8: fxa_quantise_q */
            int8_t *qi = (int8_t *)(void *)(qf + nv);
            ptrdiff_t lo, c0, i, pos;
            int h, jj, d;

            /* scaled queries, vector i = h*nvg + pos*G + jj (kv head g0+h, position t0+pos,
               query head (g0+h)*G + jj): a kv head's vectors are consecutive */
            for (h = 0, i = 0; h < nh; h++)
                for (pos = 0; pos < nq; pos++)
                    for (jj = 0; jj < G; jj++, i++) {
                        const float *src = q + ((size_t)(t0 + pos) * H + (size_t)(g0 + h) * G + jj) * hd;
                        float *qv = qs + (size_t)i * hd;
                        if (rot) { /* rotated like the stored K rows, in place */
                            memcpy(qv, src, (size_t)hd * sizeof(float));
                            fx_fwht(qv, hd, fx_hadamard_block(hd));
                            src = qv;
                        }
                        if (FX_QUANT(dt)) fxa_quantise_q(src, hd, qscale, qv, qi + (size_t)i * hd, qf + i, FXA_VNNI(idot, dt, hd));
                        else for (d = 0; d < hd; d++) qv[d] = src[d] * qscale;
                        mm[i] = FX_NEG_INF;
                        ll[i] = 0.0f;
                    }
            memset(acc, 0, (size_t)nv * dv * sizeof(float));

            /* rows any query of this pass sees: lo of the first position .. p_last */
            lo = vstart;
            if (a->window > 0 && first + t0 - a->window + 1 > lo) lo = first + t0 - a->window + 1;
            for (c0 = lo; c0 <= c_last; c0 += FX_C) {
                const int n = (int)(c_last + 1 - c0 < FX_C ? c_last + 1 - c0 : FX_C), n8 = (n + 7) & ~7;
                /* rows of the next chunk, prefetched while this one computes */
                const ptrdiff_t after = c_last + 1 - c0 - FX_C; /* rows past this chunk */
                const int npf = after <= 0 ? 0 : after < FX_C ? (int)after : FX_C;
                const char *nk[FX_C], *nvr[FX_C];
                fxa_pf pk, pv;
                int r;
                fxa_chunk_rows(kv, a, c0, n, &rows, sbuf, dt);
                /* rows [fa, fb) of this chunk each vector sees */
                for (h = 0, i = 0; h < nh; h++)
                    for (pos = 0; pos < nq; pos++) {
                        const ptrdiff_t p = first + t0 + pos;
                        const ptrdiff_t phi = p + 1 < rhi ? p + 1 : rhi;
                        ptrdiff_t vlo = vstart, x, y;
                        if (a->window > 0 && p - a->window + 1 > vlo) vlo = p - a->window + 1;
                        x = vlo - c0 < 0 ? 0 : vlo - c0 > n ? n : vlo - c0;
                        y = phi - c0 < 0 ? 0 : phi - c0 > n ? n : phi - c0;
                        for (jj = 0; jj < G; jj++, i++) {
                            fa[i] = (float)x;
                            fb[i] = (float)y;
                        }
                    }
                if (!pack) {
                    /* phase A prefetches the next chunk's K lines, phase C its V lines.  A pass's
                       first chunk has no chunk before it to prefetch it: its phase A
                       prefetches its own K past the first row group and its own V first. */
                    const int first_chunk = c0 == lo;
                    pk.nseg = pv.nseg = 0;
                    if (FX_ATTN_PREFETCH && dt != FX_F32) {
                        if (npf) fxa_row_addrs(kv, c0 + FX_C, npf, nk, nvr);
                        if (first_chunk && n > FX_ATTN_RGA) fxa_pf_add(&pk, rows.k + FX_ATTN_RGA, n - FX_ATTN_RGA, a, g0, nh, hd, dt);
                        if (first_chunk) fxa_pf_add(&pk, rows.v, n, a, g0, nh, dv, dt);
                        fxa_pf_add(&pk, nk, npf, a, g0, nh, hd, dt);
                        fxa_pf_add(&pv, nvr, npf, a, g0, nh, dv, dt);
                    }
                    fxa_pf_start(&pk, fxa_steps_a(nvg, nh, n, W, idot));
                    fxa_pf_start(&pv, fxa_steps_c(nvg, nh, n));
                    for (r = 0; r < n; r += FX_ATTN_RGA)
                        fxa_phase_scores(a, nvg, nh, 0, (size_t)g0 * hd, (size_t)g0 * ngk, &rows, r,
                                        r + FX_ATTN_RGA < n ? r + FX_ATTN_RGA : n, qs, qi, qf, sc, fa, fb, dt, W, idot,
                                        &pk);
                    for (i = 0; i < nv; i++)
                        fxa_softmax_step(sc + (size_t)i * FX_CS, (int)fa[i], (int)fb[i], n8, mm + i, ll + i, al + i, f,
                                        W);
                    for (r = 0; r < n; r += FX_ATTN_RGC)
                        fxa_phase_pv(a, nvg, nh, 0, (size_t)g0 * dv, (size_t)g0 * ngv, &rows, r,
                                    r + FX_ATTN_RGC < n ? r + FX_ATTN_RGC : n, acc, sc, al, fa, fb, dt, W, &pv);
#ifdef FX_ATTN_CHECK_PF /* tests/c's native build: where every vector saw every row, both walks ended */
                    for (i = 0; i < nv && (int)fa[i] == 0 && (int)fb[i] == n; i++) {}
                    if (i == nv && (pk.i != pk.nseg || pv.i != pv.nseg)) __builtin_trap();
#endif
                } else {
                    /* phase A of each head prefetches that head's slices of the next chunk
                       (strided by a row's other heads: the hardware prefetcher misses them) */
                    if (FX_ATTN_PREFETCH && npf) fxa_row_addrs(kv, c0 + FX_C, npf, nk, nvr);
                    for (h = 0; h < nh; h++) {
                        pk.nseg = 0;
                        if (FX_ATTN_PREFETCH && npf) {
                            fxa_pf_add(&pk, nk, npf, a, g0 + h, 1, hd, dt);
                            fxa_pf_add(&pk, nvr, npf, a, g0 + h, 1, dv, dt);
                        }
                        fxa_pf_start(&pk, fxa_steps_t(nvg, W));
                        fxa_pack_head(&rows, n, g0 + h, hd, dv, kt, krow, vbuf, &packed, dt);
                        fxa_phase_scores_t(hd, nvg, h * nvg, kt, qs, sc, fa, fb, W, &pk);
#ifdef FX_ATTN_CHECK_PF /* every tile is a step: the walk ended */
                        if (pk.i != pk.nseg) __builtin_trap();
#endif
                        for (i = h * nvg; i < (h + 1) * nvg; i++)
                            fxa_softmax_step(sc + (size_t)i * FX_CS, (int)fa[i], (int)fb[i], n8, mm + i, ll + i,
                                            al + i, f, W);
                        fxa_phase_pv(a, nvg, 1, h * nvg, 0, 0, &packed, 0, n, acc, sc, al, fa, fb, FX_F32, W, NULL);
                    }
                }
            }

            /* out = acc / l, back in (position, head) order; zeros where nothing
               was visible; l = 0 with rows visible (all scores -inf) gives
               0 * inf = NaN, l = NaN gives NaN.  With a->ml: acc itself,
               and m, l beside it (a part of a split call, merged later). */
            for (h = 0, i = 0; h < nh; h++)
                for (pos = 0; pos < nq; pos++) {
                    const ptrdiff_t p = first + t0 + pos, phi = p < rhi - 1 ? p : rhi - 1;
                    ptrdiff_t vlo = vstart;
                    if (a->window > 0 && p - a->window + 1 > vlo) vlo = p - a->window + 1;
                    for (jj = 0; jj < G; jj++, i++) {
                        const size_t e = (size_t)(t0 + pos) * H + (size_t)(g0 + h) * G + jj;
                        float *dst = out + e * dv;
                        const float inv = a->ml ? 1.0f : vlo <= phi ? 1.0f / ll[i] : 0.0f;
                        for (d = 0; d < dv; d++) dst[d] = acc[(size_t)i * dv + d] * inv;
                        if (rot) fx_fwht(dst, dv, fx_hadamard_block(dv)); /* V's rotation back (linear: partials too) */
                        if (a->ml) {
                            a->ml[2 * e] = mm[i];
                            a->ml[2 * e + 1] = ll[i];
                        }
                    }
                }
        }
}


#if defined(__GNUC__) || defined(__clang__)
#define FXA_NOINLINE __attribute__((noinline))
#else
#define FXA_NOINLINE
#endif

/* FXA_ENTRY(TARGET, name, f16, idot, W): the entry point `name` of one
   level (TARGET: its target attribute, or nothing), with one function per
   dtype at vector width W; f16: how it reads float16 (FXA_F16C or FX_F16);
   idot: 1 where int8 scores take the integer tile (FXA_HAVE_I8DOT, code
   for x86-64-v3 and above), 2 where they take the VNNI tile (code for a
   CPU with AVX-512 VNNI; head dims it does not take fall back to 1), else
   0. */
#define FXA_INSTANCE(TARGET, name, dt, W, idot)                                                        \
    TARGET FXA_NOINLINE static void name(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, \
                                         float *scratch)                                               \
    {                                                                                                  \
        fxa_attend_body(kv, a, q, out, scratch, dt, W, idot);                                          \
    }
#define FXA_ENTRY(TARGET, name, f16, idot, W)                                                          \
    FXA_INSTANCE(TARGET, name##_f32, FX_F32, W, 0)                                                     \
    FXA_INSTANCE(TARGET, name##_f16, f16, W, 0)                                                        \
    FXA_INSTANCE(TARGET, name##_bf16, FX_BF16, W, 0)                                                   \
    FXA_INSTANCE(TARGET, name##_i8, FX_I8, W, idot)                                                    \
    FXA_INSTANCE(TARGET, name##_i4, FX_I4, W, idot)                                                    \
    FX_API void name(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch) \
    {                                                                                                  \
        switch (kv->dtype) {                                                                           \
        case FX_F16: name##_f16(kv, a, q, out, scratch); break;                                        \
        case FX_BF16: name##_bf16(kv, a, q, out, scratch); break;                                      \
        case FX_I8: name##_i8(kv, a, q, out, scratch); break;                                          \
        case FX_I4: case FX_I4H: name##_i4(kv, a, q, out, scratch); break;                             \
        default: name##_f32(kv, a, q, out, scratch); break;                                            \
        }                                                                                              \
    }

/* How a build without dispatch reads float16: by F16C where it targets it;
   FXA_BASE_VNNI: whether it carries an int8 instance for AVX-512 VNNI (a
   target with it, and a compiler that builds the VNNI tile). */
#define FXA_BASE_F16 (FXA_HAVE_F16C ? FXA_F16C : FX_F16)
#if defined(__AVX512VNNI__) && FXA_HAVE_VNNI && !FX_ATTN_CLONES
#define FXA_BASE_VNNI 1
#else
#define FXA_BASE_VNNI 0
#endif

/* The levels' entry points, same contract as fx_attend. */
typedef void fxa_entry_fn(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);
FX_API fxa_entry_fn fxa_attend_base;      /* _attn_base.c: always */
#if FX_ATTN_CLONES
FX_API fxa_entry_fn fxa_attend_v3;        /* _attn_v3.c */
#if FXA_HAVE_W16
FX_API fxa_entry_fn fxa_attend_v4;        /* _attn_v4.c */
FX_API fxa_entry_fn fxa_attend_v4_i8vnni; /* _attn_v4.c: int8 rows, AVX-512 VNNI */
#endif
#elif FXA_HAVE_W16
FX_API fxa_entry_fn fxa_attend_base16;    /* _attn_v4.c, a build for AVX-512 */
#if FXA_BASE_VNNI
FX_API fxa_entry_fn fxa_attend_base16_i8vnni; /* _attn_v4.c: int8 rows, a build for AVX-512 VNNI */
#endif
#endif

#endif /* FX_ATTN_KERNEL_H */
