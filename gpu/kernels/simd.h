/* AVX-512 helpers shared by the CPU kernels: 16 float32 lanes to and from bfloat16, rounding
 * to bfloat16 precision, and e^x. Included only where __AVX512F__ is defined. */
#ifndef TRIODE_SIMD_H
#define TRIODE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* 16 bfloat16 values as float32 lanes */
static inline __m512 bf16x16_load(const uint16_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* x rounded to the nearest bfloat16 (ties to even; a NaN stays a NaN), as float32 bits */
static inline __m512i bf16x16_round_bits(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet),
                            _mm512_set1_epi32((int)0xffff0000u));
}

static inline __m512 bf16x16_round(__m512 x) { return _mm512_castsi512_ps(bf16x16_round_bits(x)); }

static inline void bf16x16_store(uint16_t *p, __m512 x) {
    const __m512i high = _mm512_srli_epi32(bf16x16_round_bits(x), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(high));
}

/* e^x for x in [-87, 88] (clamped there): 2^(x log2 e) as an integer power and a degree-5
 * polynomial on [0, 1), relative error below 4e-6 */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, whole);
    __m512 p = _mm512_set1_ps(1.8775767e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9893397e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826318e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999994e-1f));
    return _mm512_scalef_ps(p, whole);
}

#endif
