/* _attn.c -- the attention kernel's entry points (_attn.h): which level's
 * instantiation runs (_attn_base.c, _attn_v3.c, _attn_v4.c), the scratch
 * size, and the names of the paths for simd_path(). */
#include <stdlib.h>
#include "_attn_kernel.h"
#include "_workers.h"

/* The knobs of fx_attend_set_max_width, fx_attend_set_max_level and
   fx_attend_set_vnni. */
static int fxa_max_width = 16, fxa_max_level = 4, fxa_vnni = 1;
#if defined(__GNUC__) || defined(__clang__)
#define FXA_GET(knob) __atomic_load_n(&(knob), __ATOMIC_RELAXED)
#define FXA_SWAP(knob, x) __atomic_exchange_n(&(knob), (x), __ATOMIC_RELAXED)
#else
#define FXA_GET(knob) (*(volatile int *)&(knob))
static int FXA_SWAP_(int *knob, int x) { const int old = *knob; *knob = x; return old; }
#define FXA_SWAP(knob, x) FXA_SWAP_(&(knob), (x))
#endif
#define FXA_MAX_WIDTH() FXA_GET(fxa_max_width)

FX_API int fx_attend_set_max_width(int w) { return FXA_SWAP(fxa_max_width, w >= 16 ? 16 : 8); }
FX_API int fx_attend_set_max_level(int level) { return FXA_SWAP(fxa_max_level, level >= 4 ? 4 : level >= 3 ? 3 : 0); }
FX_API int fx_attend_set_vnni(int on) { return FXA_SWAP(fxa_vnni, on != 0); }

/* The level whose instantiation runs: the CPU's, capped by the knob. */
static FX_UNUSED int fxa_level(void)
{
    const int cpu = fx_cpu_level(), cap = FXA_GET(fxa_max_level);
    return cpu < cap ? cpu : cap;
}

/* int8 scores by VNNI: on a 16-float call, where the CPU has it and the
   knob allows it. */
static FX_UNUSED int fxa_use_vnni(void)
{
#if FX_ATTN_CLONES && FXA_HAVE_VNNI
    return FXA_GET(fxa_vnni) && fx_cpu_vnni();
#elif FXA_BASE_VNNI
    return FXA_GET(fxa_vnni);
#else
    return 0;
#endif
}

FX_API size_t fx_attend_scratch_floats(const fx_attn_args *a) { return fxa_scratch_floats(a); }

FX_API int fx_attend_width(const fx_attn_args *a)
{
    if (a->head_dim % 16 != 0 || a->v_head_dim % 16 != 0 || FXA_MAX_WIDTH() < 16)
        return 8;
#if FX_ATTN_CLONES && FXA_HAVE_W16
    return fxa_level() >= 4 ? 16 : 8;
#elif FXA_HAVE_W16
    return 16;
#else
    return 8;
#endif
}

FX_API void fx_attend(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch)
{
#if FX_ATTN_CLONES
#if FXA_HAVE_W16
    if (fx_attend_width(a) == 16) {
        if (kv->dtype == FX_I8 && fxa_use_vnni()) fxa_attend_v4_i8vnni(kv, a, q, out, scratch);
        else fxa_attend_v4(kv, a, q, out, scratch);
        return;
    }
#endif
    if (fxa_level() >= 3) fxa_attend_v3(kv, a, q, out, scratch);
    else fxa_attend_base(kv, a, q, out, scratch);
#else /* one build: what the compiler targets */
#if FXA_HAVE_W16
    if (fx_attend_width(a) == 16) {
#if FXA_BASE_VNNI
        if (kv->dtype == FX_I8 && fxa_use_vnni()) fxa_attend_base16_i8vnni(kv, a, q, out, scratch);
        else
#endif
        fxa_attend_base16(kv, a, q, out, scratch);
        return;
    }
#endif
    fxa_attend_base(kv, a, q, out, scratch);
#endif
}

FX_API const char *fx_attend_levels(void)
{
#if FX_ATTN_CLONES && FXA_HAVE_W16
    return "x86-64 baseline, x86-64-v3, x86-64-v4 (one picked at load time)";
#elif FX_ATTN_CLONES
    return "x86-64 baseline, x86-64-v3 (one picked at load time)";
#else
    return "one build, for the compiler's target";
#endif
}

/* With dispatch: the libgcc feature bits an ifunc resolver tests;
   otherwise what the compiler was told to target. */
FX_API const char *fx_attend_simd_path(void)
{
#if !defined(FX_VECEXT)
    return "scalar C (no vector extensions)";
#elif FX_ATTN_CLONES
    const int level = fxa_level();
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

FX_API const char *fx_attend_load_path(int dtype)
{
    switch (dtype) {
    case FX_F32: return "float32: vector loads";
    case FX_F16:
#if FX_ATTN_CLONES && FXA_HAVE_F16C
        if (fxa_level() >= 3) return "float16: F16C vcvtph2ps";
#elif FXA_HAVE_F16C
        return "float16: F16C vcvtph2ps (compile-time)";
#endif
        return "float16: exact integer conversion";
    case FX_BF16: return "bfloat16: zero-extend, shift 16";
    case FX_I8:
        if (fxa_use_vnni() && FXA_MAX_WIDTH() >= 16 && (!FX_ATTN_CLONES || fxa_level() >= 4))
            return "int8: q.k as integers (query quantised, vpdpbusd where head dims are multiples of 64), "
                   "p.V widen x group scale";
#if FX_ATTN_CLONES && FXA_HAVE_I8DOT
        if (fxa_level() >= 3) return "int8: q.k as integers (query quantised, vpmaddubsw), p.V widen x group scale";
#elif FXA_HAVE_I8DOT
        return "int8: q.k as integers (query quantised, vpmaddubsw, compile-time), p.V widen x group scale";
#endif
        return "int8: query quantised, widen x group scale";
    case FX_I4: case FX_I4H:
#if FX_ATTN_CLONES && FXA_HAVE_I8DOT
        if (fxa_level() >= 3) return "int4: nibbles unpacked to int8, q.k as integers (query quantised, vpmaddubsw), p.V widen x group scale";
#elif FXA_HAVE_I8DOT
        return "int4: nibbles unpacked to int8, q.k as integers (query quantised, vpmaddubsw, compile-time), p.V widen x group scale";
#endif
        return "int4: query quantised, nibbles widened x group scale";
    default: return NULL;
    }
}

/* ---- fx_attend_batch: one call's sequences split over the worker pool ---- */

/* Tunables of the split (fx_attend_set_split): calls over fewer context
   bytes than split_bytes run on the caller alone; a context chunk of a
   decode holds at least chunk_rows rows. */
static ptrdiff_t fxp_split_bytes = 262144, fxp_chunk_rows = 256;

FX_API void fx_attend_set_split(ptrdiff_t split_bytes, ptrdiff_t chunk_rows)
{
    __atomic_store_n(&fxp_split_bytes, split_bytes < 0 ? 0 : split_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&fxp_chunk_rows, chunk_rows < 1 ? 1 : chunk_rows, __ATOMIC_RELAXED);
}
FX_API void fx_attend_get_split(ptrdiff_t *split_bytes, ptrdiff_t *chunk_rows)
{
    *split_bytes = __atomic_load_n(&fxp_split_bytes, __ATOMIC_RELAXED);
    *chunk_rows = __atomic_load_n(&fxp_chunk_rows, __ATOMIC_RELAXED);
}

typedef struct {
    const fx_kv *kvs;
    const ptrdiff_t *starts;
    fx_attn_args a;            /* the call's arguments; start per sequence */
    const float *q;
    size_t q_stride, o_stride; /* floats per sequence */
    float *out;
    int hg, nhg;               /* kv heads per unit, head groups per sequence */
    ptrdiff_t qb, nqb;         /* query positions per unit, query blocks per sequence */
    ptrdiff_t nch;             /* context chunks of a decode (1: none) */
    float *scratch;            /* per slot */
    size_t scratch_floats;
    float *part;               /* nch chunks x n_heads x (v_head_dim + 2) per sequence */
} fxp_call;

/* Rows a decode's query sees: [lo, len). */
static ptrdiff_t fxp_visible_lo(const fxp_call *c, ptrdiff_t s)
{
    const ptrdiff_t len = c->kvs[s].len;
    ptrdiff_t lo = c->starts ? c->starts[s] : 0;
    if (c->a.window > 0 && len - c->a.window > lo) lo = len - c->a.window;
    return lo;
}

/* Unit u: sequence, query block, head group and context chunk, in that
   order of significance (chunk fastest). */
static void fxp_unit(void *ctx, ptrdiff_t u, int slot)
{
    const fxp_call *c = (const fxp_call *)ctx;
    const ptrdiff_t ch = u % c->nch, hg = (u / c->nch) % c->nhg, qb = u / (c->nch * c->nhg) % c->nqb;
    const ptrdiff_t s = u / (c->nch * c->nhg * c->nqb);
    const int H = c->a.n_heads, hd = c->a.head_dim, dv = c->a.v_head_dim;
    fx_kv kv = c->kvs[s];
    fx_attn_args a = c->a;
    const ptrdiff_t t0 = qb * c->qb, t1 = t0 + c->qb < a.q_len ? t0 + c->qb : a.q_len;
    const float *q = c->q + (size_t)s * c->q_stride + (size_t)t0 * H * hd;
    float *out = c->out + (size_t)s * c->o_stride + (size_t)t0 * H * dv;
    a.start = c->starts ? c->starts[s] : 0;
    a.kv_lo = (int)hg * c->hg;
    a.kv_hi = a.kv_lo + c->hg < a.n_kv_heads ? a.kv_lo + c->hg : a.n_kv_heads;
    /* queries [t0, t1) see no row past position len - q_len + t1 - 1 */
    kv.len = kv.len - a.q_len + t1;
    a.q_len = t1 - t0;
    if (c->nch > 1) { /* a decode: chunk ch of the visible rows, merged by fxp_merge */
        const ptrdiff_t lo = fxp_visible_lo(c, s), n = kv.len - lo;
        float *part = c->part + ((size_t)s * (size_t)c->nch + (size_t)ch) * (size_t)H * (size_t)(dv + 2);
        a.row_lo = lo + n * ch / c->nch;
        a.row_hi = lo + n * (ch + 1) / c->nch;
        a.ml = part + (size_t)H * dv;
        out = part;
    }
    fx_attend(&kv, &a, q, out, c->scratch + (size_t)slot * c->scratch_floats);
}

/* A decode's chunks, combined in chunk order: out = sum_c w_c acc_c /
   sum_c w_c l_c, w_c = 2^((m_c - M) f), M the largest m_c.  The chunks
   cover the visible rows, so every query sees a row; M = -inf (every score
   -inf or NaN) gives NaN, as the unsplit kernel does. */
static void fxp_merge(const fxp_call *c, ptrdiff_t s)
{
    const int H = c->a.n_heads, dv = c->a.v_head_dim;
    const size_t stride = (size_t)H * (size_t)(dv + 2);
    const float *part = c->part + (size_t)s * (size_t)c->nch * stride;
    float *out = c->out + (size_t)s * c->o_stride, f;
    ptrdiff_t ch;
    int j, d;
    (void)fxa_exp_scales(c->a.scale, &f);
    for (j = 0; j < H; j++) {
        float M = FX_NEG_INF, L = 0.0f, *o = out + (size_t)j * dv;
        for (ch = 0; ch < c->nch; ch++) {
            const float m = part[(size_t)ch * stride + (size_t)H * dv + 2 * (size_t)j];
            M = m > M ? m : M;
        }
        for (d = 0; d < dv; d++) o[d] = 0.0f;
        for (ch = 0; ch < c->nch; ch++) {
            const float *pc = part + (size_t)ch * stride, *ml = pc + (size_t)H * dv + 2 * (size_t)j;
            const float w = M == FX_NEG_INF ? 0.0f : fxa_exp2f((ml[0] - M) * f);
            L += w * ml[1];
            for (d = 0; d < dv; d++) o[d] += w * pc[(size_t)j * dv + d];
        }
        {
            const float inv = 1.0f / L; /* L = 0 (M = -inf): 0 * inf = NaN */
            for (d = 0; d < dv; d++) o[d] *= inv;
        }
    }
}

/* The split of one call on at most `threads` threads (units and their
   shape in c; returns the units, *slots the threads that run them), from the
   knobs as they are now. */
static ptrdiff_t fxp_plan(fxp_call *c, const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                          int threads, int *slots)
{
    ptrdiff_t split_bytes, chunk_rows, s, units, want;
    size_t bytes = 0;
    int workers;
    fx_attend_get_split(&split_bytes, &chunk_rows);
    for (s = 0; s < n; s++) {
        bytes += (size_t)kvs[s].len * (kvs[s].k_row + kvs[s].v_row);
    }
    memset(c, 0, sizeof *c);
    c->kvs = kvs;
    c->starts = starts;
    c->a = *a;
    c->hg = a->n_kv_heads;
    c->nhg = 1;
    c->qb = a->q_len;
    c->nqb = 1;
    c->nch = 1;
    workers = fx_workers_get(); /* read once: another thread may set it */
    if (threads > workers) threads = workers;
    if (threads < 2 || bytes < (size_t)split_bytes) threads = 1;
    /* about 4 units per thread.  A decode (q_len 1) splits over sequences,
       then chunks of >= chunk_rows rows of the context, then kv heads: a
       unit of every head walks its rows in memory order (a row holds every
       head), where a unit of one head would read a slice of each row.  A
       prefill splits over sequences, then kv heads, then blocks of >= 16
       query positions. */
    want = 4 * (ptrdiff_t)threads;
    if (threads > 1 && n < want) {
        ptrdiff_t per_seq = (want + n - 1) / n;
        if (a->q_len == 1) {
            ptrdiff_t vis = -1;
            for (s = 0; s < n; s++) { /* the shortest visible range bounds the chunk count */
                const ptrdiff_t v = kvs[s].len - fxp_visible_lo(c, s);
                if (vis < 0 || v < vis) vis = v;
            }
            c->nch = vis / chunk_rows < per_seq ? vis / chunk_rows : per_seq;
            if (c->nch < 1) c->nch = 1;
            per_seq = (per_seq + c->nch - 1) / c->nch;
        }
        if (per_seq > 1) {
            c->nhg = per_seq < a->n_kv_heads ? (int)per_seq : a->n_kv_heads;
            c->hg = (a->n_kv_heads + c->nhg - 1) / c->nhg;
            c->nhg = (a->n_kv_heads + c->hg - 1) / c->hg;
            per_seq = (per_seq + c->nhg - 1) / c->nhg;
        }
        if (per_seq > 1 && a->q_len > 1) {
            c->nqb = (a->q_len + 15) / 16 < per_seq ? (a->q_len + 15) / 16 : per_seq;
            c->qb = (a->q_len + c->nqb - 1) / c->nqb;
            c->nqb = (a->q_len + c->qb - 1) / c->qb;
        }
    }
    units = n * c->nqb * c->nhg * c->nch;
    *slots = threads < units ? threads : (int)units;
    c->scratch_floats = fx_attend_scratch_floats(a);
    return units;
}

/* Floats of work memory a plan needs: scratch per slot, then the chunks'
   partial results. */
static size_t fxp_work_floats(const fxp_call *c, ptrdiff_t n, int slots)
{
    return (size_t)slots * c->scratch_floats + 16 +
           (c->nch > 1 ? (size_t)n * (size_t)c->nch * (size_t)c->a.n_heads * (size_t)(c->a.v_head_dim + 2) : 0);
}

FX_API size_t fx_attend_batch_work(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                                   int threads)
{
    fxp_call c;
    int slots;
    fxp_plan(&c, kvs, starts, n, a, threads, &slots);
    return fxp_work_floats(&c, n, slots) * sizeof(float);
}

FX_API int fx_attend_batch_in(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                              const float *q, size_t q_stride, float *out, size_t o_stride, int threads, void *work,
                              size_t work_bytes)
{
    fxp_call c;
    ptrdiff_t s, units;
    int slots;
    units = fxp_plan(&c, kvs, starts, n, a, threads, &slots);
    if (fxp_work_floats(&c, n, slots) * sizeof(float) > work_bytes) /* a knob moved since the work was sized */
        units = fxp_plan(&c, kvs, starts, n, a, 1, &slots);
    if (fxp_work_floats(&c, n, slots) * sizeof(float) > work_bytes) return -1;
    c.q = q;
    c.out = out;
    c.q_stride = q_stride;
    c.o_stride = o_stride;
    c.scratch = (float *)work;
    c.part = c.nch > 1 ? c.scratch + (size_t)slots * c.scratch_floats + 16 : NULL;
    fx_workers_run(fxp_unit, &c, units, slots);
    if (c.nch > 1)
        for (s = 0; s < n; s++) fxp_merge(&c, s);
    return slots;
}

FX_API int fx_attend_batch(const fx_kv *kvs, const ptrdiff_t *starts, ptrdiff_t n, const fx_attn_args *a,
                           const float *q, size_t q_stride, float *out, size_t o_stride, int threads)
{
    const size_t bytes = fx_attend_batch_work(kvs, starts, n, a, threads);
    void *work = malloc(bytes);
    int rc;
    if (work == NULL) return -1;
    rc = fx_attend_batch_in(kvs, starts, n, a, q, q_stride, out, o_stride, threads, work, bytes);
    free(work);
    return rc;
}
