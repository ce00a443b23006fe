/* bench_attn.c -- single-thread timing of fx_attend against a read floor.
 *
 * Geometry (defaults): 32 query heads, 8 KV heads, head_dim 128, paged with
 * block size 16 and a shuffled block table; decode (q_len 1) at contexts
 * 512, 2048, 8192, then q_len 256 causal over 2048 (report only).
 * Variants, interleaved in every round so ratios come from one run:
 *   floor   read every K/V float once (vector sum, v3 clone)
 *   shipped fx_attend as dispatched on this CPU
 *   base    fx_attend capped to the x86-64 baseline (SSE2) instantiation
 *   v3      fx_attend capped to x86-64-v3 on 8-float vectors
 * Each figure: best over ROUNDS rounds of (mean of REPS calls).
 * K/V buffers come from the library's arena allocator (fx_big_alloc: 2 MiB
 * aligned, advised for huge pages), so rows sit on the pages a pool's do.
 * Usage: bench_attn [rounds] [paged|contig] [ctx:q_len[:H:Hkv:head_dim] ...]
 *        bench_attn exp      (exp approximation vs libm expf)
 *        bench_attn dtypes [rounds] [ctx ...]   (every storage dtype, decode:
 *                             attend vs its read floor and vs float32)
 *        bench_attn split [rounds] [threads] [ctx ...]   (a float32 decode
 *                             split by fx_attend_batch over 1 and N threads,
 *                             calls back to back and 1 ms apart)
 *   default: 30 paged 512:1 2048:1 8192:1 2048:256
 */
#define _DEFAULT_SOURCE /* clock_gettime, nanosleep, and MAP_ANONYMOUS for _fx.h */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_attn_kernel.h" /* the tuning knobs it prints */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-variable" /* the module's build strings and registry lock */
#include "_fx.h" /* fx_big_alloc: K/V on the pages the library's arenas get */
#pragma GCC diagnostic pop
#include "_workers.h"

void clones_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);
void base_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);
void v3_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch);
const char *clones_path(void), *base_path(void), *v3_path(void);
size_t clones_scratch(const fx_attn_args *a), base_scratch(const fx_attn_args *a), v3_scratch(const fx_attn_args *a);
float clones_floor(const fx_kv *kv, int nblocks);
void clones_exp2v(const float *x, float *y, size_t n);
void clones_expf(const float *x, float *y, size_t n);
const char *clones_load_path(int dtype);
void clones_from_f32(void *dst, size_t dst_row, const float *src, size_t src_row, ptrdiff_t n, int h, int d, int dt);
#define v3_floor clones_floor

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t rs = 88172645463325252ull;
static float rnd(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return (float)((rs >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

volatile float sink;

enum { V_FLOOR, V_CLONES, V_BASE, V_V3, NV };
static const char *vname[NV] = {"floor", "shipped", "base(sse2)", "v3(8-float)"};

/* Every mode's data and call: k and v n random floats each, q q_len
   positions of H x hd, table a shuffled order of nblocks blocks, a the
   call's arguments (every field beyond the shape and scale zero: the whole
   call, not a split part). */
static void attn_setup(float *k, float *v, size_t n, float *q, ptrdiff_t q_len, int32_t *table, int nblocks,
                       fx_attn_args *a, int H, int Hkv, int hd)
{
    size_t i;
    for (i = 0; i < n; i++) { k[i] = rnd(); v[i] = rnd(); }
    for (i = 0; i < (size_t)q_len * H * hd; i++) q[i] = rnd();
    for (i = 0; i < (size_t)nblocks; i++) table[i] = (int32_t)i;
    for (i = (size_t)nblocks - 1; i > 0; i--) {
        size_t j = (size_t)(rs % (i + 1));
        int32_t x = table[i]; table[i] = table[j]; table[j] = x;
        rnd();
    }
    memset(a, 0, sizeof *a);
    a->n_kv_heads = Hkv; a->head_dim = hd; a->v_head_dim = hd; a->n_heads = H; a->q_len = q_len;
    a->scale = 1.0f / sqrtf((float)hd);
}

static void run(ptrdiff_t ctx, ptrdiff_t q_len, int contig, int rounds, int H, int Hkv, int hd)
{
    const int bs = 16;
    const int nblocks = (int)(ctx / bs);
    const size_t row = (size_t)Hkv * hd;
    const size_t kvb = sizeof(float) * (size_t)ctx * row;
    float *k = fx_big_alloc(kvb, 0), *v = fx_big_alloc(kvb, 0);
    float *q = malloc(sizeof(float) * (size_t)q_len * H * hd), *out[NV];
    int32_t *table = malloc(sizeof(int32_t) * (size_t)nblocks);
    fx_kv kv;
    fx_attn_args a;
    float *sc;
    double best[NV];
    size_t i;
    int r, w, reps;

    attn_setup(k, v, (size_t)ctx * row, q, q_len, table, nblocks, &a, H, Hkv, hd);
    kv.k = k; kv.v = v; kv.table = contig ? NULL : table; kv.block_size = bs;
    kv.k_block = kv.v_block = (size_t)bs * row * 4; kv.k_row = kv.v_row = row * 4; kv.len = ctx;
    kv.dtype = FX_F32;
    {
        size_t n1 = clones_scratch(&a), n2 = base_scratch(&a), n3 = v3_scratch(&a);
        n1 = n1 > n2 ? n1 : n2;
        sc = malloc(sizeof(float) * (n1 > n3 ? n1 : n3));
    }
    for (w = 0; w < NV; w++) { out[w] = calloc((size_t)q_len * H * hd, sizeof(float)); best[w] = 1e30; }

    /* calls per timed batch: ~2 ms worth */
    {
        double t0 = now();
        clones_attend(&kv, &a, q, out[V_CLONES], sc);
        reps = (int)(2e-3 / (now() - t0 + 1e-9));
        if (reps < 1) reps = 1;
        if (reps > 2000) reps = 2000;
    }
    for (r = 0; r < rounds; r++)
        for (int wi = 0; wi < NV; wi++) {
            const int w = (wi + r) % NV; /* rotate the order: no variant always follows the same one */
            double t0 = now(), dt;
            int j;
            for (j = 0; j < reps; j++) {
                switch (w) {
                case V_FLOOR: sink += v3_floor(&kv, contig ? 1 : nblocks); break;
                case V_CLONES: clones_attend(&kv, &a, q, out[w], sc); break;
                case V_BASE: base_attend(&kv, &a, q, out[w], sc); break;
                case V_V3: v3_attend(&kv, &a, q, out[w], sc); break;
                }
            }
            dt = (now() - t0) / reps;
            if (dt < best[w]) best[w] = dt;
        }
    {
        double md = 0;
        for (w = V_BASE; w < NV; w++)
            for (i = 0; i < (size_t)q_len * H * hd; i++) {
                double d = fabs(out[w][i] - out[V_CLONES][i]);
                if (d > md) md = d;
            }
        printf("%-6s ctx %5td q_len %3td H %d Hkv %d hd %d %s (%.1f MiB K+V; variants agree to %.1e)\n",
               contig ? "contig" : "paged", ctx, q_len, H, Hkv, hd, contig ? "" : "bs 16 shuffled",
               2.0 * ctx * row * 4 / 1048576.0, md);
    }
    for (w = 0; w < NV; w++)
        printf("   %-11s %10.1f us  %6.2fx floor  %6.1f GB/s\n", vname[w], best[w] * 1e6, best[w] / best[V_FLOOR],
               2.0 * ctx * row * 4 / best[w] * 1e-9);
    fflush(stdout);
    for (w = 0; w < NV; w++) free(out[w]);
    fx_big_free(k, kvb); fx_big_free(v, kvb); free(q); free(table); free(sc);
}

/* ns per element: fxa_exp2 (clones build) vs libm expf, on 4096 scores - max */
static void exp_bench(void)
{
    enum { N = 4096 };
    static float x[N], y1[N], y2[N];
    double best1 = 1e30, best2 = 1e30, maxrel = 0;
    int i, r, j;
    for (i = 0; i < N; i++) x[i] = -30.0f * (rnd() + 1.0f) * 0.5f; /* [-30, 0] */
    for (r = 0; r < 200; r++) {
        double t0 = now(), t1;
        for (j = 0; j < 50; j++) clones_exp2v(x, y1, N);
        t1 = now();
        if ((t1 - t0) / (50.0 * N) < best1) best1 = (t1 - t0) / (50.0 * N);
        t0 = now();
        for (j = 0; j < 50; j++) clones_expf(x, y2, N);
        t1 = now();
        if ((t1 - t0) / (50.0 * N) < best2) best2 = (t1 - t0) / (50.0 * N);
    }
    for (i = 0; i < N; i++) {
        const double want = exp2((double)x[i]), e = fabs(y1[i] - want) / want;
        if (e > maxrel) maxrel = e;
    }
    printf("exp: fxa_exp2 (8 lanes, clones) %.3f ns/elem, libm expf %.3f ns/elem (%.1fx); fxa_exp2 max rel err %.2g\n",
           best1 * 1e9, best2 * 1e9, best2 / best1, maxrel);
}

/* EVICT=1 in the environment: run_dtypes times single calls, each after a
   read of 1 GiB (more than this VM's 480 MiB L3), so K/V come from memory. */
static int evict;
static void evict_caches(void)
{
    static float *buf;
    const size_t n = (size_t)1 << 28;
    size_t i;
    float s = 0;
    if (!buf) {
        buf = malloc(n * sizeof(float));
        for (i = 0; i < n; i++) buf[i] = 1.0f;
    }
    for (i = 0; i < n; i += 16) s += buf[i];
    sink += s;
}

/* Every dtype at one context, paged (bs 16, shuffled), decode: per dtype a
   read floor over its stored bytes and fx_attend (clones), and int8 again
   with VNNI off (fx_attend_set_vnni), all 10 variants interleaved in every
   round.  Reports attend/floor per dtype and each dtype's attend against
   float32's. */
static void run_dtypes(ptrdiff_t ctx, int rounds, int H, int Hkv, int hd)
{
    static const char *dn[5] = {"float32", "float16", "bfloat16", "int8", "int8 -vnni"};
    const int bs = 16, nblocks = (int)(ctx / bs);
    const size_t row = (size_t)Hkv * hd;
    const size_t kvb = sizeof(float) * (size_t)ctx * row;
    float *k = fx_big_alloc(kvb, 0), *v = fx_big_alloc(kvb, 0);
    float *q = malloc(sizeof(float) * (size_t)H * hd), *out = malloc(sizeof(float) * (size_t)H * hd), *sc;
    int32_t *table = malloc(sizeof(int32_t) * (size_t)nblocks);
    char *ks[4], *vs[4];
    fx_kv kv[5];
    fx_attn_args a;
    double best[10];
    int r, w, reps, dt;
    attn_setup(k, v, (size_t)ctx * row, q, 1, table, nblocks, &a, H, Hkv, hd);
    for (dt = 0; dt < 4; dt++) {
        const size_t rb = fx_row_bytes(Hkv, hd, dt);
        ks[dt] = fx_big_alloc(rb * (size_t)ctx, 0);
        vs[dt] = fx_big_alloc(rb * (size_t)ctx, 0);
        clones_from_f32(ks[dt], rb, k, row, ctx, Hkv, hd, dt);
        clones_from_f32(vs[dt], rb, v, row, ctx, Hkv, hd, dt);
        kv[dt].k = ks[dt]; kv[dt].v = vs[dt]; kv[dt].table = table; kv[dt].block_size = bs;
        kv[dt].k_block = kv[dt].v_block = (size_t)bs * rb; kv[dt].k_row = kv[dt].v_row = rb;
        kv[dt].len = ctx; kv[dt].dtype = dt;
    }
    kv[4] = kv[3];
    sc = malloc(sizeof(float) * clones_scratch(&a));
    for (w = 0; w < 10; w++) best[w] = 1e30;
    {
        double t0 = now();
        clones_attend(&kv[0], &a, q, out, sc);
        reps = (int)(2e-3 / (now() - t0 + 1e-9));
        if (reps < 1) reps = 1;
        if (reps > 2000) reps = 2000;
    }
    if (evict) reps = 1;
    for (r = 0; r < rounds; r++)
        for (int wi = 0; wi < 10; wi++) {
            const int w2 = (wi + r) % 10, d2 = w2 / 2; /* even: floor, odd: attend */
            const int vnni = fx_attend_set_vnni(d2 != 4);
            double t0, dtm;
            int j;
            if (evict) evict_caches();
            t0 = now();
            for (j = 0; j < reps; j++) {
                if (w2 % 2 == 0) sink += clones_floor(&kv[d2], nblocks);
                else clones_attend(&kv[d2], &a, q, out, sc);
            }
            dtm = (now() - t0) / reps;
            fx_attend_set_vnni(vnni);
            if (dtm < best[w2]) best[w2] = dtm;
        }
    printf("dtypes: paged decode ctx %td H %d Hkv %d hd %d bs 16 shuffled, best of %d rounds\n", ctx, H, Hkv, hd, rounds);
    for (dt = 0; dt < 5; dt++) {
        const int sdt = dt < 4 ? dt : FX_I8;
        const double mb = 2.0 * (double)fx_row_bytes(Hkv, hd, sdt) * (double)ctx / 1048576.0;
        const int vnni = fx_attend_set_vnni(dt != 4);
        printf("   %-10s %6.2f MiB  floor %8.1f us  attend %8.1f us  attend/floor %5.2f  attend vs float32 %5.2f  (%s)\n",
               dn[dt], mb, best[2 * dt] * 1e6, best[2 * dt + 1] * 1e6, best[2 * dt + 1] / best[2 * dt],
               best[2 * dt + 1] / best[1], clones_load_path(sdt));
        fx_attend_set_vnni(vnni);
    }
    fflush(stdout);
    for (dt = 0; dt < 4; dt++) {
        fx_big_free(ks[dt], fx_row_bytes(Hkv, hd, dt) * (size_t)ctx);
        fx_big_free(vs[dt], fx_row_bytes(Hkv, hd, dt) * (size_t)ctx);
    }
    fx_big_free(k, kvb); fx_big_free(v, kvb); free(q); free(out); free(table); free(sc);
}

/* One float32 decode (paged, bs 16, shuffled) through fx_attend_batch at
   1 and at `threads` threads, calls back to back and with a 1 ms pause
   before each (the pool's threads then block between calls, as between a
   model's layers); the four variants interleaved in every round. */
static void run_split(ptrdiff_t ctx, int rounds, int threads)
{
    const int H = 32, Hkv = 8, hd = 128, bs = 16, nblocks = (int)(ctx / bs);
    const size_t row = (size_t)Hkv * hd;
    const size_t kvb = sizeof(float) * (size_t)ctx * row;
    float *k = fx_big_alloc(kvb, 0), *v = fx_big_alloc(kvb, 0);
    float *q = malloc(sizeof(float) * (size_t)H * hd), *out = malloc(sizeof(float) * (size_t)H * hd);
    int32_t *table = malloc(sizeof(int32_t) * (size_t)nblocks);
    const struct timespec pause = {0, 1000000};
    fx_kv kv;
    fx_attn_args a;
    double best[4] = {1e30, 1e30, 1e30, 1e30};
    int r, w, j, reps;
    attn_setup(k, v, (size_t)ctx * row, q, 1, table, nblocks, &a, H, Hkv, hd);
    kv.k = k; kv.v = v; kv.table = table; kv.block_size = bs;
    kv.k_block = kv.v_block = (size_t)bs * row * sizeof(float); kv.k_row = kv.v_row = row * sizeof(float);
    kv.len = ctx; kv.dtype = FX_F32;
    fx_workers_set(threads);
    reps = (int)(400000 / ctx) + 1;
    for (r = 0; r < rounds; r++)
        for (w = 0; w < 4; w++) {
            const int th = w % 2 ? threads : 1, gap = w >= 2;
            double t = 0.0;
            for (j = 0; j < reps; j++) {
                double t0;
                if (gap) nanosleep(&pause, NULL);
                t0 = now();
                fx_attend_batch(&kv, NULL, 1, &a, q, 0, out, 0, th);
                t += now() - t0;
            }
            if (t / reps < best[w]) best[w] = t / reps;
        }
    printf("split: paged float32 decode ctx %td H %d Hkv %d hd %d, best of %d rounds (us)\n", ctx, H, Hkv, hd, rounds);
    printf("   back to back   1 thread %8.1f  %d threads %8.1f  ratio %.3f\n", best[0] * 1e6, threads,
           best[1] * 1e6, best[1] / best[0]);
    printf("   1 ms apart     1 thread %8.1f  %d threads %8.1f  ratio %.3f\n", best[2] * 1e6, threads,
           best[3] * 1e6, best[3] / best[2]);
    fflush(stdout);
    fx_big_free(k, kvb); fx_big_free(v, kvb); free(q); free(out); free(table);
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "split")) {
        const int rounds = argc > 2 ? atoi(argv[2]) : 7, threads = argc > 3 ? atoi(argv[3]) : 2;
        int i;
        if (argc <= 4) {
            run_split(512, rounds, threads);
            run_split(2048, rounds, threads);
            run_split(8192, rounds, threads);
        }
        for (i = 4; i < argc; i++) run_split(atol(argv[i]), rounds, threads);
        return 0;
    }
    evict = getenv("EVICT") != NULL;
    if (argc > 1 && !strcmp(argv[1], "dtypes")) {
        const int rounds = argc > 2 ? atoi(argv[2]) : 20;
        int i;
        printf("clones path: %s\n", clones_path());
        if (argc <= 3) {
            run_dtypes(2048, rounds, 32, 8, 128);
            run_dtypes(8192, rounds, 32, 8, 128);
        }
        for (i = 3; i < argc; i++) run_dtypes(atol(argv[i]), rounds, 32, 8, 128);
        return 0;
    }
    const int rounds = argc > 1 ? atoi(argv[1]) : 30;
    if (argc > 1 && !strcmp(argv[1], "exp")) {
        exp_bench();
        return 0;
    }
    const int contig = argc > 2 && !strcmp(argv[2], "contig");
    int i;
    printf("clones path: %s | base: %s | v3: %s | chunk %d qblock %d\n", clones_path(), base_path(),
           v3_path(), FX_ATTN_CHUNK, FX_ATTN_QBLOCK);
    if (argc <= 3) {
        run(512, 1, contig, rounds, 32, 8, 128);
        run(2048, 1, contig, rounds, 32, 8, 128);
        run(8192, 1, contig, rounds, 32, 8, 128);
        run(2048, 256, contig, rounds > 5 ? 5 : rounds, 32, 8, 128);
    }
    for (i = 3; i < argc; i++) {
        long c = 0, ql = 1;
        int H = 32, Hkv = 8, hd = 128;
        sscanf(argv[i], "%ld:%ld:%d:%d:%d", &c, &ql, &H, &Hkv, &hd);
        run(c, ql, contig, ql > 16 && rounds > 5 ? 5 : rounds, H, Hkv, hd);
    }
    return 0;
}
