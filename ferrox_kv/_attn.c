/* _attn.c -- the attention kernel's entry points (_attn.h): which level's
 * instantiation runs (_attn_base.c, _attn_v3.c, _attn_v4.c), the scratch
 * size, and the names of the paths for simd_path(). */
#include "_attn_kernel.h"

/* The knobs of fx_attend_set_max_width and fx_attend_set_max_level. */
static int fxa_max_width = 16, fxa_max_level = 4;
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

/* The level whose instantiation runs: the CPU's, capped by the knob. */
static FX_UNUSED int fxa_level(void)
{
    const int cpu = fx_cpu_level(), cap = FXA_GET(fxa_max_level);
    return cpu < cap ? cpu : cap;
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
        fxa_attend_v4(kv, a, q, out, scratch);
        return;
    }
#endif
    if (fxa_level() >= 3) fxa_attend_v3(kv, a, q, out, scratch);
    else fxa_attend_base(kv, a, q, out, scratch);
#else /* one build: what the compiler targets */
#if FXA_HAVE_W16
    if (fx_attend_width(a) == 16) {
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
    case FX_I8: return "int8: widen x group scale";
    default: return NULL;
    }
}
