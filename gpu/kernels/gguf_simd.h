/* The float32 vector `gguf_matmul.c` computes with: AVX-512's 16 lanes, AVX2's 8 (with FMA
 * and F16C), or 8 lanes of plain C that the compiler vectorises as it can. TILE: rows of x
 * whose sums the registers hold at once. */
#ifndef TRIODE_GGUF_SIMD_H
#define TRIODE_GGUF_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define TILE 8
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
/* a in lanes 0-3 and 8-11, b in the others: a 16-weight group's scale and the next's, for
 * two vectors of a unit (`gguf_blocks.h`) */
static inline vf vf_halves(float a, float b) {
    const __m256d h = _mm256_castps_pd(_mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(h), h, 1));
}
/* the lanes' sum, halves added pairwise */
static inline float vf_sum(vf v) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), high);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LANES 8
#define TILE 4
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
/* a in lanes 0-3, b in 4-7: a 16-weight group's scale and the next's, for a unit's vector */
static inline vf vf_halves(float a, float b) {
    return _mm256_set_m128(_mm_set1_ps(b), _mm_set1_ps(a));
}
static inline float vf_sum(vf v) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}
#else
#define LANES 8
#define TILE 4
typedef struct {
    float v[LANES];
} vf;
static inline vf vf_zero(void) { return (vf){{0}}; }
static inline vf vf_set1(float x) {
    vf r;
    for (int i = 0; i < LANES; i++) r.v[i] = x;
    return r;
}
static inline vf vf_load(const float *p) {
    vf r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
static inline void vf_store(float *p, vf a) { memcpy(p, a.v, sizeof a.v); }
static inline vf vf_add(vf a, vf b) {
    for (int i = 0; i < LANES; i++) a.v[i] += b.v[i];
    return a;
}
static inline vf vf_sub(vf a, vf b) {
    for (int i = 0; i < LANES; i++) a.v[i] -= b.v[i];
    return a;
}
static inline vf vf_mul(vf a, vf b) {
    for (int i = 0; i < LANES; i++) a.v[i] *= b.v[i];
    return a;
}
/* a x b + c: fused where the target has FMA; else rounded twice, since a software fmaf is a
 * library call per lane */
static inline vf vf_fma(vf a, vf b, vf c) {
    for (int i = 0; i < LANES; i++)
#if defined(__FMA__)
        c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
#else
        c.v[i] += a.v[i] * b.v[i];
#endif
    return c;
}
static inline vf vf_halves(float a, float b) {
    vf r;
    for (int i = 0; i < LANES; i++) r.v[i] = i % 8 < 4 ? a : b;
    return r;
}
static inline float vf_sum(vf a) {
    for (int half = LANES / 2; half > 0; half /= 2)
        for (int i = 0; i < half; i++) a.v[i] += a.v[i + half];
    return a.v[0];
}
#endif

#endif
