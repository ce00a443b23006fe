/* _attn_v4.c -- the attention kernel on 16-float vectors: for x86-64-v4
 * (AVX-512) in a build that dispatches and a compiler that builds it
 * (FXA_HAVE_W16), with an int8 instance of its own for CPUs with AVX-512
 * VNNI; or in a build without dispatch whose target has AVX-512; empty
 * otherwise.  fx_attend calls it for head dims that are multiples of 16. */
#include "_attn_kernel.h"

#if FX_ATTN_CLONES && FXA_HAVE_W16
FXA_ENTRY(__attribute__((target("arch=x86-64-v4"))), fxa_attend_v4, FXA_F16C, 1, 16)
/* int8 rows on a CPU with AVX-512 VNNI (fx_attend checks it) */
__attribute__((target("arch=x86-64-v4,avx512vnni"))) FX_API void
fxa_attend_v4_i8vnni(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out, float *scratch)
{
    fxa_attend_body(kv, a, q, out, scratch, FX_I8, 16, 2);
}
#elif FXA_HAVE_W16
FXA_ENTRY(, fxa_attend_base16, FXA_BASE_F16, FXA_HAVE_I8DOT, 16)
#if FXA_BASE_VNNI
FX_API void fxa_attend_base16_i8vnni(const fx_kv *kv, const fx_attn_args *a, const float *q, float *out,
                                     float *scratch)
{
    fxa_attend_body(kv, a, q, out, scratch, FX_I8, 16, 2);
}
#endif
#else
typedef int fxa_v4_not_built; /* ISO C: a translation unit declares something */
#endif
