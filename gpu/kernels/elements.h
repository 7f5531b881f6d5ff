/* Rows of either element type the fused kernels take, float32 or bfloat16, read and written
 * as float32: each kernel's body is one always-inlined function with an `f32` flag, and its two
 * exported entry points pass the flag as a constant, so the compiler builds one loop per type
 * from one source (the float32 loads and stores are plain, the bfloat16 ones shift and round).
 */
#ifndef TRIODE_ELEMENTS_H
#define TRIODE_ELEMENTS_H

#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define INLINE static inline __attribute__((always_inline))

/* p[i] as float32: p holds float32 (f32) or bfloat16 values */
INLINE float load_elem(const void *p, int64_t i, int f32) {
    return f32 ? ((const float *)p)[i] : bf16_f32(((const uint16_t *)p)[i]);
}

/* p[i] = v, rounded to bfloat16 unless p holds float32 (f32) */
INLINE void store_elem(void *p, int64_t i, float v, int f32) {
    if (f32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_bf16(v);
}

/* bytes per element */
INLINE int64_t elem_size(int f32) { return f32 ? 4 : 2; }

/* element i of an array of either type, as a pointer */
INLINE const void *elem_at(const void *p, int64_t i, int f32) {
    return (const char *)p + i * elem_size(f32);
}

/* e^x for a softmax or SiLU: libm's correctly rounded expf for float32 results, which are
 * compared with torch's float32; the vectorisable polynomial (relative error below 4e-6,
 * far under a bfloat16 rounding) for bfloat16 ones */
INLINE float exp_for(float x, int f32) { return f32 ? expf(x) : exp_clamped(x); }

#if defined(__AVX512F__)
#include "simd.h"

INLINE __m512 vec16_load(const void *p, int f32) {
    return f32 ? _mm512_loadu_ps((const float *)p) : bf16x16_load((const uint16_t *)p);
}

INLINE void vec16_store(void *p, __m512 v, int f32) {
    if (f32)
        _mm512_storeu_ps((float *)p, v);
    else
        bf16x16_store((uint16_t *)p, v);
}
#endif

#endif
