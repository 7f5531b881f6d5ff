/* The GGUF product's integer mode, llama.cpp's arithmetic: y = x W^T with x quantized to 8
 * bits per unit and each unit of W's codes multiplied by those in integers.
 *
 * x's unit is the weights' block: 32 values against the 32-weight types, a superblock of 256
 * against the K-quants (llama.cpp's Q8_0 and Q8_K). Per unit: scale dx = (largest |x| of the
 * unit) / 127, q = x / dx rounded to nearest (ties to even), |q| <= 127; and s, the sum of q
 * over each 16.
 *
 * The 32-weight types: per block, y += d dx (codes . q), the dot an exact int32 (Q8_0, Q4_0
 * and Q5_0 signed codes by llama.cpp's sign trick: |w| times q with w's sign), and for Q4_1
 * and Q5_1 the minimum's m dx (q's sum), summed apart; the float terms in eight lanes, lane m
 * the weights 4m..4m+3 of each block, the lanes summed as a 256-bit vector's halves are. The
 * K-quants: per superblock one exact int32, its units' codes . q each times its integer scale
 * (`vpmaddubsw`, then `vpmaddwd` or `vpdpwssd` with the scales; Q6_K's codes are stored 0..63
 * for -32..31, and 32 x its scales . s comes off), then y += d dx (that sum), and for Q4_K and
 * Q5_K y -= dmin dx (their minimums . s), one fused multiply-add each. The K-quants' x8
 * layout (`gguf_int8_x8.c`, 8 rows' superblocks interleaved) gives the same integers and the
 * same float operations, so the same bits.
 *
 * Every build (AVX2, AVX512-VNNI / AVX-VNNI, portable C; `gguf_int8.h`'s operations) gives
 * the same bits. What differs from the exact mode is x rounded to 8 bits: at most half a
 * step, dx / 2, per value.
 *
 * Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K. x float32 or bfloat16, 1 to
 * GGUF_MAX_ROWS rows; output rows split over torch's OpenMP threads in one contiguous range
 * each (each thread then streams its weights in order: dynamic chunks of 8 rows read them at
 * half the memory's rate).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "kernels.h"


#define MAX_ROWS 64
#define OUTPUT_BLOCK 8 /* an x8 group's outputs */

/* n values of x from `at` as float32 into v (bfloat16 widened exactly); returns the largest
 * magnitude, or NaN where a value is an infinity or a NaN */
static float unit_values(const void *x, int64_t at, int n, int bf16, float *v) {
#ifdef INT8_SIMD
    const __m256 sign = _mm256_set1_ps(-0.0f), largest = _mm256_set1_ps(3.4028235e38f);
    __m256 amax = _mm256_setzero_ps(), finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < n; i += 8) {
        const __m256 f =
            bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(
                       _mm256_cvtepu16_epi32(
                           _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + i))),
                       16))
                 : _mm256_loadu_ps((const float *)x + at + i);
        const __m256 magnitude = _mm256_andnot_ps(sign, f);
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(magnitude, largest, _CMP_LE_OQ));
        amax = _mm256_max_ps(amax, magnitude);
        _mm256_storeu_ps(v + i, f);
    }
    if (_mm256_movemask_ps(finite) != 0xff) return NAN;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        v[i] = bf16 ? bf16_f32(((const uint16_t *)x)[at + i]) : ((const float *)x)[at + i];
        finite &= isfinite(v[i]) != 0;
        amax = fmaxf(amax, fabsf(v[i]));
    }
    return finite ? amax : NAN;
#endif
}

/* q = v x inverse rounded to nearest, ties to even (|q| <= 127) */
static void unit_codes(const float *v, int n, float inverse, int8_t *q) {
#ifdef INT8_SIMD
    const __m256 by = _mm256_set1_ps(inverse);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < n; i += 32) {
        __m256i c[4];
        for (int k = 0; k < 4; k++)
            c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i + 8 * k), by));
        const __m256i low = _mm256_packs_epi32(c[0], c[1]), high = _mm256_packs_epi32(c[2], c[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(low, high), order);
        _mm256_storeu_si256((__m256i *)(q + i), bytes);
    }
#else
    for (int i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(v[i] * inverse);
#endif
}

/* rows of x to 8 bits per unit (cols whole units); 0, or -1 without memory */
static int quantize(const void *x, int64_t x_stride, int bf16, qx *k) {
    const int64_t units = k->cols / k->unit;
    const int unit = (int)k->unit;
    k->q = malloc((size_t)(k->rows * k->cols));
    k->dx = malloc(sizeof(float) * (size_t)(k->rows * units));
    k->s = malloc(sizeof(int16_t) * (size_t)(k->rows * k->cols / 16));
    k->u = malloc(sizeof(int16_t) * (size_t)(k->rows * k->cols / UNIT));
    if (k->q == NULL || k->dx == NULL || k->s == NULL || k->u == NULL) return -1;
    for (int64_t r = 0; r < k->rows; r++)
        for (int64_t u = 0; u < units; u++) {
            float v[QK_K];
            const float amax = unit_values(x, r * x_stride + u * unit, unit, bf16, v);
            int8_t *q = k->q + r * k->cols + u * unit;
            /* a unit with an infinity or a NaN makes every output it meets NaN, as the exact
             * mode's products do: scale NaN, codes 0 */
            const float d = amax / 127.0f;
            if (isnan(d))
                memset(q, 0, (size_t)unit);
            else
                unit_codes(v, unit, d != 0.0f ? 1.0f / d : 0.0f, q);
            int16_t *s = k->s + (r * k->cols + u * unit) / 16;
            for (int g = 0; g < unit / 16; g++) {
                int sum = 0;
                for (int i = 0; i < 16; i++) sum += q[16 * g + i];
                s[g] = (int16_t)sum;
            }
            k->dx[r * units + u] = d;
        }
    for (int64_t i = 0; i < k->rows * k->cols / UNIT; i++)
        k->u[i] = (int16_t)(k->s[2 * i] + k->s[2 * i + 1]);
    return 0;
}

static void release(qx *k) {
    free(k->q);
    free(k->dx);
    free(k->s);
    free(k->u);
}

/* ---- one output row against rows r0..r0+mr-1 of x ---- */

/* each kernel is inlined per row count (`BY_ROWS`): the row loops unroll, the sums stay in
 * registers */
#define INLINE static inline __attribute__((always_inline))
#define BY_ROWS(name, ...)                                                                    \
    switch (mr) {                                                                             \
    case 1: name(__VA_ARGS__, 1); break;                                                      \
    case 2: name(__VA_ARGS__, 2); break;                                                      \
    case 3: name(__VA_ARGS__, 3); break;                                                      \
    default: name(__VA_ARGS__, 4); break;                                                     \
    }

/* The 32-weight blocks, x's unit a block: Q8_0 (d | codes[32], signed), Q4_0 (d | nibbles[16],
 * codes less 8), Q5_0 (d | fifth bits[4] | nibbles[16], less 16), Q4_1 and Q5_1 (d | m | ...:
 * codes without sign, w = d code + m). Per block, y += d dx (codes . q), and for the types with
 * a minimum, m dx (q's sum), summed apart (in one fused multiply-add per block) and added at
 * the end. Nibble i holds weight i, its high half weight i + 16. */
INLINE void block_rows(const uint8_t *w, const int type, const qx *k, int64_t r0, float *out,
                       const int mr) {
    const int64_t units = k->cols / UNIT;
    const int bytes = type == GGUF_Q8_0   ? 34
                      : type == GGUF_Q4_0 ? 18
                      : type == GGUF_Q5_0 ? 22
                      : type == GGUF_Q4_1 ? 20
                                          : 24;
    const int minimum = type == GGUF_Q4_1 || type == GGUF_Q5_1;
    lanes acc[ROW_TILE];
    float shift[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = lanes_zero(), shift[r] = 0.0f;
    for (int64_t u = 0; u < units; u++, w += bytes) {
        const float d = half_at(w), m = minimum ? half_at(w + 2) : 0.0f;
        signed_codes sc;
        codes c;
        if (type == GGUF_Q8_0) sc = bytes_at(w + 2);
        if (type == GGUF_Q4_0) sc = less(block_nibbles(w + 2), 8);
        if (type == GGUF_Q5_0) sc = less(with_fifth(block_nibbles(w + 6), u32_at(w + 2)), 16);
        if (type == GGUF_Q4_1) c = block_nibbles(w + 4);
        if (type == GGUF_Q5_1) c = with_fifth(block_nibbles(w + 8), u32_at(w + 4));
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const int8_t *q = k->q + row * k->cols + u * UNIT;
            const float dx = k->dx[row * units + u];
            acc[r] = lanes_fma(minimum ? unsigned_dot(c, q) : signed_dot(sc, q), d * dx, acc[r]);
            if (minimum) {
                const int16_t *s = k->s + row * k->cols / 16 + 2 * u;
                shift[r] = __builtin_fmaf(m * dx, (float)(s[0] + s[1]), shift[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) out[r] = lanes_sum(acc[r]) + shift[r];
}

#define BLOCK_ROW(name, type)                                                                  \
    static void name(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {          \
        BY_ROWS(block_rows, w, type, k, r0, out)                                                \
    }
BLOCK_ROW(q8_0_row, GGUF_Q8_0)
BLOCK_ROW(q4_0_row, GGUF_Q4_0)
BLOCK_ROW(q5_0_row, GGUF_Q5_0)
BLOCK_ROW(q4_1_row, GGUF_Q4_1)
BLOCK_ROW(q5_1_row, GGUF_Q5_1)

/* a Q4_K or Q5_K superblock's unit j codes (`gguf_int8.h`) */
typedef codes (*k_codes)(const uint8_t *w, int j);

/* Q4_K and Q5_K: per superblock and row of x, the units' codes . q times their 6-bit scales
 * in integers, and the minimums' codes . s, each then times d dx or dmin dx */
INLINE void k_rows(const uint8_t *w, int64_t bytes, k_codes unit, const qx *k, int64_t r0,
                   float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    float acc[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        uint64_t sc, m;
        gguf_k_scale_words(w, &sc, &m);
        const unit_scales units = unit_scales_of(sc);
        const float d = half_at(w), dmin = half_at(w + 2);
        ints sum[ROW_TILE];
        for (int r = 0; r < mr; r++) sum[r] = ints_zero();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const codes c = unit(w, j);
            const scales s = unit_scale(units, j);
            const int8_t *q = k->q + r0 * k->cols + b * QK_K + j * UNIT;
            for (int r = 0; r < mr; r++) sum[r] = scaled_dot(sum[r], c, q + r * k->cols, s);
        }
        const scales minimums = scales_pairs(m);
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const float dx = k->dx[row * blocks + b];
            const int16_t *s = k->s + row * k->cols / 16 + 16 * b;
            const int32_t mins = ints_sum(pairs_dot(ints_zero(), scales_load(s), minimums));
            acc[r] = __builtin_fmaf((float)ints_sum(sum[r]), d * dx, acc[r]);
            acc[r] = __builtin_fmaf(-(float)mins, dmin * dx, acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

static void q4_k_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    BY_ROWS(k_rows, w, 144, q4_k_codes, k, r0, out)
}

/* Q5_K: `q5_k_codes`' layout */
static void q5_k_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    BY_ROWS(k_rows, w, 176, q5_k_codes, k, r0, out)
}

/* Q6_K (`q6_k_codes`' layout): unit j's halves take the int8 scales 2j and 2j + 1. Its codes
 * are stored 0..63 for -32..31: 32 x scales . s comes off the sum. */
INLINE void q6_k_rows(const uint8_t *w, const qx *k, int64_t r0, float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    float acc[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++, w += 210) {
        const scales all = scales_of_bytes((const int8_t *)(w + 192));
        const float d = half_at(w + 208);
        ints sum[ROW_TILE];
        for (int r = 0; r < mr; r++) sum[r] = ints_zero();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const codes c = q6_k_codes(w, j);
            const scales s = half_scales(all, j);
            const int8_t *q = k->q + r0 * k->cols + b * QK_K + j * UNIT;
            for (int r = 0; r < mr; r++) sum[r] = scaled_dot(sum[r], c, q + r * k->cols, s);
        }
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const ints offsets =
                pairs_dot(ints_zero(), scales_load(k->s + row * k->cols / 16 + 16 * b), all);
            const int32_t total = ints_sum(ints_sub32(sum[r], offsets));
            acc[r] = __builtin_fmaf((float)total, d * k->dx[row * blocks + b], acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = acc[r];
}

static void q6_k_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    BY_ROWS(q6_k_rows, w, k, r0, out)
}

typedef void (*row_kernel)(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out);

/* the kernel of GGML type `type` (an x8 layout's: GGUF_X8 + the file's type); its block size,
 * and how many outputs a call writes per row of x (1, or an x8 group's 8) */
static row_kernel kernel_of(int type, int *block_size, int *per_call) {
    const int base = type >= GGUF_X8 ? type - GGUF_X8 : type;
    *block_size = base == GGUF_Q4_K || base == GGUF_Q5_K || base == GGUF_Q6_K ? QK_K : UNIT;
    *per_call = type >= GGUF_X8 ? OUTPUT_BLOCK : 1;
    if (type >= GGUF_X8) return gguf_x8_kernel(type);
    if (type == GGUF_Q8_0) return q8_0_row;
    if (type == GGUF_Q4_0) return q4_0_row;
    if (type == GGUF_Q5_0) return q5_0_row;
    if (type == GGUF_Q4_1) return q4_1_row;
    if (type == GGUF_Q5_1) return q5_1_row;
    if (type == GGUF_Q4_K) return q4_k_row;
    if (type == GGUF_Q5_K) return q5_k_row;
    if (type == GGUF_Q6_K) return q6_k_row;
    return NULL;
}

/* whether this library's integer mode takes GGML type `type` */
int triode_gguf_int8_takes(int type) {
    int size, per_call;
    return kernel_of(type, &size, &per_call) != NULL;
}

/* x's quantization, as the product does it for a type with blocks of `unit` values (32 or
 * 256): q [rows, cols], dx [rows, cols / unit], s [rows, cols / 16]. Returns 0, or -1 (unit
 * not 32 or 256, cols not whole units, rows < 1, no memory). */
int triode_gguf_quantize_int8(const void *x, int64_t x_stride, int64_t rows, int64_t cols,
                              int64_t unit, int bf16, int8_t *q, float *dx, int32_t *s) {
    qx k = {.rows = rows, .cols = cols, .unit = unit};
    int status = -1;
    if ((unit == UNIT || unit == QK_K) && rows >= 1 && cols >= unit && cols % unit == 0 &&
        quantize(x, x_stride, bf16, &k) == 0) {
        memcpy(q, k.q, (size_t)(rows * cols));
        memcpy(dx, k.dx, sizeof(float) * (size_t)(rows * cols / unit));
        for (int64_t i = 0; i < rows * cols / 16; i++) s[i] = k.s[i];
        status = 0;
    }
    release(&k);
    return status;
}

static inline void put(void *y, int64_t at, float v, int bf16) {
    if (bf16)
        ((uint16_t *)y)[at] = f32_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* y [rows, y_stride] = x [rows, x_stride] W^T (+ bias) for W the `count` parts' rows stacked
 * (a merged projection's parts, read where they lie, or as x8 groups): part p's outputs are
 * y's columns after those of the parts before it. x is quantized once per unit size the parts
 * need, and one parallel loop covers every part's rows, 8 outputs an item. Returns 0, or -1
 * for arguments it does not take (a type without an integer kernel, cols not whole blocks,
 * rows outside 1..MAX_ROWS, more than GGUF_MAX_PARTS parts, no memory). */
int triode_gguf_matmul_int8_parts(const gguf_part *parts, int count, const void *x,
                                  int64_t x_stride, int64_t rows, int64_t cols, const float *bias,
                                  void *y, int64_t y_stride, int bf16) {
    row_kernel kernels[GGUF_MAX_PARTS];
    int64_t first_block[GGUF_MAX_PARTS + 1] = {0}, first_output[GGUF_MAX_PARTS] = {0};
    int sizes[GGUF_MAX_PARTS], per_call[GGUF_MAX_PARTS], need_units = 0, need_blocks = 0;
    if (count < 1 || count > GGUF_MAX_PARTS || cols < 1 || rows < 1 || rows > MAX_ROWS)
        return -1;
    for (int p = 0; p < count; p++) {
        kernels[p] = kernel_of(parts[p].type, &sizes[p], &per_call[p]);
        if (kernels[p] == NULL || cols % sizes[p] || parts[p].outputs < 0) return -1;
        need_units |= sizes[p] == UNIT;
        need_blocks |= sizes[p] == QK_K;
        first_block[p + 1] = first_block[p] + (parts[p].outputs + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK;
        if (p > 0) first_output[p] = first_output[p - 1] + parts[p - 1].outputs;
    }
    qx units = {.rows = rows, .cols = cols, .unit = UNIT};
    qx blocks = {.rows = rows, .cols = cols, .unit = QK_K};
    int status = 0;
    if (need_units) status |= quantize(x, x_stride, bf16, &units);
    if (need_blocks) status |= quantize(x, x_stride, bf16, &blocks);
    if (status == 0) {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < first_block[count]; b++) {
            int p = 0;
            while (b >= first_block[p + 1]) p++;
            const gguf_part *part = &parts[p];
            const qx *k = sizes[p] == UNIT ? &units : &blocks;
            const int64_t first = (b - first_block[p]) * OUTPUT_BLOCK;
            const int64_t end = part->outputs < first + OUTPUT_BLOCK ? part->outputs : first + OUTPUT_BLOCK;
            const int tile = per_call[p] == OUTPUT_BLOCK ? X8_TILE : ROW_TILE;
            for (int64_t r0 = 0; r0 < rows; r0 += tile) {
                const int mr = rows - r0 < tile ? (int)(rows - r0) : tile;
                float out[X8_TILE * OUTPUT_BLOCK];
                if (per_call[p] == OUTPUT_BLOCK) {  /* the group's outputs at once */
                    kernels[p](part->w + (b - first_block[p]) * part->w_stride, k, r0, mr, out);
                } else {
                    for (int64_t o = first; o < end; o++) {
                        float one[ROW_TILE];
                        kernels[p](part->w + o * part->w_stride, k, r0, mr, one);
                        for (int r = 0; r < mr; r++) out[OUTPUT_BLOCK * r + o - first] = one[r];
                    }
                }
                for (int r = 0; r < mr; r++)
                    for (int64_t o = first; o < end; o++) {
                        const int64_t column = first_output[p] + o;
                        const float v = out[OUTPUT_BLOCK * r + o - first];
                        put(y, (r0 + r) * y_stride + column, bias != NULL ? v + bias[column] : v, bf16);
                    }
            }
        }
    }
    release(&units);
    release(&blocks);
    return status;
}

/* `triode_gguf_matmul_int8_parts` of one weight, as `triode_gguf_matmul` takes it */
int triode_gguf_matmul_int8(int type, const void *x, int64_t x_stride, int64_t rows,
                            int64_t cols, const uint8_t *w, int64_t w_stride, int64_t outputs,
                            const float *bias, void *y, int64_t y_stride, int bf16) {
    const gguf_part part = {.type = type, .w = w, .w_stride = w_stride, .outputs = outputs};
    return triode_gguf_matmul_int8_parts(&part, 1, x, x_stride, rows, cols, bias, y, y_stride,
                                         bf16);
}
