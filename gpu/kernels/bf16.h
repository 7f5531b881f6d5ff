/* Scalar helpers shared by the CPU kernels: bfloat16 to and from float32, float16 to float32,
 * and e^x. */
#ifndef TRIODE_BF16_H
#define TRIODE_BF16_H

#include <stdint.h>

typedef union {
    uint32_t bits;
    float value;
} word;

static inline float bf16_f32(uint16_t v) { return ((word){.bits = (uint32_t)v << 16}).value; }

/* a float16 as float32, exactly (normal, subnormal, zero, infinity, NaN) */
static inline float half_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 31u;
    const uint32_t mantissa = h & 0x3ffu;
    if (exponent == 31) return ((word){.bits = sign | 0x7f800000u | mantissa << 13}).value;
    if (exponent == 0) {
        const float f = (float)mantissa * 5.9604644775390625e-8f; /* m x 2^-24, exact */
        return sign ? -f : f;
    }
    return ((word){.bits = sign | (exponent + 112u) << 23 | mantissa << 13}).value;
}

/* rounded to the nearest bfloat16, ties to even; a NaN stays a NaN */
static inline uint16_t f32_bf16(float f) {
    const uint32_t bits = ((word){.value = f}).bits;
    const uint32_t nan = (bits & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(nan ? (bits >> 16) | 0x40u : rounded >> 16);
}

/* e^x on [-87, 88] (clamped there), vectorisable unlike libm's expf: 2^(x log2 e) split into
 * an integer power and a degree-5 polynomial on [0, 1); relative error below 4e-6. Arguments
 * under -87 give ~1e-38 instead of 0, which adds nothing to a softmax's sums. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504088896341f;
    const float whole = __builtin_floorf(t);
    const float f = t - whole;
    float p = 1.8775767e-3f;
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 9.9999994e-1f;
    return p * ((word){.bits = (uint32_t)((int32_t)whole + 127) << 23}).value;
}

#endif
