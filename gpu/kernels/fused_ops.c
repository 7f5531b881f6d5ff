/* The small bfloat16 operations between a decoder layer's projections, each fused into one
 * pass over its rows: residual add with RMS norm, rotary embedding with the KV-cache write,
 * SiLU-and-multiply; and the greedy pick from bfloat16 logits.
 *
 * Each computes in float32 from its bfloat16 inputs and rounds to bfloat16 once, at the end,
 * where the torch code it replaces (`layers.py`, `rotary.py`) rounds after every operation: the results are
 * nearer to a float32 model's, and differ from the torch path's in the last bit here and there.
 *
 * Built with `paged_attention.c` into one library by `cpu_kernels.py`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#include "simd.h"
#endif

/* rows worth one thread each: below this the fork costs more than the work */
#define PARALLEL_ELEMENTS 16384

/* residual += x (float32; `add` 0: residual = x, the stream's start), then
 * out = weight * residual / rms(residual), rounded to bfloat16.
 * x: [rows, x_stride] bfloat16; residual: [rows, hidden] float32; weight: [hidden]. */
void triode_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, float *residual,
                              const uint16_t *weight, uint16_t *out, int64_t rows,
                              int64_t hidden, float eps, int add) {
#pragma omp parallel for if (rows * hidden >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        float *res = residual + r * hidden;
        uint16_t *o = out + r * hidden;
        float squares = 0.0f;
        if (add) {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = res[i] + bf16_f32(xr[i]);
                res[i] = v;
                squares += v * v;
            }
        } else {
#pragma omp simd reduction(+ : squares)
            for (int64_t i = 0; i < hidden; i++) {
                const float v = bf16_f32(xr[i]);
                res[i] = v;
                squares += v * v;
            }
        }
        const float inv = 1.0f / sqrtf(squares / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = f32_bf16(bf16_f32(weight[i]) * (res[i] * inv));
    }
}

/* Rotate the queries and keys of each row of qkv in place (rotate-half layout: x * cos +
 * roll(x, half) * sin, with sin's first half negated in the table), then copy its keys and
 * values to cache slot slots[r]. qkv: [rows, row_stride], each row [num_heads queries, num_kv_heads keys,
 * num_kv_heads values] of head_dim; cos, sin: float32 [positions, head_dim]; caches:
 * [slots, num_kv_heads, head_dim]. */
void triode_rope_cache_bf16(uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                            const float *cos, const float *sin, uint16_t *k_cache,
                            uint16_t *v_cache, const int64_t *slots) {
    const int64_t half = head_dim / 2, kv_size = num_kv_heads * head_dim;
#pragma omp parallel for if (rows * row_stride >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + positions[r] * head_dim, *s = sin + positions[r] * head_dim;
        uint16_t *row = qkv + r * row_stride;
#if defined(__AVX512F__)
        if (half % 16 == 0 && half <= 64) {
            __m512 cs[2][8]; /* cos and sin of this row's position, in registers for every head */
            for (int64_t d = 0; d < head_dim; d += 16) {
                cs[0][d / 16] = _mm512_loadu_ps(c + d);
                cs[1][d / 16] = _mm512_loadu_ps(s + d);
            }
            for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
                uint16_t *x = row + h * head_dim;
                for (int64_t d = 0; d < half; d += 16) {
                    const int64_t l = d / 16, u = (half + d) / 16;
                    const __m512 lo = bf16x16_load(x + d), hi = bf16x16_load(x + half + d);
                    bf16x16_store(x + d, _mm512_fmadd_ps(lo, cs[0][l], _mm512_mul_ps(hi, cs[1][l])));
                    bf16x16_store(x + half + d,
                                  _mm512_fmadd_ps(hi, cs[0][u], _mm512_mul_ps(lo, cs[1][u])));
                }
            }
        } else
#endif
        for (int64_t h = 0; h < num_heads + num_kv_heads; h++) {
            uint16_t *x = row + h * head_dim;
            float in[512];
            for (int64_t d = 0; d < head_dim; d++) in[d] = bf16_f32(x[d]);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) {
                const float rolled = in[d < half ? d + half : d - half];
                x[d] = f32_bf16(in[d] * c[d] + rolled * s[d]);
            }
        }
        const int64_t slot = slots[r];
        memcpy(k_cache + slot * kv_size, row + num_heads * head_dim, kv_size * sizeof *row);
        memcpy(v_cache + slot * kv_size, row + num_heads * head_dim + kv_size,
               kv_size * sizeof *row);
    }
}

/* out = silu(gate) * up, rounded to bfloat16; x: [rows, 2 * size] (gate, then up),
 * out: [rows, size]. */
void triode_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t size) {
#pragma omp parallel for if (rows * size >= PARALLEL_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = x + r * 2 * size, *up = gate + size;
        uint16_t *o = out + r * size;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= size; i += 16) {
            const __m512 g = bf16x16_load(gate + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            bf16x16_store(o + i, _mm512_mul_ps(silu, bf16x16_load(up + i)));
        }
#endif
        for (; i < size; i++) {
            const float g = bf16_f32(gate[i]);
            const float silu = g / (1.0f + exp_clamped(-g));
            o[i] = f32_bf16(silu * bf16_f32(up[i]));
        }
    }
}

/* x's first NaN, if any, counts as its largest value: what torch.max picks */
static inline int beats(float v, float best) {
    return v > best || (isnan(v) && !isnan(best));
}

/* out[r] = the index of row r's largest value, the first of equals: x [rows, cols] bfloat16,
 * rows `stride` apart; the greedy pick straight from the logits' own dtype. */
void triode_argmax_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t stride,
                        int64_t *out) {
#pragma omp parallel for if (rows * cols >= PARALLEL_ELEMENTS * 4)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * stride;
        float best = -INFINITY;
        int64_t at = 0, i = 0;
#if defined(__AVX512F__)
        if (cols >= 16) {
            __m512 top = bf16x16_load(row);
            __m512i where = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            __m512i index = where;
            const __m512i step = _mm512_set1_epi32(16);
            for (i = 16; i + 16 <= cols; i += 16) {
                index = _mm512_add_epi32(index, step);
                const __m512 v = bf16x16_load(row + i);
                const __mmask16 nan_v = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                const __mmask16 nan_top = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
                const __mmask16 pick = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ) | (nan_v & ~nan_top);
                top = _mm512_mask_mov_ps(top, pick, v);
                where = _mm512_mask_mov_epi32(where, pick, index);
            }
            float lanes[16];
            int32_t lane_at[16];
            _mm512_storeu_ps(lanes, top);
            _mm512_storeu_si512((void *)lane_at, where);
            best = lanes[0], at = lane_at[0];
            for (int j = 1; j < 16; j++)
                if (beats(lanes[j], best) || (lanes[j] == best && lane_at[j] < at) ||
                    (isnan(lanes[j]) && isnan(best) && lane_at[j] < at))
                    best = lanes[j], at = lane_at[j];
        }
#endif
        for (; i < cols; i++) {
            const float v = bf16_f32(row[i]);
            if (beats(v, best)) best = v, at = i;
        }
        out[r] = at;
    }
}
