/* _attn_tile.h -- the tiles of _attn.h's kernel that depend on the vector
 * width: q.k scores and p.V accumulation over W-float vectors.  No include
 * guard: _attn.h includes it once per width, with
 *   FXT_W          8 or 16 (floats per vector)
 *   FXT_V          the vector type, FXT_LOAD / FXT_STORE / FXT_SPLAT its
 *                  unaligned float load and store and its broadcast
 *   FXT_LD         the row load of one dtype, as FXA_LD (W values)
 *   FXT_FOLD8(v)   an fxa_v8 whose lane sums equal v's (v itself for W = 8)
 *   FXT_PIN(v)     keeps the vector variable v in a register (or nothing)
 * and undefines them at the end.  The functions are named fxa_*_<W>.  A
 * width of 16 needs head dims that are multiples of 16 to pay (a remainder
 * runs scalar), so fx_attend picks it only for those. */
#define FXT_CAT_(a, b) a##_##b
#define FXT_CAT(a, b) FXT_CAT_(a, b)
#define FXT(name) FXT_CAT(name, FXT_W)

/* s[t*FX_CS + r] = q_t . k_r for a T x R tile (T*R == 12, or 4 x 4);
   q_t = q + t*hd, k_r = the head slice at value offset koff of row k[r]
   (int8 scales: ks[r] + soff).  12 or 16 independent accumulators (8 would
   leave the FMA latency exposed); each K vector is loaded once for the T
   queries and each q vector once for the R rows (FXT_PIN holds it in a
   register: left free, gcc folds the load into every FMA). */
FX_INLINE void FXT(fxa_qk_tile)(const int T, const int R, const float *q, int hd, const char *const *k,
                                const float *const *ks, size_t koff, size_t soff, float *s, const int dt)
{
    FXT_V acc[16], kr[12];
    fxa_v8 acc8[16];
    float sum[16];
    int t, r, d = 0;
    for (t = 0; t < T * R; t++) acc[t] = FXT_SPLAT(0.0f);
    for (; d + FXT_W <= hd; d += FXT_W) {
        for (r = 0; r < R; r++) kr[r] = FXT_LD(dt, k[r], koff + d, FXA_SC(dt, ks, r, soff, d));
        for (t = 0; t < T; t++) {
            FXT_V qv = FXT_LOAD(q + (size_t)t * hd + d);
            FXT_PIN(qv);
            for (r = 0; r < R; r++) acc[t * R + r] = fxa_fma(qv, kr[r], acc[t * R + r]);
        }
    }
    for (t = 0; t < T * R; t++) acc8[t] = FXT_FOLD8(acc[t]);
    fxa_hsum8x8(acc8, sum);
    if (T * R == 16) fxa_hsum8x8(acc8 + 8, sum + 8);
    else fxa_hsum4x8(acc8 + 8, sum + 8);
    for (; d < hd; d++)
        for (r = 0; r < R; r++) {
            const float kx = fxa_ld1(dt, k[r], koff + (size_t)d, FXA_SC(dt, ks, r, soff, d));
            for (t = 0; t < T; t++) sum[t * R + r] += q[(size_t)t * hd + d] * kx;
        }
    for (t = 0; t < T; t++)
        for (r = 0; r < R; r++) s[t * FX_CS + r] = sum[t * R + r];
}

/* s[t*FX_CS + r] = q_t . k_r for T queries (T <= 8; 8 only on 16-float
   vectors, whose 32 registers hold its 24 accumulators) and the 3W rows
   r0 .. r0+3W of a packed, transposed K slice (kt[d*FX_KT + r] = k_r[d]):
   each query value is broadcast against W rows at once, so no horizontal
   sum is needed.  Rows past the chunk's last give scores nobody reads. */
FX_INLINE void FXT(fxa_qkt_tile)(const int T, const float *q, int hd, const float *kt, int r0, float *s)
{
    FXT_V acc[24], kr[3];
    int t, j, d;
    for (t = 0; t < 3 * T; t++) acc[t] = FXT_SPLAT(0.0f);
    for (d = 0; d < hd; d++) {
        for (j = 0; j < 3; j++) kr[j] = FXT_LOAD(kt + (size_t)d * FX_KT + r0 + FXT_W * j);
        for (t = 0; t < T; t++) {
            const FXT_V qv = FXT_SPLAT(q[(size_t)t * hd + d]);
            for (j = 0; j < 3; j++) acc[t * 3 + j] = fxa_fma(qv, kr[j], acc[t * 3 + j]);
        }
    }
    for (t = 0; t < T; t++)
        for (j = 0; j < 3; j++) FXT_STORE(s + (size_t)t * FX_CS + r0 + FXT_W * j, acc[t * 3 + j]);
}

/* Columns d .. d+W*S of o_t (o_t = o + t*dv):
   o_t = (rescale ? o_t * alpha_t : o_t) + sum_{r0 <= r < r1} p[t*FX_CS + r] * v_r,
   v_r = the head slice at value offset voff of row v[r] (int8 scales: vs[r]
   + soff).  The T*S <= 12 accumulators stay in registers over the rows. */
FX_INLINE void FXT(fxa_pv_strip)(const int T, const int S, float *o, int dv, const float *alpha, int rescale,
                                 const float *p, const char *const *v, const float *const *vs, size_t voff,
                                 size_t soff, int r0, int r1, int d, const int dt)
{
    FXT_V acc[12], vr[12];
    int t, s, r;
    for (t = 0; t < T; t++)
        for (s = 0; s < S; s++) {
            acc[t * S + s] = FXT_LOAD(o + (size_t)t * dv + d + FXT_W * s);
            if (rescale) acc[t * S + s] = fxa_mul(acc[t * S + s], FXT_SPLAT(alpha[t]));
        }
    for (r = r0; r < r1; r++) {
        for (s = 0; s < S; s++)
            vr[s] = FXT_LD(dt, v[r], voff + d + FXT_W * s, FXA_SC(dt, vs, r, soff, d + FXT_W * s));
        for (t = 0; t < T; t++) {
            const FXT_V pt = FXT_SPLAT(p[t * FX_CS + r]);
            for (s = 0; s < S; s++) acc[t * S + s] = fxa_fma(pt, vr[s], acc[t * S + s]);
        }
    }
    for (t = 0; t < T; t++)
        for (s = 0; s < S; s++) FXT_STORE(o + (size_t)t * dv + d + FXT_W * s, acc[t * S + s]);
}

FX_INLINE void FXT(fxa_pv_tile)(const int T, float *o, int dv, const float *alpha, int rescale, const float *p,
                                const char *const *v, const float *const *vs, size_t voff, size_t soff, int r0,
                                int r1, const int dt)
{
    const int S = 12 / T; /* 12 accumulators per strip */
    int d = 0, t, r;
    /* strips of S vectors, but never leave a single vector (4 accumulators,
       latency-bound) behind a full strip: S + 1 left go as strips of 2 */
    for (; d + FXT_W * S <= dv && dv - d != FXT_W * (S + 1); d += FXT_W * S)
        FXT(fxa_pv_strip)(T, S, o, dv, alpha, rescale, p, v, vs, voff, soff, r0, r1, d, dt);
    for (; d + 2 * FXT_W <= dv; d += 2 * FXT_W)
        FXT(fxa_pv_strip)(T, 2, o, dv, alpha, rescale, p, v, vs, voff, soff, r0, r1, d, dt);
    for (; d + FXT_W <= dv; d += FXT_W)
        FXT(fxa_pv_strip)(T, 1, o, dv, alpha, rescale, p, v, vs, voff, soff, r0, r1, d, dt);
    for (; d < dv; d++)
        for (t = 0; t < T; t++) {
            float x = o[(size_t)t * dv + d] * (rescale ? alpha[t] : 1.0f);
            for (r = r0; r < r1; r++)
                x += p[t * FX_CS + r] * fxa_ld1(dt, v[r], voff + (size_t)d, FXA_SC(dt, vs, r, soff, d));
            o[(size_t)t * dv + d] = x;
        }
}

#undef FXT
#undef FXT_CAT
#undef FXT_CAT_
#undef FXT_W
#undef FXT_V
#undef FXT_LOAD
#undef FXT_STORE
#undef FXT_SPLAT
#undef FXT_LD
#undef FXT_FOLD8
#undef FXT_PIN
