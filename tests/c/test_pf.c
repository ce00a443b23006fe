/* test_pf.c -- the attention kernel's prefetch walk (fxa_pf in
 * _attn_kernel.h) against the lines each row's ranges cover: each range's
 * lines in memory order (a line two ranges share comes once per range),
 * none outside, and all of them within the steps the walk was started
 * for.  That the kernel's step counts end each walk with its phase is
 * checked in the kernel itself (FX_ATTN_CHECK_PF, the native build).
 * Prefetch changes no result, so the float64 reference in test_attn.c
 * cannot see a wrong walk; this records it. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define PF_MAX 65536
static const char *pf_seen[PF_MAX];
static size_t pf_n;
static void pf_record(const void *p)
{
    if (pf_n < PF_MAX) pf_seen[pf_n] = (const char *)p;
    pf_n++;
}
#define FXA_PREFETCH_L2(p) pf_record(p)
#include "_attn_kernel.h"

int pf_tests(void);

/* Appends to want the lines of [p, p + len), in order. */
static size_t pf_lines(const char *p, size_t len, uintptr_t *want, size_t k)
{
    uintptr_t x = (uintptr_t)p & ~(uintptr_t)63;
    for (; len && x < (uintptr_t)p + len; x += 64) want[k++] = x;
    return k;
}

/* Bytes of n stored values, apart from _conv.h's helpers. */
static size_t pf_bytes(size_t n, int dt)
{
    return dt == FX_F32 ? 4 * n : dt == FX_I8 ? n : dt == FX_I4 ? n / 2 : 2 * n;
}

static char pf_buf[1 << 22]; /* 2 x (FX_C + 3) rows of up to 2 KiB + 64, FX_C <= 256 */
static uintptr_t pf_want[PF_MAX];

int pf_tests(void)
{
    static const int dts[] = {FX_F32, FX_F16, FX_BF16, FX_F16C, FX_I8, FX_I4};
    static const int geo[][2] = {{8, 128}, {3, 96}, {2, 64}, {1, 32}}; /* Hkv, head dim */
    static const int ns[] = {1, 5, FX_C};
    static const size_t steps_of[] = {1, 7, 100000};
    int n_fail = 0, n_cases = 0;
    size_t di, gi, ni, si, off, hi;
    for (di = 0; di < sizeof dts / sizeof dts[0]; di++)
        for (gi = 0; gi < sizeof geo / sizeof geo[0]; gi++)
            for (hi = 0; hi < 3; hi++)
                for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                    for (off = 0; off < 64; off += 24)
                        for (si = 0; si < sizeof steps_of / sizeof steps_of[0]; si++) {
                            const int dt = dts[di], Hkv = geo[gi][0], hd = geo[gi][1], n = ns[ni];
                            const int g0 = hi == 0 ? 0 : hi == 1 ? Hkv - 1 : Hkv / 2;
                            const int nh = hi == 0 ? Hkv : 1, sdt = dt == FX_F16C ? FX_F16 : dt;
                            const size_t rb = fx_row_bytes(Hkv, hd, sdt), ng = fx_i8_groups(hd);
                            const size_t vals = rb - (FX_QUANT(dt) ? 2 * (size_t)Hkv * ng : 0); /* scales after the values */
                            const char *row[2][FX_C];
                            fx_attn_args a;
                            fxa_pf pf;
                            size_t k = 0, s, j;
                            int seg, r;
                            memset(&a, 0, sizeof a);
                            a.n_kv_heads = Hkv;
                            a.head_dim = a.v_head_dim = hd;
                            /* two segments of n rows, the second after a gap */
                            for (seg = 0; seg < 2; seg++)
                                for (r = 0; r < n; r++) row[seg][r] = pf_buf + off + ((size_t)(seg * (n + 3) + r)) * rb;
                            pf.nseg = 0;
                            for (seg = 0; seg < 2; seg++) {
                                fxa_pf_add(&pf, row[seg], n, &a, g0, nh, hd, dt);
                                for (r = 0; r < n; r++) {
                                    k = pf_lines(row[seg][r] + pf_bytes((size_t)g0 * (size_t)hd, dt),
                                                 pf_bytes((size_t)nh * (size_t)hd, dt), pf_want, k);
                                    if (FX_QUANT(dt)) k = pf_lines(row[seg][r] + vals + 2 * (size_t)g0 * ng, 2 * (size_t)nh * ng, pf_want, k);
                                }
                            }
                            pf_n = 0;
                            fxa_pf_start(&pf, steps_of[si]);
                            for (s = 0; s < steps_of[si]; s++) fxa_pf_step(&pf);
                            n_cases++;
                            if (pf_n != k) {
                                printf("FAIL prefetch walk dt %d Hkv %d hd %d heads %d+%d n %d off %zu steps %zu: %zu lines, want %zu\n",
                                       dt, Hkv, hd, g0, nh, n, off, steps_of[si], pf_n, k);
                                n_fail++;
                                continue;
                            }
                            for (j = 0; j < k; j++)
                                if (((uintptr_t)pf_seen[j] & ~(uintptr_t)63) != pf_want[j]) {
                                    printf("FAIL prefetch walk dt %d Hkv %d hd %d heads %d+%d n %d off %zu: line %zu at %p, want %p\n",
                                           dt, Hkv, hd, g0, nh, n, off, j, (const void *)pf_seen[j], (void *)pf_want[j]);
                                    n_fail++;
                                    break;
                                }
                        }
    printf("prefetch walk: %d cases, %d failed\n", n_cases, n_fail);
    return n_fail;
}
