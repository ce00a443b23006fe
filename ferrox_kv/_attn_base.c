/* _attn_base.c -- the attention kernel for the x86-64 baseline in a build
 * that dispatches (float16 by exact integer conversion: the baseline has no
 * F16C), or for whatever the compiler targets in a build that does not
 * (and then 16-float vectors too, where it targets AVX-512). */
#include "_attn_kernel.h"

#if FX_ATTN_CLONES
FXA_ENTRY(, fxa_attend_base, FX_F16, 0, 8)
#else
#define FXA_BASE_F16 (FXA_HAVE_F16C ? FXA_F16C : FX_F16)
FXA_ENTRY(, fxa_attend_base, FXA_BASE_F16, FXA_HAVE_I8DOT, 8)
#if FXA_HAVE_W16
FXA_ENTRY(, fxa_attend_base16, FXA_BASE_F16, FXA_HAVE_I8DOT, 16)
#endif
#endif
