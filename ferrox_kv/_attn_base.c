/* _attn_base.c -- the attention kernel for the x86-64 baseline in a build
 * that dispatches (float16 by exact integer conversion: the baseline has no
 * F16C), or for whatever the compiler targets in a build that does not (on
 * 8-float vectors; _attn_v4.c holds its 16-float entry, so that the two
 * compile side by side). */
#include "_attn_kernel.h"

#if FX_ATTN_CLONES
FXA_ENTRY(, fxa_attend_base, FX_F16, 0, 8)
#else
FXA_ENTRY(, fxa_attend_base, FXA_BASE_F16, FXA_HAVE_I8DOT, 8)
#endif
