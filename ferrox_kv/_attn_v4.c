/* _attn_v4.c -- the attention kernel on 16-float vectors: for x86-64-v4
 * (AVX-512) in a build that dispatches and a compiler that builds it
 * (FXA_HAVE_W16), or in a build without dispatch whose target has AVX-512;
 * empty otherwise.  fx_attend calls it for head dims that are multiples of
 * 16. */
#include "_attn_kernel.h"

#if FX_ATTN_CLONES && FXA_HAVE_W16
FXA_ENTRY(__attribute__((target("arch=x86-64-v4"))), fxa_attend_v4, FXA_F16C, 1, 16)
#elif FXA_HAVE_W16
FXA_ENTRY(, fxa_attend_base16, FXA_BASE_F16, FXA_HAVE_I8DOT, 16)
#else
typedef int fxa_v4_not_built; /* ISO C: a translation unit declares something */
#endif
