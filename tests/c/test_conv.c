/* test_conv.c -- the row conversions of _conv.h against independent
 * references:
 *   float16: GCC's _Float16 conversions (libgcc's soft-float, or F16C in the
 *            -march=x86-64-v3 build), which round as numpy's astype does.
 *            float32 -> float16 over every sign/exponent/top-10-mantissa
 *            pattern (2^19) with the low 13 bits at each rounding class
 *            (0, 1, just below / at / just above half, max), plus 2^20
 *            random patterns; float16 -> float32 over all 2^16 patterns.
 *   bfloat16: round to nearest even written as "nearer of the two
 *            neighbours, ties to the even one", over the same patterns.
 *   int8:    the contract's formula in double precision: scale, values,
 *            saturation, zero groups, NaN/inf groups, short last groups.
 *   int4:    the same formula with 7 for 127, the nibble layout, and the
 *            rotation: fx_fwht against the float64 Hadamard matrix
 *            (orthonormal, its own inverse), block sizes per head dim.
 * And the three row functions (with row strides, unaligned int8 rows and
 * fx_rows_from_half's straight copy) against the element functions.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "_conv.h"

int conv_tests(void);

static int fails;
#define CHECK(cond, ...) do { if (!(cond)) { if (fails++ < 20) { printf("FAIL conv: " __VA_ARGS__); printf("\n"); } } } while (0)

static uint64_t cs = 0x2545F4914F6CDD1Dull;
static uint32_t rnd32(void)
{
    cs ^= cs << 13; cs ^= cs >> 7; cs ^= cs << 17;
    return (uint32_t)(cs >> 16);
}

static uint16_t ref_f16(float f)
{
    _Float16 h = (_Float16)f;
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}
static float ref_f16_to_f32(uint16_t u)
{
    _Float16 h;
    memcpy(&h, &u, 2);
    return (float)h;
}
static uint16_t ref_bf16(float f)
{
    uint32_t x = fx_f2u(f), lo = x & 0xffff0000u, rem = x & 0xffffu;
    if (isnan(f)) return 0; /* checked separately */
    if (rem > 0x8000u || (rem == 0x8000u && (lo & 0x10000u))) lo += 0x10000u;
    return (uint16_t)(lo >> 16);
}

/* The row path (fx_rows_from_f32: F16C in the x86-64-v3 code, a vector
   loop for bfloat16) over every pattern check_one sees, in rows of PB
   values (a tail of 5 past the 8-wide steps), bit for bit against the
   element functions (NaN included). */
enum { PB = 4101 };
static float pat[PB];
static int npat;
static void flush_rows(void)
{
    static uint16_t h[PB], b[PB];
    int i;
    if (!npat) return;
    fx_rows_from_f32(h, 0, pat, 0, 1, 1, npat, FX_F16);
    fx_rows_from_f32(b, 0, pat, 0, 1, 1, npat, FX_BF16);
    for (i = 0; i < npat; i++) {
        CHECK(h[i] == fx_f32_to_f16(pat[i]), "f16 row of %08x: %04x, want %04x", fx_f2u(pat[i]), h[i], fx_f32_to_f16(pat[i]));
        CHECK(b[i] == fx_f32_to_bf16(pat[i]), "bf16 row of %08x: %04x, want %04x", fx_f2u(pat[i]), b[i], fx_f32_to_bf16(pat[i]));
    }
    npat = 0;
}

static void check_one(uint32_t x)
{
    const float f = fx_u2f(x);
    pat[npat++] = f;
    if (npat == PB) flush_rows();
    const uint16_t h = fx_f32_to_f16(f), b = fx_f32_to_bf16(f);
    if (isnan(f)) {
        CHECK((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) && (h & 0x200u) && (h >> 15) == (x >> 31),
              "f16 of NaN %08x -> %04x", x, h);
        CHECK((b & 0x7f80u) == 0x7f80u && (b & 0x40u) && (b >> 15) == (x >> 31), "bf16 of NaN %08x -> %04x", x, b);
        return;
    }
    CHECK(h == ref_f16(f), "f16 of %08x (%g): %04x, want %04x", x, f, h, ref_f16(f));
    CHECK(b == ref_bf16(f), "bf16 of %08x (%g): %04x, want %04x", x, f, b, ref_bf16(f));
}

static void test_f16_bf16(void)
{
    static const uint32_t lows[] = {0, 1, 0xfff, 0x1000, 0x1001, 0x1fff, 0x7fff, 0x8000, 0x8001, 0xffff};
    uint32_t top, i;
    size_t li;
    int n = 0;
    /* float32 -> float16 / bfloat16: every sign, exponent and top 10 mantissa bits */
    for (top = 0; top < (1u << 19); top++)
        for (li = 0; li < sizeof lows / sizeof lows[0]; li++) {
            check_one((top << 13) | (lows[li] & 0x1fffu));       /* float16's rounding point */
            check_one(((top << 13) & 0xffff0000u) | lows[li]);   /* bfloat16's */
            n += 2;
        }
    /* float16 subnormals round at lower bits: dense random low bits there */
    for (i = 0; i < (1u << 20); i++) {
        const uint32_t e = 102 + rnd32() % 12; /* 2^-25 .. 2^-14 */
        check_one((rnd32() & 0x80000000u) | (e << 23) | (rnd32() & 0x7fffffu));
        check_one(rnd32());
        n += 2;
    }
    /* named classes */
    {
        static const float cls[] = {0.0f, -0.0f, INFINITY, -INFINITY, 65504.0f, 65519.99f, 65520.0f, 1e10f,
                                    -1e10f, 5.9604645e-08f, 2.9802322e-08f, 2.9802326e-08f, 1e-30f, 6.1035156e-05f,
                                    3.3895314e38f, 3.4028235e38f};
        for (li = 0; li < sizeof cls / sizeof cls[0]; li++) check_one(fx_f2u(cls[li]));
        CHECK(fx_f32_to_f16(65520.0f) == 0x7c00u && fx_f32_to_f16(65519.99f) == 0x7bffu, "f16 overflow boundary");
        CHECK(fx_f32_to_f16(-0.0f) == 0x8000u && fx_f32_to_bf16(-0.0f) == 0x8000u, "-0");
        CHECK(fx_f32_to_bf16(3.4028235e38f) == 0x7f80u, "bf16 of FLT_MAX rounds to inf");
    }
    flush_rows();
    /* float16 -> float32: all patterns */
    for (i = 0; i < 65536; i++) {
        const float a = fx_f16_to_f32((uint16_t)i), want = ref_f16_to_f32((uint16_t)i);
        if (isnan(want)) CHECK(isnan(a), "f16 %04x -> %g, want NaN", i, a);
        else CHECK(fx_f2u(a) == fx_f2u(want), "f16 %04x -> %g, want %g", i, a, want);
        CHECK(fx_f2u(fx_bf16_to_f32((uint16_t)i)) == i << 16, "bf16 %04x", i);
        /* float16 -> float32 -> float16 is the identity (NaN: stays NaN) */
        if (!isnan(want)) CHECK(fx_f32_to_f16(a) == i, "f16 round trip %04x", i);
    }
    printf("conversions: %d float32 patterns into float16 and bfloat16, all 65536 back\n", n);
}

/* The contract's group (qmax 127: int8, 7: int4) in double precision; 1
   if (q, s) matches. */
static int ref_q_ok(const float *x, int n, const int8_t *q, uint16_t s, double qmax)
{
    double amax = 0;
    int i, nan = 0, inf = 0;
    float sf;
    for (i = 0; i < n; i++) {
        nan |= isnan(x[i]);
        inf |= isinf(x[i]);
        if (fabs(x[i]) > amax) amax = fabs(x[i]);
    }
    if (nan) return (s & 0x7fffu) > 0x7c00u;
    if (inf) return s == 0x7c00u;
    if (amax == 0) {
        for (i = 0; i < n; i++) if (q[i]) return 0;
        return s == 0;
    }
    if (s >> 15) return 0;
    sf = fx_f16_to_f32(s);
    /* the stored scale: float16 of amax/qmax or one step up, never below what keeps |x|/s <= qmax */
    {
        const uint16_t s0 = fx_f32_to_f16((float)(amax / qmax));
        if (s0 >= 0x7c00u ? s != 0x7bffu : !(s == s0 || s == s0 + 1)) return 0; /* capped at 65504 */
    }
    if (s < 0x7bffu && amax / sf > qmax * (1 + 1e-6)) return 0;
    for (i = 0; i < n; i++) {
        double v = x[i] / (double)sf, r = nearbyint(v);
        if (r > qmax) r = qmax;
        if (r < -qmax) r = -qmax;
        if (fabs(v) < qmax + 1 && fabs(v - nearbyint(v)) > 0.4999 && fabs(v - nearbyint(v)) < 0.5001) { /* a tie in float rounding: either */
            if (fabs(q[i] - v) > 0.5001) return 0;
        } else if (q[i] != (int)r) return 0;
    }
    return 1;
}

static void test_i8(void)
{
    enum { HEADS = 3 };
    static const int dims[] = {1, 7, 31, 32, 33, 64, 80, 128};
    size_t di;
    int trial, bad = 0, groups = 0;
    float x[HEADS * 128];
    for (di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int hd = dims[di], ng = (int)fx_i8_groups(hd);
        const size_t rb = fx_row_bytes(HEADS, hd, FX_I8);
        char *row = malloc(rb);
        float back[HEADS * 128];
        CHECK(rb == (size_t)HEADS * hd + 2u * HEADS * (size_t)ng, "row bytes");
        for (trial = 0; trial < 400; trial++) {
            int g, j, i;
            const int kind = trial % 8;
            for (i = 0; i < HEADS * hd; i++) {
                float mag = kind == 0 ? 1.0f : kind == 1 ? 1e-6f : kind == 2 ? 60000.0f : kind == 3 ? 1e9f : 3.0f;
                x[i] = ((float)(rnd32() % 20001) / 10000.0f - 1.0f) * mag;
                if (kind == 4 && i % 5 == 0) x[i] = 0; /* exact zeros */
                if (kind == 5 && i % 11 == 3) x[i] *= 80.0f; /* outlier channels */
            }
            if (kind == 6) for (i = 0; i < hd && i < 32; i++) x[i] = 0.0f;  /* an all-zero group */
            if (kind == 7) { x[rnd32() % (HEADS * hd)] = trial % 16 == 7 ? NAN : (trial % 3 ? INFINITY : -INFINITY); }
            fx_rows_from_f32(row, rb, x, (size_t)HEADS * hd, 1, HEADS, hd, FX_I8);
            fx_rows_to_f32(back, (size_t)HEADS * hd, row, rb, 1, HEADS, hd, FX_I8);
            for (g = 0; g < HEADS; g++)
                for (j = 0; j < ng; j++) {
                    const int d0 = j * 32, len = hd - d0 < 32 ? hd - d0 : 32;
                    const uint16_t s = fx_ld16(row + (size_t)HEADS * hd + 2 * ((size_t)g * ng + (size_t)j));
                    const float sf = fx_f16_to_f32(s);
                    groups++;
                    if (!ref_q_ok(x + g * hd + d0, len, (const int8_t *)row + g * hd + d0, s, 127.0)) {
                        if (bad++ < 5) printf("FAIL conv: int8 group hd=%d trial %d head %d group %d scale %04x\n", hd, trial, g, j, s);
                    }
                    for (i = 0; i < len; i++) {
                        const float want = (float)((const int8_t *)row)[g * hd + d0 + i] * sf;
                        const float got = back[g * hd + d0 + i];
                        if (isnan(want)) CHECK(isnan(got), "int8 dequant NaN");
                        else CHECK(got == want, "int8 dequant %g vs %g", got, want);
                    }
                }
        }
        free(row);
    }
    fails += bad;
    /* saturation: beyond 127 * 65504 the scale caps at 65504 and q clamps to +-127 */
    {
        float y[32] = {1e30f, -1e30f, 1.0f};
        int8_t q[32];
        uint16_t s;
        fx_q_group(y, 32, 127.0f, q, &s);
        CHECK(s == 0x7bffu && q[0] == 127 && q[1] == -127 && q[2] == 0, "int8 saturation: s %04x q %d %d", s, q[0], q[1]);
    }
    printf("conversions: %d int8 groups against the contract\n", groups);
}

/* fx_fwht against the float64 Hadamard matrix H[i][j] = (-1)^popcount(i&j)
   / sqrt(b) on each diagonal block, column by column (the transform of
   unit vectors); applied twice it gives x back; and the block sizes. */
static void test_hadamard(void)
{
    static const int dims[][2] = {{32, 32}, {64, 64}, {96, 32}, {128, 128}, {160, 32}, {192, 64}, {256, 256},
                                  {1024, 512}};
    static float col[1024], x[1024], y[1024];
    size_t di;
    int i, j;
    double worst = 0, worst_inv = 0;
    for (di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int n = dims[di][0], b = fx_hadamard_block(n);
        CHECK(b == dims[di][1], "hadamard block of %d: %d, want %d", n, b, dims[di][1]);
        for (j = 0; j < n; j += (n > 256 ? 37 : 1)) {
            memset(col, 0, sizeof col);
            col[j] = 1.0f;
            fx_fwht(col, n, b);
            for (i = 0; i < n; i++) {
                const double h = (i / b != j / b) ? 0.0
                                 : (__builtin_popcount((unsigned)(i % b) & (unsigned)(j % b)) & 1 ? -1.0 : 1.0) / sqrt((double)b);
                if (fabs(col[i] - h) > worst) worst = fabs(col[i] - h);
            }
        }
        for (i = 0; i < n; i++) x[i] = y[i] = ((float)(rnd32() % 20001) / 10000.0f - 1.0f);
        fx_fwht(y, n, b);
        {
            double n0 = 0, n1 = 0;
            for (i = 0; i < n; i++) { n0 += (double)x[i] * x[i]; n1 += (double)y[i] * y[i]; }
            CHECK(fabs(n0 - n1) <= 1e-5 * n0, "hadamard %d keeps the norm: %g vs %g", n, n0, n1);
        }
        fx_fwht(y, n, b);
        for (i = 0; i < n; i++) if (fabs(y[i] - x[i]) > worst_inv) worst_inv = fabs(y[i] - x[i]);
    }
    CHECK(worst <= 1e-7, "hadamard vs the float64 matrix: %g", worst);
    CHECK(worst_inv <= 1e-5, "hadamard twice is the identity: %g", worst_inv);
    printf("conversions: hadamard vs float64 matrix worst %.3g, twice vs identity %.3g\n", worst, worst_inv);
}

/* int4 rows, plain and rotated: every group against the contract (on the
   rotated values for FX_I4H), the nibble layout, the read-back (rotated
   back), and the round-trip error. */
static void test_i4(void)
{
    enum { HEADS = 3, MAXD = 192 };
    static const int dims[] = {32, 64, 96, 128, 192};
    size_t di;
    int trial, dt, bad = 0, groups = 0;
    float x[HEADS * MAXD], xr[HEADS * MAXD], back[HEADS * MAXD], want[HEADS * MAXD];
    double worst_rel[2] = {0, 0};
    for (dt = FX_I4; dt <= FX_I4H; dt++)
        for (di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            const int hd = dims[di], ng = hd / 32, n = HEADS * hd;
            const size_t rb = fx_row_bytes(HEADS, hd, dt);
            char *row = malloc(rb);
            CHECK(rb == (size_t)n / 2 + 2u * HEADS * (size_t)ng, "int4 row bytes");
            for (trial = 0; trial < 200; trial++) {
                int g, j, i;
                const int kind = trial % 8;
                for (i = 0; i < n; i++) {
                    float mag = kind == 0 ? 1.0f : kind == 1 ? 1e-6f : kind == 2 ? 6000.0f : kind == 3 ? 1e9f : 3.0f;
                    x[i] = ((float)(rnd32() % 20001) / 10000.0f - 1.0f) * mag;
                    if (kind == 4 && i % 5 == 0) x[i] = 0;
                    if (kind == 5 && i % 11 == 3) x[i] *= 80.0f;
                }
                if (kind == 6) for (i = 0; i < 32; i++) x[i] = 0.0f;
                if (kind == 7) x[rnd32() % n] = trial % 16 == 7 ? NAN : (trial % 3 ? INFINITY : -INFINITY);
                memcpy(xr, x, sizeof(float) * (size_t)n);
                if (dt == FX_I4H)
                    for (g = 0; g < HEADS; g++) fx_fwht(xr + g * hd, hd, fx_hadamard_block(hd));
                fx_rows_from_f32(row, rb, x, (size_t)n, 1, HEADS, hd, dt);
                fx_rows_to_f32(back, (size_t)n, row, rb, 1, HEADS, hd, dt);
                for (g = 0; g < HEADS; g++)
                    for (j = 0; j < ng; j++) {
                        const size_t gi = (size_t)g * ng + (size_t)j;
                        const uint16_t s = fx_ld16(row + (size_t)n / 2 + 2 * gi);
                        const unsigned char *b = (const unsigned char *)row + 16 * gi;
                        int8_t q[32];
                        for (i = 0; i < 16; i++) {
                            q[i] = (int8_t)((b[i] & 15) - 8);
                            q[i + 16] = (int8_t)((b[i] >> 4) - 8);
                            CHECK((b[i] & 15) != 0 && (b[i] >> 4) != 0, "int4 nibble 0 (q = -8) stored");
                        }
                        groups++;
                        if (!ref_q_ok(xr + g * hd + 32 * j, 32, q, s, 7.0) && bad++ < 5)
                            printf("FAIL conv: int4 group dt=%d hd=%d trial %d head %d group %d scale %04x\n", dt, hd,
                                   trial, g, j, s);
                        for (i = 0; i < 32; i++) want[g * hd + 32 * j + i] = (float)q[i] * fx_f16_to_f32(s);
                    }
                if (dt == FX_I4H)
                    for (g = 0; g < HEADS; g++) fx_fwht(want + g * hd, hd, fx_hadamard_block(hd));
                for (i = 0; i < n; i++) {
                    if (isnan(want[i])) CHECK(isnan(back[i]), "int4 read-back NaN");
                    else CHECK(back[i] == want[i], "int4 read-back dt=%d %g vs %g", dt, back[i], want[i]);
                }
                if (kind == 0 || kind == 4)
                    for (g = 0; g < HEADS; g++) {
                        double e = 0, m = 0;
                        for (i = 0; i < hd; i++) {
                            e += ((double)back[g * hd + i] - x[g * hd + i]) * ((double)back[g * hd + i] - x[g * hd + i]);
                            m += (double)x[g * hd + i] * x[g * hd + i];
                        }
                        if (sqrt(e / m) > worst_rel[dt - FX_I4]) worst_rel[dt - FX_I4] = sqrt(e / m);
                    }
            }
            free(row);
        }
    fails += bad;
    /* uniform values: relative RMS error about amax/rms / (7 sqrt 12) = 0.07 unrotated; the
       rotation makes them near-Gaussian (a larger amax/rms): it pays on outlier channels, not here */
    CHECK(worst_rel[0] < 0.12 && worst_rel[1] < 0.2, "int4 round trip error %g / %g", worst_rel[0], worst_rel[1]);
    CHECK(fx_row_bytes(8, 128, FX_I4) * 1.0 / (8 * 128) == 0.5625, "int4 bytes per value at head_dim 128");
    printf("conversions: %d int4 groups against the contract (round trip rel err %.3g plain, %.3g rotated)\n", groups,
           worst_rel[0], worst_rel[1]);
}

/* Row functions: strides, every dtype pair, straight copies. */
static void test_rows(void)
{
    enum { R = 5, HEADS = 2, MAXN = HEADS * 64 };
    float src[R][MAXN + 3], back[R][MAXN + 1];
    uint16_t half[R][MAXN + 2];
    int dt, sdt, r, i;
    for (r = 0; r < R; r++)
        for (i = 0; i < MAXN + 3; i++) src[r][i] = ((float)(rnd32() % 2001) - 1000.0f) / 7.0f;
    for (dt = FX_F32; dt <= FX_I4H; dt++) {
        const int HD = FX_IS_I4(dt) ? 64 : 40, N = HEADS * HD; /* int4: whole groups of 32 */
        const size_t rb = fx_row_bytes(HEADS, HD, dt) + 3; /* odd stride: unaligned rows */
        char *buf = malloc(rb * R), *one = malloc(rb);
        fx_rows_from_f32(buf, rb, &src[0][0], MAXN + 3, R, HEADS, HD, dt);
        fx_rows_to_f32(&back[0][0], MAXN + 1, buf, rb, R, HEADS, HD, dt);
        for (r = 0; r < R; r++) {
            fx_row_from_f32(one, src[r], HEADS, HD, dt);
            CHECK(!memcmp(one, buf + (size_t)r * rb, rb - 3), "rows_from_f32 row %d dtype %d", r, dt);
            for (i = 0; i < N; i++) {
                const float tol = dt == FX_F32 ? 0 : dt == FX_F16 ? 1.0f / 1024 : dt == FX_BF16 ? 1.0f / 128 : dt == FX_I8 ? 1.0f / 60 : 1.0f / 2;
                CHECK(fabsf(back[r][i] - src[r][i]) <= tol * 143.0f, "round trip dtype %d: %g vs %g", dt, back[r][i], src[r][i]);
            }
        }
        /* float16 / bfloat16 input rows: the same bytes as converting their float32 values */
        for (sdt = FX_F16; sdt <= FX_BF16; sdt++) {
            float hf[R][N];
            char *via = malloc(rb * R);
            for (r = 0; r < R; r++)
                for (i = 0; i < N + 2; i++) {
                    half[r][i] = sdt == FX_F16 ? fx_f32_to_f16(src[r][i]) : fx_f32_to_bf16(src[r][i]);
                    if (i < N) hf[r][i] = sdt == FX_F16 ? fx_f16_to_f32(half[r][i]) : fx_bf16_to_f32(half[r][i]);
                }
            fx_rows_from_half(buf, rb, &half[0][0], MAXN + 2, R, HEADS, HD, sdt, dt);
            fx_rows_from_f32(via, rb, &hf[0][0], N, R, HEADS, HD, dt);
            for (r = 0; r < R; r++) {
                CHECK(!memcmp(via + (size_t)r * rb, buf + (size_t)r * rb, rb - 3), "rows_from_half %d -> %d row %d", sdt, dt, r);
                if (sdt == dt) CHECK(!memcmp(buf + (size_t)r * rb, half[r], 2 * N), "straight copy");
            }
            free(via);
        }
        free(buf);
        free(one);
    }
    CHECK(fx_row_bytes(8, 128, FX_I8) * 1.0 / (8 * 128) == 1.0625, "int8 bytes per value at head_dim 128");
    printf("conversions: row functions for every dtype pair\n");
}

int conv_tests(void)
{
    test_f16_bf16();
    test_i8();
    test_hadamard();
    test_i4();
    test_rows();
    printf("conversions: %d failed\n", fails);
    return fails;
}
