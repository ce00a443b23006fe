/* test_attn.c -- correctness tests for _attn.h against a float64 reference,
 * for every storage dtype (the reference reads the rows as stored, i.e.
 * rounded or dequantised by fx_rows_to_f32), and the numeric rules of
 * SDPA: NaN/inf in q, K or V, and scales up to FLT_MAX.  main() also runs
 * the conversion tests of test_conv.c.
 *
 * Every buffer the kernel sees (q, out, scratch, K/V pools, block table) is
 * its own malloc of exactly the documented size; under -fsanitize=address
 * any read or write past it aborts.  Without ASan, out and scratch carry a
 * canary tail that must survive.  out and scratch are filled with NaN before
 * each call, so a kernel that skips an output element or depends on scratch
 * contents fails.
 *
 * Pass criterion per output element e of query (t, j):
 *   |out - ref| <= A * (RTOL + 2 * ds)
 *   A  = max_e sum_r w_r |v_r,e| / sum_r w_r   (the row's weighted |V| size:
 *        scale-aware, independent of cancellation in the reference)
 *   ds = 2^-24 * sqrt(head_dim) * max_r scale * sum_d |q_d k_r,d|
 *        (float32 rounding of a score; a score error ds moves the output by
 *        at most 2*A*ds -- this is what a float32 kernel cannot avoid, and
 *        only matters for the large-magnitude cases; for the ordinary
 *        cases 2*ds < 0.4e-5).
 * Queries that see no row must be exactly 0.
 *
 * int8 caches read each query vector quantised (fxa_quantise_q, _attn_kernel.h:
 * one scale per vector of head_dim values), so the reference attends with
 * that vector: the test holds the kernel's arithmetic to the same bound, and
 * the quantisation's cost against float queries is bounded apart
 * (tests/test_precision.py).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "_attn.h"
#include "_simd.h" /* fxa_exp2, fxa_exp2f: exp_test */
#include "_workers.h"


#define RTOL 1e-5

#if defined(__SANITIZE_ADDRESS__)
#define PAD 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PAD 0
#endif
#endif
#ifndef PAD
#define PAD 16
#endif
#define CANARY 12345.678f

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_u64(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_uni(void) { return (float)((rng_u64() >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f; }

static float *alloc_f(size_t n, int pad)
{
    float *p = malloc((n + (size_t)pad) * sizeof(float) + 1);
    size_t i;
    if (!p) { fprintf(stderr, "oom\n"); exit(2); }
    for (i = 0; i < (size_t)pad; i++) p[n + i] = CANARY;
    return p;
}
static int canary_ok(const float *p, size_t n, int pad)
{
    size_t i;
    for (i = 0; i < (size_t)pad; i++)
        if (p[n + i] != CANARY) return 0;
    return 1;
}

enum { INJ_NONE, INJ_Q, INJ_K, INJ_V, INJ_K_HEAD }; /* what run_case poisons with tcase.inj_val */

typedef struct {
    int dt;           /* FX_F32 ... FX_I4H */
    int inj;          /* INJ_*: q (last query, head 0, dim 0), one K / V row (kv head 0, dim 0), or dim 0 of every K row of kv head 0 */
    float inj_val;
    ptrdiff_t inj_row;
    int exact;        /* K in {0, 0.5, 1}, q = 1: scores exact in float (for huge scales) */
    int H, Hkv, hd, dv;
    ptrdiff_t len, q_len, window, start;
    int bs;           /* 0: contiguous */
    int row_pad;      /* extra floats per row (contiguous only) */
    float qmag, kmag; /* q, k value ranges */
    int signs;        /* q and K values +-qmag, +-kmag: int8 stores +-127 everywhere (integer sums at their largest) */
    float scale;      /* 0: 1/sqrt(hd) */
} tcase;

static const char *dt_name[] = {"f32", "f16", "bf16", "i8", "i4", "i4h"};

/* x (n values) as an int8 cache's kernel reads it: rint(x / s) * s, s =
   max|x| / 127 in float32; non-finite: as is; below 2^-119: zeros */
static void quantise_like_the_kernel(float *x, int n)
{
    float amax = 0, s;
    int d;
    for (d = 0; d < n; d++) amax = fabsf(x[d]) > amax || isnan(x[d]) ? fabsf(x[d]) : amax;
    if (!isfinite(amax)) return;
    if (amax < 0x1p-119f) {
        for (d = 0; d < n; d++) x[d] = 0.0f;
        return;
    }
    s = amax / 127.0f;
    for (d = 0; d < n; d++) {
        float r = rintf(x[d] / s);
        r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
        x[d] = r * s;
    }
}

static int n_fail, n_run;
/* 0: every case calls fx_attend; else fx_attend_batch on this many threads
   with the split forced (every call split, decode chunks down to 1 row) */
static int batch_threads;
static double worst, worst_ratio, worst_large;

static int run_case(const tcase *tc, const char *what)
{
    const int H = tc->H, Hkv = tc->Hkv, G = H / Hkv, hd = tc->hd, dv = tc->dv, dt = tc->dt;
    const ptrdiff_t len = tc->len, ql = tc->q_len;
    const int esz = dt == FX_F32 ? 4 : FX_QUANT(dt) ? 1 : 2;
    fx_kv kv;
    fx_attn_args a;
    /* float rows (the reference's) and stored rows (the kernel's), same row order */
    size_t k_row = (size_t)Hkv * hd, v_row = (size_t)Hkv * dv, kb_row = fx_row_bytes(Hkv, hd, dt),
           vb_row = fx_row_bytes(Hkv, dv, dt), nrows, nk, nv, nsc, nout, i, kfb, vfb;
    int nblocks = 0, pool_blocks = 0, *perm = NULL;
    int32_t *table = NULL;
    float *k, *v, *q, *qref, *out, *sc;
    char *ks, *vs;
    double maxerr = 0, maxratio = 0, tol;
    int ok = 1;
    ptrdiff_t t;

    if (FX_IS_I4(dt) && (hd % FX_I8_GROUP || dv % FX_I8_GROUP)) return 1; /* int4 needs whole groups */
    if (tc->bs == 0) {
        k_row += (size_t)tc->row_pad;
        v_row += (size_t)tc->row_pad;
        /* int8, int4: an odd pad, so that rows (and their scales) are unaligned */
        kb_row += (size_t)tc->row_pad * (size_t)esz + (FX_QUANT(dt) && tc->row_pad ? 1 : 0);
        vb_row += (size_t)tc->row_pad * (size_t)esz + (FX_QUANT(dt) && tc->row_pad ? 1 : 0);
        nrows = (size_t)len;
    } else {
        nblocks = (int)((len + tc->bs - 1) / tc->bs);
        if (nblocks < 1) { printf("bad case\n"); exit(2); }
        pool_blocks = nblocks + 3; /* table is a shuffled subset of a larger pool */
        nrows = (size_t)pool_blocks * tc->bs;
        perm = malloc(sizeof(int) * (size_t)pool_blocks);
        for (i = 0; i < (size_t)pool_blocks; i++) perm[i] = (int)i;
        for (i = (size_t)pool_blocks - 1; i > 0; i--) {
            size_t j = rng_u64() % (i + 1);
            int x = perm[i]; perm[i] = perm[j]; perm[j] = x;
        }
        table = malloc(sizeof(int32_t) * (size_t)nblocks);
        for (i = 0; i < (size_t)nblocks; i++) table[i] = perm[i];
    }
    kfb = (size_t)tc->bs * k_row;
    vfb = (size_t)tc->bs * v_row;
    nk = nrows * k_row;
    nv = nrows * v_row;
    k = alloc_f(nk, 0);
    v = alloc_f(nv, 0);
    for (i = 0; i < nk; i++)
        k[i] = tc->exact ? (float)(rng_u64() % 3) * 0.5f : tc->signs ? (rng_u64() & 1 ? tc->kmag : -tc->kmag) : rng_uni() * tc->kmag;
    for (i = 0; i < nv; i++) v[i] = rng_uni();
    q = alloc_f((size_t)ql * H * hd, 0);
    for (i = 0; i < (size_t)ql * H * hd; i++)
        q[i] = tc->exact ? 1.0f : tc->signs ? (rng_u64() & 1 ? tc->qmag : -tc->qmag) : rng_uni() * tc->qmag;
    if (tc->inj != INJ_NONE && tc->inj != INJ_Q) {
        /* logical row inj_row (or every row) of the sequence, kv head 0, dim 0 */
        ptrdiff_t r;
        for (r = 0; r < len; r++) {
            const size_t pr = table ? (size_t)table[r / tc->bs] * tc->bs + (size_t)(r % tc->bs) : (size_t)r;
            if (tc->inj == INJ_K_HEAD || r == tc->inj_row) {
                if (tc->inj == INJ_V) v[pr * v_row] = tc->inj_val;
                else k[pr * k_row] = tc->inj_val;
            }
        }
    }
    if (tc->inj == INJ_Q) q[(size_t)(ql - 1) * H * hd] = tc->inj_val;
    qref = alloc_f((size_t)ql * H * hd, 0);
    memcpy(qref, q, (size_t)ql * H * hd * sizeof(float));
    /* int4 with rotation: the kernel quantises the rotated query; the
       reference attends with it rotated back */
    if (FX_QUANT(dt))
        for (i = 0; i < (size_t)ql * H; i++) {
            if (dt == FX_I4H) fx_fwht(qref + i * hd, hd, fx_hadamard_block(hd));
            quantise_like_the_kernel(qref + i * hd, hd);
            if (dt == FX_I4H) fx_fwht(qref + i * hd, hd, fx_hadamard_block(hd));
        }
    ks = malloc(nrows * kb_row);
    vs = malloc(nrows * vb_row);
    fx_rows_from_f32(ks, kb_row, k, k_row, (ptrdiff_t)nrows, Hkv, hd, dt);
    fx_rows_from_f32(vs, vb_row, v, v_row, (ptrdiff_t)nrows, Hkv, dv, dt);
    fx_rows_to_f32(k, k_row, ks, kb_row, (ptrdiff_t)nrows, Hkv, hd, dt);
    fx_rows_to_f32(v, v_row, vs, vb_row, (ptrdiff_t)nrows, Hkv, dv, dt);

    kv.k = ks; kv.v = vs; kv.table = table; kv.block_size = tc->bs;
    kv.k_block = (size_t)tc->bs * kb_row; kv.v_block = (size_t)tc->bs * vb_row;
    kv.k_row = kb_row; kv.v_row = vb_row; kv.len = len; kv.dtype = dt;
    memset(&a, 0, sizeof a);
    a.n_kv_heads = Hkv; a.head_dim = hd; a.v_head_dim = dv; a.n_heads = H;
    a.q_len = ql; a.scale = tc->scale != 0 ? tc->scale : 1.0f / sqrtf((float)hd);
    a.window = tc->window; a.start = tc->start;

    nout = (size_t)ql * H * dv;
    nsc = fx_attend_scratch_floats(&a);
    out = alloc_f(nout, PAD);
    sc = alloc_f(nsc, PAD);
    for (i = 0; i < nout; i++) out[i] = NAN;
    for (i = 0; i < nsc; i++) sc[i] = NAN;

    if (batch_threads) {
        if (fx_attend_batch(&kv, &tc->start, 1, &a, q, 0, out, 0, batch_threads) < 0) {
            printf("FAIL %s: fx_attend_batch could not allocate\n", what);
            ok = 0;
        }
    } else {
        fx_attend(&kv, &a, q, out, sc);
    }

    if (!canary_ok(out, nout, PAD) || !canary_ok(sc, nsc, PAD)) {
        printf("FAIL %s: wrote past out/scratch\n", what);
        ok = 0;
    }

    {
        double *s = malloc(sizeof(double) * (size_t)len), *ref = malloc(sizeof(double) * (size_t)dv);
        for (t = 0; t < ql && ok; t++) {
            const ptrdiff_t p = len - ql + t;
            ptrdiff_t lo = tc->start, r;
            int j, d;
            if (tc->window > 0 && p - tc->window + 1 > lo) lo = p - tc->window + 1;
            for (j = 0; j < H && ok; j++) {
                const int g = j / G;
                const float *qq = qref + ((size_t)t * H + j) * hd;
                const float *o = out + ((size_t)t * H + j) * dv;
                double m = -INFINITY, l = 0, A = 0, sabs = 0;
                if (lo > p) { /* sees nothing: exact zeros */
                    for (d = 0; d < dv; d++)
                        if (o[d] != 0.0f) { ok = 0; printf("FAIL %s: t=%td j=%d expected zeros, got %g\n", what, t, j, o[d]); break; }
                    continue;
                }
                /* SDPA's rules fall out of float64: NaN scores are NaN, +inf
                   gives inf - inf, all -inf gives -inf - -inf */
                for (r = lo; r <= p; r++) {
                    const float *kr = table ? k + (size_t)table[r / tc->bs] * kfb + (size_t)(r % tc->bs) * k_row
                                            : k + (size_t)r * k_row;
                    double acc = 0, aacc = 0;
                    for (d = 0; d < hd; d++) {
                        acc += (double)qq[d] * kr[g * hd + d];
                        aacc += fabs((double)qq[d] * kr[g * hd + d]);
                    }
                    s[r] = acc * a.scale;
                    if (isfinite(aacc * a.scale) && fabs(aacc * a.scale) > sabs) sabs = fabs(aacc * a.scale);
                    if (s[r] > m) m = s[r];
                }
                for (d = 0; d < dv; d++) ref[d] = 0;
                {
                    double *absacc = calloc((size_t)dv, sizeof(double));
                    for (r = lo; r <= p; r++) {
                        const float *vr = table ? v + (size_t)table[r / tc->bs] * vfb + (size_t)(r % tc->bs) * v_row
                                                : v + (size_t)r * v_row;
                        const double w = exp(s[r] - m);
                        l += w;
                        for (d = 0; d < dv; d++) {
                            ref[d] += w * vr[g * dv + d];
                            absacc[d] += w * fabs(vr[g * dv + d]);
                        }
                    }
                    for (d = 0; d < dv; d++) if (absacc[d] / l > A) A = absacc[d] / l;
                    free(absacc);
                }
                /* the huge-scale cases have exact scores: the float32 rounding term does not apply */
                tol = RTOL + (tc->exact ? 0.0 : 2.0 * ldexp(1.0, -24) * sqrt((double)hd) * sabs);
                for (d = 0; d < dv; d++) {
                    const double want = ref[d] / l;
                    const double e = fabs(o[d] - want) / (A > 0 ? A : 1.0);
                    if (!isfinite(want) || !isfinite(o[d])) { /* NaN for NaN, the same inf for inf */
                        if (isnan(want) != isnan(o[d]) || (!isnan(want) && want != o[d])) {
                            printf("FAIL %s: t=%td j=%d d=%d got %.9g want %.9g (NaN rule)\n", what, t, j, d, o[d], want);
                            ok = 0;
                            break;
                        }
                        continue;
                    }
                    if (!(e <= tol)) {
                        printf("FAIL %s: t=%td j=%d d=%d got %.9g want %.9g (rel %.3g)\n", what, t, j, d, o[d], want, e);
                        ok = 0;
                        break;
                    }
                    if (e > maxerr) maxerr = e;
                    if (e / tol > maxratio) maxratio = e / tol;
                }
            }
        }
        free(s);
        free(ref);
    }
    if (maxerr > worst && tc->qmag <= 1) worst = maxerr;
    if (maxerr > worst_large && tc->qmag > 1) worst_large = maxerr;
    if (maxratio > worst_ratio) worst_ratio = maxratio;
    n_run++;
    if (!ok) n_fail++;
    free(k); free(v); free(ks); free(vs); free(q); free(qref); free(out); free(sc); free(table); free(perm);
    return ok;
}

/* the NaN/inf rules and huge scales, for one dtype and layout */
static void special_cases(int dt, int bs)
{
    static const float vals[] = {NAN, INFINITY, -INFINITY};
    char what[256];
    tcase tc;
    int vi, inj;
    for (inj = INJ_Q; inj <= INJ_K_HEAD; inj++)
        for (vi = 0; vi < 3; vi++) {
            memset(&tc, 0, sizeof tc);
            tc.dt = dt; tc.bs = bs; tc.H = 8; tc.Hkv = 2; tc.hd = 64; tc.dv = 64; tc.qmag = 1; tc.kmag = 1;
            tc.len = 70; tc.q_len = 5; tc.inj = inj; tc.inj_val = vals[vi]; tc.inj_row = 66; /* seen by the last 4 queries */
            snprintf(what, sizeof what, "%s %s=%g bs=%d", dt_name[dt],
                     inj == INJ_Q ? "q" : inj == INJ_K ? "k row" : inj == INJ_V ? "v row" : "every k row", vals[vi], bs);
            run_case(&tc, what);
            tc.H = 4; /* 2 query heads per kv head: a tile holds 2 positions, one of which does not see the row */
            snprintf(what, sizeof what, "%s %s=%g bs=%d G=2", dt_name[dt],
                     inj == INJ_Q ? "q" : inj == INJ_K ? "k row" : inj == INJ_V ? "v row" : "every k row", vals[vi], bs);
            run_case(&tc, what);
            tc.q_len = 40; tc.window = 30; tc.inj_row = 45; /* prefill, packed: some queries do not see it */
            tc.H = 32; tc.Hkv = 1;
            snprintf(what, sizeof what, "%s %s=%g bs=%d prefill", dt_name[dt],
                     inj == INJ_Q ? "q" : inj == INJ_K ? "k row" : inj == INJ_V ? "v row" : "every k row", vals[vi], bs);
            run_case(&tc, what);
        }
    {
        static const float scales[] = {1e38f, -1e38f, 3.4e38f, -3.4e38f, 1e30f, 2.0f, 0.0f};
        size_t si;
        for (si = 0; si < sizeof scales / sizeof scales[0]; si++) {
            memset(&tc, 0, sizeof tc);
            tc.dt = dt; tc.bs = bs; tc.H = 8; tc.Hkv = 2; tc.hd = 16; tc.dv = 16; tc.qmag = 1; tc.kmag = 1;
            tc.exact = 1; tc.len = 100; tc.q_len = 3; tc.scale = scales[si];
            if (scales[si] == 0.0f) tc.scale = 1e-38f;
            snprintf(what, sizeof what, "%s scale %g exact scores bs=%d", dt_name[dt], tc.scale, bs);
            run_case(&tc, what);
        }
    }
}

static void exp_test(void)
{
    double max_rel_v = 0, max_rel_s = 0;
    float ys[8], rs[8];
    int i, l;
    for (i = 0; i <= 2000000; i += 8) {
        for (l = 0; l < 8; l++) ys[l] = -125.0f * (float)(i + l > 2000000 ? 2000000 : i + l) / 2000000.0f;
        fxa_store(rs, fxa_exp2(fxa_load(ys)));
        for (l = 0; l < 8; l++) {
            const double want = exp2((double)ys[l]);
            const double ev = fabs(rs[l] - want) / want, es = fabs(fxa_exp2f(ys[l]) - want) / want;
            if (ev > max_rel_v) max_rel_v = ev;
            if (es > max_rel_s) max_rel_s = es;
        }
    }
    {
        const float special[8] = {-125.5f, -126.0f, -1000.0f, -INFINITY, NAN, 0.0f, -0.0f, -1e30f};
        const float want[8] = {0, 0, 0, 0, NAN, 1, 1, 0}; /* NaN stays NaN */
        fxa_store(rs, fxa_exp2(fxa_load(special)));
        for (l = 0; l < 8; l++)
            if (l == 4 ? !(isnan(rs[l]) && isnan(fxa_exp2f(special[l])))
                       : rs[l] != want[l] || fxa_exp2f(special[l]) != want[l]) {
                printf("FAIL exp2 special %g: vec %g scalar %g\n", special[l], rs[l], fxa_exp2f(special[l]));
                n_fail++;
            }
    }
    printf("exp2 on [-125, 0]: max rel err vector %.3g, scalar %.3g\n", max_rel_v, max_rel_s);
    if (max_rel_v > 3e-7 || max_rel_s > 3e-7) { printf("FAIL exp2 accuracy\n"); n_fail++; }
}

#ifdef TEST_SPLIT
/* fx_attend_batch_in with the caller's work memory: sized by
   fx_attend_batch_work it gives fx_attend_batch's bits; short of the split's
   size but not of the caller-alone plan (exactly that much), it runs alone
   and gives fx_attend's; short of that too, -1 with out untouched.  Each
   buffer is exactly work_bytes long with a canary after it. */
static void work_memory_cases(void)
{
    const int H = 8, Hkv = 2, hd = 64;
    const ptrdiff_t len = 2000;
    const size_t row = (size_t)Hkv * hd, nout = (size_t)H * hd;
    float *k = malloc(sizeof(float) * row * (size_t)len), *v = malloc(sizeof(float) * row * (size_t)len);
    float *q = malloc(sizeof(float) * nout), *want = malloc(sizeof(float) * nout), *got = alloc_f(nout, PAD);
    float *sc, *work;
    fx_kv kv;
    fx_attn_args a;
    size_t i, split, alone;
    int rc, ok = 1;
    for (i = 0; i < row * (size_t)len; i++) k[i] = rng_uni(), v[i] = rng_uni();
    for (i = 0; i < nout; i++) q[i] = rng_uni();
    memset(&kv, 0, sizeof kv);
    kv.k = k; kv.v = v; kv.k_row = kv.v_row = row * sizeof(float); kv.len = len; kv.dtype = FX_F32;
    memset(&a, 0, sizeof a);
    a.n_kv_heads = Hkv; a.head_dim = a.v_head_dim = hd; a.n_heads = H; a.q_len = 1; a.scale = 0.125f;
    split = fx_attend_batch_work(&kv, NULL, 1, &a, 3);
    alone = fx_attend_batch_work(&kv, NULL, 1, &a, 1);
    n_run++;
    if (split <= alone || split % sizeof(float) || alone % sizeof(float)) {
        printf("FAIL work memory: the split needs %zu bytes, alone %zu\n", split, alone);
        ok = 0;
    }
    /* sized for the split: fx_attend_batch's bits */
    work = alloc_f(split / sizeof(float), PAD);
    fx_attend_batch(&kv, NULL, 1, &a, q, 0, want, 0, 3);
    rc = fx_attend_batch_in(&kv, NULL, 1, &a, q, 0, got, 0, 3, work, split);
    if (rc != 3 || memcmp(got, want, sizeof(float) * nout) != 0 || !canary_ok(work, split / sizeof(float), PAD)) {
        printf("FAIL work memory: sized, rc %d\n", rc);
        ok = 0;
    }
    free(work);
    /* exactly the caller-alone size: one thread, fx_attend's bits */
    work = alloc_f(alone / sizeof(float), PAD);
    sc = malloc(sizeof(float) * fx_attend_scratch_floats(&a));
    fx_attend(&kv, &a, q, want, sc);
    rc = fx_attend_batch_in(&kv, NULL, 1, &a, q, 0, got, 0, 3, work, alone);
    if (rc != 1 || memcmp(got, want, sizeof(float) * nout) != 0 || !canary_ok(work, alone / sizeof(float), PAD)) {
        printf("FAIL work memory: alone, rc %d\n", rc);
        ok = 0;
    }
    /* short of both: -1, out untouched */
    for (i = 0; i < nout; i++) got[i] = NAN;
    rc = fx_attend_batch_in(&kv, NULL, 1, &a, q, 0, got, 0, 3, work, alone - sizeof(float));
    for (i = 0; i < nout && rc == -1; i++)
        if (got[i] == got[i]) rc = -2;
    if (rc != -1 || !canary_ok(got, nout, PAD)) {
        printf("FAIL work memory: too short, rc %d\n", rc);
        ok = 0;
    }
    if (!ok) n_fail++;
    printf("work memory: split %zu bytes, alone %zu: %s\n", split, alone, ok ? "ok" : "FAIL");
    free(k); free(v); free(q); free(want); free(got); free(sc); free(work);
}
#endif

int conv_tests(void); /* test_conv.c */
int pf_tests(void);   /* test_pf.c */

int main(void)
{
    static const int gqa[][2] = {{8, 8}, {16, 4}, {32, 4}, {16, 2}, {8, 1}, {32, 1}}; /* H, Hkv */
    static const int dims[][2] = {{64, 64}, {80, 80}, {96, 96}, {128, 128}, {192, 128}, {20, 12}, {8, 16}};
    static const int bss[] = {0, 1, 7, 16, 32};
    static const ptrdiff_t lens[] = {1, 5, 16, 33, 100, 257};
    char what[256];
    size_t gi, di, bi, li;
    tcase tc;
    int dt, sub, wpass, n_names = 0, i8_only = 0;
    const char *names[5], *i8names[5];
    fx_attn_args probe;
#ifdef TEST_ALL_LEVELS
    static const int paths[][3] = {{4, 16, 1}, {4, 16, 0}, {3, 8, 1}, {0, 8, 1}}; /* (max level, max width, VNNI) */
#else
    static const int paths[][3] = {{4, 16, 1}, {4, 16, 0}, {3, 8, 1}};
#endif

    printf("simd path: %s; %s, %s, %s, %s, %s\n", fx_attend_simd_path(), fx_attend_load_path(FX_F32),
           fx_attend_load_path(FX_F16), fx_attend_load_path(FX_BF16), fx_attend_load_path(FX_I8),
           fx_attend_load_path(FX_I4));
    memset(&probe, 0, sizeof probe);
    probe.head_dim = probe.v_head_dim = 16;
    exp_test();
    n_fail += conv_tests();
    n_fail += pf_tests();

    /* every code path this build can run on this CPU runs every case: the
       levels' instantiations (x86-64-v4 on 16-float vectors, with and
       without VNNI for int8, v3, and with TEST_ALL_LEVELS the baseline too)
       and, without dispatch, both widths */
#ifdef TEST_SPLIT
#define N_PASSES ((int)(sizeof paths / sizeof paths[0]) + 1)
#else
#define N_PASSES ((int)(sizeof paths / sizeof paths[0]))
#endif
    for (wpass = 0; wpass < N_PASSES; wpass++) {
    /* with TEST_SPLIT, a last pass: the first path again, through
       fx_attend_batch on 3 threads with the split forced, float32, int8 and int4 */
    batch_threads = wpass == (int)(sizeof paths / sizeof paths[0]) ? 3 : 0;
    if (batch_threads) {
        fx_workers_set(3);
        fx_attend_set_split(0, 1);
        fx_attend_set_max_level(paths[0][0]);
        fx_attend_set_max_width(paths[0][1]);
        fx_attend_set_vnni(paths[0][2]);
        i8_only = 0;
        printf("split over %d threads: %s\n", batch_threads, fx_attend_simd_path());
    } else {
        int k, seen = 0;
        fx_attend_set_max_level(paths[wpass][0]);
        fx_attend_set_max_width(paths[wpass][1]);
        fx_attend_set_vnni(paths[wpass][2]);
        for (k = 0; k < n_names; k++)
            seen |= strcmp(names[k], fx_attend_simd_path()) == 0 && strcmp(i8names[k], fx_attend_load_path(FX_I8)) == 0;
        if (seen) continue;
        names[n_names] = fx_attend_simd_path();
        i8names[n_names++] = fx_attend_load_path(FX_I8);
        i8_only = !paths[wpass][2]; /* VNNI off changes int8 alone */
    printf("path: %s (16-float vectors where head dims allow: %s)%s\n", fx_attend_simd_path(),
           fx_attend_width(&probe) == 16 ? "yes" : "no", i8_only ? ", int8 only: VNNI off" : "");
    }
    /* the split pass: float32, int8 and rotated int4 */
    for (dt = i8_only ? FX_I8 : FX_F32; dt <= (i8_only ? FX_I8 : FX_I4H);
         dt = !batch_threads ? dt + 1 : dt == FX_F32 ? FX_I8 : dt == FX_I8 ? FX_I4H : FX_I4H + 1) {
    /* float32: every combination; the other dtypes: every third (each value of each axis still occurs) */
    sub = dt == FX_F32 ? 1 : 3;

    /* decode sweep: GQA x dims x layouts x lengths */
    for (gi = 0; gi < sizeof gqa / sizeof gqa[0]; gi++)
        for (di = 0; di < sizeof dims / sizeof dims[0]; di++)
            for (bi = 0; bi < sizeof bss / sizeof bss[0]; bi++)
                for (li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                    if ((gi + di + bi + li) % (size_t)sub) continue;
                    memset(&tc, 0, sizeof tc);
                    tc.dt = dt;
                    tc.H = gqa[gi][0]; tc.Hkv = gqa[gi][1]; tc.hd = dims[di][0]; tc.dv = dims[di][1];
                    tc.len = lens[li]; tc.q_len = 1; tc.bs = bss[bi]; tc.qmag = 1; tc.kmag = 1;
                    tc.row_pad = bi == 0 ? 8 : 0;
                    snprintf(what, sizeof what, "%s decode H=%d Hkv=%d hd=%d dv=%d bs=%d len=%td", dt_name[dt], tc.H,
                             tc.Hkv, tc.hd, tc.dv, tc.bs, tc.len);
                    run_case(&tc, what);
                }

    /* q_len > 1: causal, windows, left padding (some queries see nothing) */
    {
        static const ptrdiff_t qls[] = {2, 3, 5, 8, 17, 31, 64};
        static const ptrdiff_t wins[] = {0, 1, 4, 13, 50};
        static const ptrdiff_t starts[] = {0, 3, 40};
        size_t qi, wi, si;
        for (qi = 0; qi < sizeof qls / sizeof qls[0]; qi++)
            for (wi = 0; wi < sizeof wins / sizeof wins[0]; wi++)
                for (si = 0; si < sizeof starts / sizeof starts[0]; si++)
                    for (gi = 0; gi < 6; gi += 2)
                        for (bi = 0; bi < 4; bi += 1) {
                            if ((qi + wi + si + gi / 2 + bi) % (size_t)sub) continue;
                            memset(&tc, 0, sizeof tc);
                            tc.dt = dt;
                            tc.H = gqa[gi][0]; tc.Hkv = gqa[gi][1];
                            tc.hd = qi % 2 ? 64 : 80; tc.dv = tc.hd;
                            tc.q_len = qls[qi]; tc.len = qls[qi] + (ptrdiff_t)(qi * 11 % 70);
                            tc.window = wins[wi]; tc.start = starts[si];
                            if (tc.start >= tc.len) tc.start = tc.len - 1;
                            tc.bs = bss[bi]; tc.qmag = 1; tc.kmag = 1; tc.scale = 0.5f;
                            snprintf(what, sizeof what, "%s prefill H=%d Hkv=%d hd=%d q_len=%td len=%td win=%td start=%td bs=%d",
                                     dt_name[dt], tc.H, tc.Hkv, tc.hd, tc.q_len, tc.len, tc.window, tc.start, tc.bs);
                            run_case(&tc, what);
                        }
    }

    /* explicit edge cases */
    memset(&tc, 0, sizeof tc);
    tc.dt = dt;
    tc.H = 8; tc.Hkv = 2; tc.hd = 64; tc.dv = 64; tc.qmag = 1; tc.kmag = 1; tc.bs = 7;
    tc.len = 40; tc.q_len = 20; tc.start = 30; /* queries at p < 30 see nothing */
    run_case(&tc, "left padding: first 10 queries see nothing");
    tc.len = 50; tc.q_len = 50; tc.start = 0; tc.window = 1; /* each query sees only itself */
    run_case(&tc, "window=1 full prefill");
    tc.len = 300; tc.q_len = 1; tc.window = 0; tc.start = 299;
    run_case(&tc, "start = last row");
    tc.q_len = 4; tc.start = 305; /* nothing visible at all */
    tc.inj = INJ_Q; tc.inj_val = NAN; /* a NaN query that sees nothing still gets zeros */
    run_case(&tc, "start past the end: all zeros");

    /* every value +-1 (int8: +-127 stored and quantised, the integer dot's
       largest pair sums), a head dim with a short last group too */
    memset(&tc, 0, sizeof tc);
    tc.dt = dt;
    tc.H = 8; tc.Hkv = 2; tc.hd = 128; tc.dv = 64; tc.qmag = 1; tc.kmag = 1; tc.signs = 1; tc.bs = 16;
    tc.len = 90; tc.q_len = 1; tc.scale = 0.05f;
    run_case(&tc, "every value +-1, decode");
    tc.hd = 80; tc.q_len = 3;
    run_case(&tc, "every value +-1, head dim 80, 3 queries");

    /* large-magnitude scores: |q.k| ~ 1e4 (and 1e6 with scale 1) */
    for (bi = 0; bi < sizeof bss / sizeof bss[0]; bi++) {
        memset(&tc, 0, sizeof tc);
        tc.dt = dt;
        tc.H = 32; tc.Hkv = 8; tc.hd = 128; tc.dv = 128; tc.bs = bss[bi];
        tc.len = 333; tc.q_len = 3; tc.qmag = 30; tc.kmag = 30; tc.scale = 1.0f; /* q.k ~ 1e4 */
        snprintf(what, sizeof what, "%s large scores 1e4 bs=%d", dt_name[dt], tc.bs);
        run_case(&tc, what);
        tc.qmag = 300; tc.kmag = 300; tc.q_len = 17; tc.window = 100; /* ~1e6 */
        snprintf(what, sizeof what, "%s large scores 1e6 bs=%d", dt_name[dt], tc.bs);
        run_case(&tc, what);
    }

    /* a longer context with chunks spanning many blocks */
    memset(&tc, 0, sizeof tc);
    tc.dt = dt;
    tc.H = 32; tc.Hkv = 8; tc.hd = 128; tc.dv = 128; tc.bs = 16; tc.len = 3001; tc.q_len = 1;
    tc.qmag = 1; tc.kmag = 1;
    snprintf(what, sizeof what, "%s decode len 3001 bs 16", dt_name[dt]);
    run_case(&tc, what);
    tc.q_len = 70; tc.window = 500;
    snprintf(what, sizeof what, "%s prefill 70 over 3001 window 500", dt_name[dt]);
    run_case(&tc, what);

    /* SDPA's numeric rules */
    special_cases(dt, 0);
    special_cases(dt, 16);
    }
    }

#ifdef TEST_SPLIT
    work_memory_cases(); /* the split's knobs as its pass left them: 3 workers, 1-row chunks */
#endif
    printf("large-magnitude cases: worst err/A %.3g\n", worst_large);
    printf("%d cases, %d failed; ordinary cases: worst err/A %.3g (rtol %.0e); all cases: worst err/tol %.3g\n",
           n_run, n_fail, worst, RTOL, worst_ratio);
    return n_fail ? 1 : 0;
}
