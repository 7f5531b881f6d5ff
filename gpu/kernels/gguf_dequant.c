/* GGUF blocks as float32 or bfloat16 weights: whole rows (`triode_gguf_dequantize`) or the
 * rows an embedding lookup names (`triode_gguf_gather`).
 *
 * float32 weights are gguf's numpy `dequantize` bit for bit: scale x code rounded, then the
 * minimum added or subtracted, rounded again (the library builds with -std=c11, under which
 * GCC does not contract the two into one fused multiply-add). bfloat16 weights are those
 * rounded to the nearest, ties to even.
 */
#include <string.h>

#include "gguf_blocks.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "gguf_avx2.h"
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
/* GCC tunes for AMD's EPYC here and vectorises in halves of AVX2's 256 bits */
#pragma GCC target("prefer-vector-width=256")
#endif

/* weights worth one thread each: below this the fork costs more than the work */
#define PARALLEL_WEIGHTS 65536

/* a unit's weights from unit order into the file's: position 8k + j is weight 4j + k */
static inline void file_order(const float *unit, float *out) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 v[4], n[4];
    for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(unit + 8 * k);
    unit_to_file_order(v, n);
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 8 * k, n[k]);
#else
    for (int j = 0; j < 8; j++)
        for (int k = 0; k < 4; k++) out[4 * j + k] = unit[8 * k + j];
#endif
}

/* unit u's weights in unit order; position 8k + j is in the unit's first 16 weights (a
 * 16-weight type's first group) where j < 4: lane j % 8 of `scale` and `minimum` */
static inline void unit_weights(const gguf_format *f, const gguf_chunk *c, int u, float *out) {
    const float *code = c->code + u * UNIT;
    if (f->plain) {
        memcpy(out, code, sizeof(float) * UNIT);
        return;
    }
    const int first = f->group == UNIT ? u : 2 * u, second = f->group == UNIT ? u : 2 * u + 1;
    float scale[8], minimum[8];
    for (int j = 0; j < 8; j++) {
        scale[j] = c->scale[j < 4 ? first : second];
        minimum[j] = c->minimum[j < 4 ? first : second];
    }
    for (int k = 0; k < 4; k++, code += 8, out += 8)
        if (!f->has_minimum)
            for (int j = 0; j < 8; j++) out[j] = scale[j] * code[j];
        else if (f->subtract)
            for (int j = 0; j < 8; j++) out[j] = scale[j] * code[j] - minimum[j];
        else
            for (int j = 0; j < 8; j++) out[j] = scale[j] * code[j] + minimum[j];
}

/* a chunk's first n weights into out, in the file's order */
static void chunk_weights(const gguf_format *f, const gguf_chunk *c, int n, float *out) {
    float unit[UNIT];
    for (int u = 0; u * UNIT < n; u++) {
        unit_weights(f, c, u, unit);
        if (n - u * UNIT >= UNIT) {
            file_order(unit, out + u * UNIT);
            continue;
        }
        for (int i = 0; i < n - u * UNIT; i++) out[u * UNIT + i] = unit[unit_position(i)];
    }
}

/* one row of `cols` weights from its blocks at w */
static void dequantize_row(const gguf_format *f, const uint8_t *w, int64_t cols, void *out,
                           int out_bf16) {
    gguf_chunk c;
    float weights[CHUNK];
    const int64_t blocks = cols / f->block_size, per_chunk = chunk_blocks(f);
    for (int64_t b = 0; b < blocks; b += per_chunk) {
        const int n = blocks - b < per_chunk ? (int)(blocks - b) : (int)per_chunk;
        const int count = n * f->block_size;
        const int64_t first = b * f->block_size;
        f->decode(w + b * f->block_bytes, n, &c);
        if (!out_bf16) {
            chunk_weights(f, &c, count, (float *)out + first);
            continue;
        }
        chunk_weights(f, &c, count, weights);
        uint16_t *o = (uint16_t *)out + first;
        for (int i = 0; i < count; i++) o[i] = f32_bf16(weights[i]);
    }
}

static inline void *row_at(void *out, int64_t r, int64_t stride, int out_bf16) {
    return (char *)out + r * stride * (out_bf16 ? 2 : 4);
}

/* The float weights of `rows` rows of blocks, row r at w + r x w_stride bytes, into out
 * [rows, out_stride] (float32, or bfloat16 if out_bf16). Returns 0, or -1 for a type this does
 * not take or cols not whole blocks. */
int triode_gguf_dequantize(int type, const uint8_t *w, int64_t w_stride, int64_t rows,
                           int64_t cols, void *out, int64_t out_stride, int out_bf16) {
    gguf_format f;
    if (gguf_format_of(type, &f) || cols < 1 || cols % f.block_size || rows < 0) return -1;
#pragma omp parallel for if (rows * cols >= PARALLEL_WEIGHTS)
    for (int64_t r = 0; r < rows; r++)
        dequantize_row(&f, w + r * w_stride, cols, row_at(out, r, out_stride, out_bf16), out_bf16);
    return 0;
}

/* As `triode_gguf_dequantize`, for rows ids[0..n) (the caller checks they are rows of w). */
int triode_gguf_gather(int type, const uint8_t *w, int64_t w_stride, int64_t cols,
                       const int64_t *ids, int64_t n, void *out, int64_t out_stride,
                       int out_bf16) {
    gguf_format f;
    if (gguf_format_of(type, &f) || cols < 1 || cols % f.block_size || n < 0) return -1;
#pragma omp parallel for if (n * cols >= PARALLEL_WEIGHTS)
    for (int64_t i = 0; i < n; i++)
        dequantize_row(&f, w + ids[i] * w_stride, cols, row_at(out, i, out_stride, out_bf16),
                       out_bf16);
    return 0;
}
