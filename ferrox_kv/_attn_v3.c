/* _attn_v3.c -- the attention kernel for x86-64-v3 (AVX2, FMA, float16 by
 * F16C), in a build that dispatches (FX_ATTN_CLONES); empty otherwise. */
#include "_attn_kernel.h"

#if FX_ATTN_CLONES
FXA_ENTRY(__attribute__((target("arch=x86-64-v3"))), fxa_attend_v3, FXA_F16C, 1, 8)
#else
typedef int fxa_v3_not_built; /* ISO C: a translation unit declares something */
#endif
