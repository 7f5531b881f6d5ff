/* The small operations between a decoder layer's projections, each fused into one pass over
 * its rows: residual add with RMS norm, rotary embedding with the KV-cache write,
 * SiLU-and-multiply; and the greedy pick from the logits. Each comes for bfloat16 and for
 * float32 rows (`_bf16`, `_f32`), both built from one body (`elements.h`).
 *
 * Each computes in float32. From bfloat16 inputs it rounds to bfloat16 once, at the end, where
 * the torch code it replaces (`layers.py`, `rotary.py`) rounds after every operation: the
 * results are nearer to a float32 model's, and differ from the torch path's in the last bit
 * here and there. In float32 it does the torch code's operations (expf for e^x), only summing
 * in another order.
 *
 * Built with `paged_attention.c` into one library by `cpu_kernels.py`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "elements.h"
#include "kernels.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
/* GCC tunes for AMD's first EPYC here and vectorises in halves of AVX2's 256 bits: whole
 * registers halve the norm's and the attention's loops */
#pragma GCC target("prefer-vector-width=256")
#endif

/* rows worth one thread each: below this the fork costs more than the work */
#define PARALLEL_ELEMENTS 16384

/* residual += x (float32; `add` 0: residual = x, the stream's start), then
 * out = weight * residual / rms(residual), in x's type.
 * x: [rows, x_stride]; residual: [rows, hidden] float32; weight: [hidden], x's type. */
INLINE void add_rms_norm(const void *x, int64_t x_stride, float *residual, const void *weight,
                         void *out, int64_t rows, int64_t hidden, float eps, int add, int f32) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const void *xr = elem_at(x, r * x_stride, f32);
        float *restrict res = residual + r * hidden;
        void *o = (char *)out + r * hidden * elem_size(f32);
        float squares = 0.0f;
        if (add) {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = res[i] + load_elem(xr, i, f32);
                res[i] = v;
                squares += v * v;
            }
        } else {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = load_elem(xr, i, f32);
                res[i] = v;
                squares += v * v;
            }
        }
        const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            store_elem(o, i, load_elem(weight, i, f32) * (res[i] * inv), f32);
    }
}

void triode_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, float *residual,
                              const uint16_t *weight, uint16_t *out, int64_t rows,
                              int64_t hidden, float eps, int add) {
    add_rms_norm(x, x_stride, residual, weight, out, rows, hidden, eps, add, 0);
}

void triode_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual,
                             const float *weight, float *out, int64_t rows, int64_t hidden,
                             float eps, int add) {
    add_rms_norm(x, x_stride, residual, weight, out, rows, hidden, eps, add, 1);
}

/* Rotate the queries and keys of each row of qkv in place (rotate-half layout: x * cos +
 * roll(x, half) * sin, with sin's first half negated in the table), then copy its keys and
 * values to cache slot slots[r]. qkv: [rows, row_stride], each row [num_heads queries, num_kv_heads keys,
 * num_kv_heads values] of head_dim; cos, sin: float32 [positions, head_dim]; caches:
 * [slots, num_kv_heads, head_dim], qkv's type. */
INLINE void rope_cache(void *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                       const float *cos, const float *sin, void *k_cache, void *v_cache,
                       const int64_t *slots, int f32) {
    const int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
    const int64_t size = elem_size(f32);
#pragma omp parallel for if (rows * row_stride >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        char *row = (char *)qkv + r * row_stride * size;
#if defined(__AVX512F__)
        if (half % 16 == 0 && half <= 64) {
            __m512 cs[2][8]; /* cos and sin of this row's position, in registers for every head */
            for (int64_t d = 0; d < head_dim; d += 16) {
                cs[0][d / 16] = _mm512_loadu_ps(c + d);
                cs[1][d / 16] = _mm512_loadu_ps(s + d);
            }
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
                char *x = row + h * head_dim * size;
                for (int64_t d = 0; d < half; d += 16) {
                    const int64_t l = d / 16, u = (half + d) / 16;
                    char *lo_at = x + d * size, *hi_at = x + (half + d) * size;
                    const __m512 lo = vec16_load(lo_at, f32), hi = vec16_load(hi_at, f32);
                    vec16_store(lo_at, _mm512_fmadd_ps(lo, cs[0][l], _mm512_mul_ps(hi, cs[1][l])),
                                f32);
                    vec16_store(hi_at, _mm512_fmadd_ps(hi, cs[0][u], _mm512_mul_ps(lo, cs[1][u])),
                                f32);
                }
            }
        } else
#endif
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            void *x = row + h * head_dim * size;
            float in[512];
            for (int64_t d = 0; d < head_dim; d++) in[d] = load_elem(x, d, f32);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const float rolled = in[d < half ? d + half : d - half];
                store_elem(x, d, in[d] * c[d] + rolled * s[d], f32);
            }
        }
        const int64_t slot = slots[r];
        memcpy((char *)k_cache + slot * kv_size * size, row + num_heads * head_dim * size,
               kv_size * size);
        memcpy((char *)v_cache + slot * kv_size * size, row + (num_heads * head_dim + kv_size) * size,
               kv_size * size);
    }
}

void triode_rope_cache_bf16(uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                            const float *cos, const float *sin, uint16_t *k_cache,
                            uint16_t *v_cache, const int64_t *slots) {
    rope_cache(qkv, row_stride, rows, num_heads, num_kv_heads, head_dim, positions, cos, sin,
               k_cache, v_cache, slots, 0);
}

void triode_rope_cache_f32(float *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                           const float *cos, const float *sin, float *k_cache, float *v_cache,
                           const int64_t *slots) {
    rope_cache(qkv, row_stride, rows, num_heads, num_kv_heads, head_dim, positions, cos, sin,
               k_cache, v_cache, slots, 1);
}

/* out = silu(gate) * up in x's type; x: [rows, 2 * size] (gate, then up), out: [rows, size] */
INLINE void silu_mul(const void *x, void *out, int64_t rows, int64_t size, int f32) {
#pragma omp parallel for if (rows * size >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const void *gate = elem_at(x, r * 2 * size, f32), *up = elem_at(gate, size, f32);
        void *o = (char *)out + r * size * elem_size(f32);
        int64_t i = 0;
#if defined(__AVX512F__)
        /* the polynomial e^x, close enough for bfloat16; float32 takes expf below */
        for (; !f32 && i + 16 <= size; i += 16) {
            const __m512 g = vec16_load(elem_at(gate, i, f32), f32);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            vec16_store((char *)o + i * elem_size(f32),
                        _mm512_mul_ps(silu, vec16_load(elem_at(up, i, f32), f32)), f32);
        }
#endif
        for (; i < size; i++) {
            const float g = load_elem(gate, i, f32);
            const float silu = g / (1.0f + exp_for(-g, f32));
            store_elem(o, i, silu * load_elem(up, i, f32), f32);
        }
    }
}

void triode_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t size) {
    silu_mul(x, out, rows, size, 0);
}

void triode_silu_mul_f32(const float *x, float *out, int64_t rows, int64_t size) {
    silu_mul(x, out, rows, size, 1);
}

/* x's first NaN, if any, counts as its largest value: what torch.max picks */
static inline int beats(float v, float best) {
    return v > best || (isnan(v) && !isnan(best));
}

#define CHAINS 4 /* the vector argmax's independent running maxima */

/* out[r] = the index of row r's largest value, the first of equals: x [rows, cols], rows
 * `stride` apart; the greedy pick straight from the logits' own type. */
INLINE void argmax(const void *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                   int f32) {
#pragma omp parallel for if (rows * cols >= PARALLEL_ELEMENTS * 4)
    for (int64_t r = 0; r < rows; r++) {
        const void *row = elem_at(x, r * stride, f32);
        float best = -INFINITY;
        int64_t at = 0, i = 0;
#if defined(__AVX512F__)
        if (cols >= 16 * CHAINS) {
            /* CHAINS independent running maxima, each over every CHAINS-th vector: one chain's
             * compare-and-blend waits on its last, so one chain alone runs at its latency */
            __m512 top[CHAINS];
            __m512i where[CHAINS];
            const __m512i iota =
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            for (int k = 0; k < CHAINS; k++) {
                top[k] = vec16_load(elem_at(row, 16 * k, f32), f32);
                where[k] = _mm512_add_epi32(iota, _mm512_set1_epi32(16 * k));
            }
            __m512i index = iota;
            for (i = 16 * CHAINS; i + 16 * CHAINS <= cols; i += 16 * CHAINS) {
                index = _mm512_add_epi32(index, _mm512_set1_epi32(16 * CHAINS));
                for (int k = 0; k < CHAINS; k++) {
                    const __m512 v = vec16_load(elem_at(row, i + 16 * k, f32), f32);
                    const __mmask16 nan_v = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                    const __mmask16 nan_top = _mm512_cmp_ps_mask(top[k], top[k], _CMP_UNORD_Q);
                    const __mmask16 pick =
                        _mm512_cmp_ps_mask(v, top[k], _CMP_GT_OQ) | (nan_v & ~nan_top);
                    top[k] = _mm512_mask_mov_ps(top[k], pick, v);
                    where[k] = _mm512_mask_mov_epi32(
                        where[k], pick, _mm512_add_epi32(index, _mm512_set1_epi32(16 * k)));
                }
            }
            /* each lane of each chain holds the first of its largest: the largest of those,
             * the first of equals (a NaN the largest, the first NaN of NaNs) */
            float lanes[16 * CHAINS];
            int32_t lane_at[16 * CHAINS];
            for (int k = 0; k < CHAINS; k++) {
                _mm512_storeu_ps(lanes + 16 * k, top[k]);
                _mm512_storeu_si512((void *)(lane_at + 16 * k), where[k]);
            }
            best = lanes[0], at = lane_at[0];
            for (int j = 1; j < 16 * CHAINS; j++)
                if (beats(lanes[j], best) || (lanes[j] == best && lane_at[j] < at) ||
                    (isnan(lanes[j]) && isnan(best) && lane_at[j] < at))
                    best = lanes[j], at = lane_at[j];
        }
#endif
        for (; i < cols; i++) {
            const float v = load_elem(row, i, f32);
            if (beats(v, best)) best = v, at = i;
        }
        out[r] = at;
    }
}

void triode_argmax_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t stride,
                        int64_t *out) {
    argmax(x, rows, cols, stride, out, 0);
}

void triode_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride,
                       int64_t *out) {
    argmax(x, rows, cols, stride, out, 1);
}
