/* The GGUF product's integer mode, llama.cpp's arithmetic: y = x W^T with x quantized to 8
 * bits per unit of 32 values and each unit of W's codes multiplied by those in integers.
 *
 * x's unit u: scale dx = (largest |x| of the unit) / 127, q = x / dx rounded to nearest (ties
 * to even), |q| <= 127; and s, the sum of q over each 16 of the unit. Per output, per unit:
 *   y += dx * (scale . (codes . q) - correction)
 * with codes . q an exact int32 (the 16-weight types: each half on its own lanes, times its
 * own scale), scale the unit's float scale as the exact mode has it, and the correction what
 * the type's offset or minimum takes away: Q4_K minimum x dx x s, Q6_K 32 x scale x dx x s
 * (its codes are stored 0..63, meaning -32..31), summed apart and taken off at the end. Q8_0's signed codes take llama.cpp's sign trick: |w|
 * times q with w's sign.
 *
 * The integer sums are exact, and every build adds the float terms in one order: eight lanes,
 * lane m a unit's weights 4m..4m+3, fused multiply-adds, the lanes summed as a 256-bit
 * vector's halves are. So the AVX2 (`vpmaddubsw`), AVX512-VNNI (`vpdpbusd` on 256-bit
 * vectors) and portable builds give the same bits. What differs from the exact mode is x
 * rounded to 8 bits: at most half a step, dx / 2, per value.
 *
 * Types: Q8_0, Q4_K, Q6_K (what a Q4_K_M file's projections and a Q8_0 file are). x float32
 * or bfloat16, 1 to GGUF_MAX_ROWS rows; output rows split over torch's OpenMP threads.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "gguf_avx2.h"
#define INT8_SIMD 1
/* the superblocks' scales by the exact mode's vector decoders: the same floats */
#define K_SCALES k_scales
#define Q6_K_SCALES q6_k_scales
#else
#define K_SCALES gguf_k_scales
#define Q6_K_SCALES gguf_q6_k_scales
#endif

#define MAX_ROWS 64
#define ROW_TILE 4
#define OUTPUT_BLOCK 8

/* x quantized: q [rows, cols] in file order, dx [rows, cols / 32], s [rows, cols / 16]; and
 * what the corrections take of them, each float product rounded once: dxs16 = dx x s per 16,
 * dxs32 = dx x (s of the unit) */
typedef struct {
    int8_t *q;
    float *dx, *dxs16, *dxs32;
    int32_t *s;
    int64_t rows, cols;
} qx;

/* rows of x to 8 bits per unit of 32 (cols whole units); 0, or -1 without memory */
static int quantize(const void *x, int64_t x_stride, int bf16, qx *k) {
    const int64_t units = k->cols / UNIT;
    k->q = malloc((size_t)(k->rows * k->cols));
    k->dx = malloc(sizeof(float) * (size_t)(k->rows * units));
    k->s = malloc(sizeof(int32_t) * (size_t)(k->rows * units * 2));
    k->dxs16 = malloc(sizeof(float) * (size_t)(k->rows * units * 2));
    k->dxs32 = malloc(sizeof(float) * (size_t)(k->rows * units));
    if (k->q == NULL || k->dx == NULL || k->s == NULL || k->dxs16 == NULL || k->dxs32 == NULL)
        return -1;
    for (int64_t r = 0; r < k->rows; r++)
        for (int64_t u = 0; u < units; u++) {
            float v[UNIT], amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < UNIT; i++) {
                const int64_t at = r * x_stride + u * UNIT + i;
                v[i] = bf16 ? bf16_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                finite &= isfinite(v[i]) != 0;
                amax = fmaxf(amax, fabsf(v[i]));
            }
            /* a unit with an infinity or a NaN makes every output it meets NaN, as the
             * exact mode's products do (with codes 0: no conversion of a NaN to an integer) */
            const float d = finite ? amax / 127.0f : NAN;
            const float inverse = finite && d != 0.0f ? 1.0f / d : 0.0f;
            int8_t *q = k->q + r * k->cols + u * UNIT;
            int32_t *s = k->s + (r * units + u) * 2;
            s[0] = s[1] = 0;
            for (int i = 0; i < UNIT; i++) {
                q[i] = (int8_t)nearbyintf(v[i] * inverse);
                s[i / 16] += q[i];
            }
            k->dx[r * units + u] = d;
            k->dxs16[(r * units + u) * 2] = d * (float)s[0];
            k->dxs16[(r * units + u) * 2 + 1] = d * (float)s[1];
            k->dxs32[r * units + u] = d * (float)(s[0] + s[1]);
        }
    return 0;
}

static void release(qx *k) {
    free(k->q);
    free(k->dx);
    free(k->s);
    free(k->dxs16);
    free(k->dxs32);
}

/* ---- eight float lanes, one order for every build ---- */

#ifdef INT8_SIMD
typedef __m256 lanes;
typedef __m256i ints;
static inline lanes lanes_zero(void) { return _mm256_setzero_ps(); }
static inline lanes lanes_halves(float a, float b) {
    return _mm256_setr_ps(a, a, a, a, b, b, b, b);
}
static inline lanes lanes_fma(ints dot, lanes scale, lanes acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
}
static inline lanes lanes_load(const float *p) { return _mm256_loadu_ps(p); }
static inline lanes lanes_mul(lanes a, lanes b) { return _mm256_mul_ps(a, b); }
static inline lanes lanes_fma_f(lanes a, lanes b, lanes acc) { return _mm256_fmadd_ps(a, b, acc); }
/* p[0..3], each twice: lanes 2i and 2i + 1 take p[i] */
static inline lanes lanes_spread(const float *p) {
    const __m128 v = _mm_loadu_ps(p);
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_unpacklo_ps(v, v)),
                                _mm_unpackhi_ps(v, v), 1);
}
/* lane j of v on every lane; lanes i, i + 1 of v each on its half */
static inline lanes lanes_lane(lanes v, int j) {
    return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j));
}
static inline lanes lanes_pair(lanes v, int i) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, i + 1, i + 1, i + 1, i + 1));
}
static inline float lanes_sum(lanes v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* lane m: sum over bytes 4m..4m+3 of a (unsigned) x b (signed) */
static inline ints dot_u8_s8(ints a, ints b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}
static inline ints load_q(const int8_t *q) { return _mm256_loadu_si256((const __m256i *)q); }
#else
typedef struct {
    float v[8];
} lanes;
typedef struct {
    int32_t v[8];
} ints;
static inline lanes lanes_zero(void) { return (lanes){{0}}; }
static inline lanes lanes_halves(float a, float b) { return (lanes){{a, a, a, a, b, b, b, b}}; }
static inline lanes lanes_fma(ints dot, lanes scale, lanes acc) {
    for (int m = 0; m < 8; m++) acc.v[m] = __builtin_fmaf((float)dot.v[m], scale.v[m], acc.v[m]);
    return acc;
}
static inline lanes lanes_load(const float *p) {
    lanes v;
    memcpy(v.v, p, sizeof v.v);
    return v;
}
static inline lanes lanes_mul(lanes a, lanes b) {
    for (int m = 0; m < 8; m++) a.v[m] *= b.v[m];
    return a;
}
static inline lanes lanes_fma_f(lanes a, lanes b, lanes acc) {
    for (int m = 0; m < 8; m++) acc.v[m] = __builtin_fmaf(a.v[m], b.v[m], acc.v[m]);
    return acc;
}
static inline lanes lanes_spread(const float *p) {
    return (lanes){{p[0], p[0], p[1], p[1], p[2], p[2], p[3], p[3]}};
}
static inline lanes lanes_lane(lanes v, int j) { return lanes_halves(v.v[j], v.v[j]); }
static inline lanes lanes_pair(lanes v, int i) { return lanes_halves(v.v[i], v.v[i + 1]); }
static inline float lanes_sum(lanes v) {
    const float h0 = v.v[0] + v.v[4], h1 = v.v[1] + v.v[5], h2 = v.v[2] + v.v[6],
                h3 = v.v[3] + v.v[7];
    return (h0 + h2) + (h1 + h3);
}
#endif

/* ---- one unit's codes, unsigned, and their dots with x's units ---- */

#ifdef INT8_SIMD
typedef ints codes;
static inline ints unit_dot(codes c, const int8_t *q) { return dot_u8_s8(c, load_q(q)); }
static inline codes unit_nibbles(const uint8_t *p, int high) {
    const ints b = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(high ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(15));
}
/* Q6_K: 4 low bits from p's nibble, 2 high bits from h's crumb */
static inline codes six_bits(const uint8_t *p, int high, const uint8_t *h, int crumb) {
    const ints hb = _mm256_loadu_si256((const __m256i *)h);
    const ints top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * crumb), _mm256_set1_epi8(3));
    return _mm256_or_si256(unit_nibbles(p, high), _mm256_slli_epi16(top, 4));
}
/* Q8_0: |w| and q with w's sign */
static inline ints signed_dot(const int8_t *w, const int8_t *q) {
    const ints wv = _mm256_loadu_si256((const __m256i *)w);
    return dot_u8_s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(load_q(q), wv));
}
#else
typedef struct {
    uint8_t v[32];
} codes;
static inline ints unit_dot(codes c, const int8_t *q) {
    ints d;
    for (int m = 0; m < 8; m++) {
        d.v[m] = 0;
        for (int i = 4 * m; i < 4 * m + 4; i++) d.v[m] += c.v[i] * q[i];
    }
    return d;
}
static inline codes unit_nibbles(const uint8_t *p, int high) {
    codes c;
    for (int i = 0; i < 32; i++) c.v[i] = (p[i] >> (4 * high)) & 15;
    return c;
}
static inline codes six_bits(const uint8_t *p, int high, const uint8_t *h, int crumb) {
    codes c = unit_nibbles(p, high);
    for (int i = 0; i < 32; i++) c.v[i] |= ((h[i] >> (2 * crumb)) & 3) << 4;
    return c;
}
static inline ints signed_dot(const int8_t *w, const int8_t *q) {
    ints d;
    for (int m = 0; m < 8; m++) {
        d.v[m] = 0;
        for (int i = 4 * m; i < 4 * m + 4; i++) d.v[m] += w[i] * q[i];
    }
    return d;
}
#endif

/* ---- one output row against rows r0..r0+mr-1 of x ---- */

static void q8_0_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    const int64_t units = k->cols / UNIT;
    lanes acc[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = lanes_zero();
    for (int64_t u = 0; u < units; u++, w += 34) {
        const float d = half_at(w);
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const ints dot = signed_dot((const int8_t *)(w + 2), k->q + row * k->cols + u * UNIT);
            const float scale = d * k->dx[row * units + u];
            acc[r] = lanes_fma(dot, lanes_halves(scale, scale), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = lanes_sum(acc[r]);
}

/* Per superblock and row of x: the 8 units' scales times their dx in one vector product, and
 * the minimums' (or offsets') correction as vector multiply-adds, summed with the lanes at
 * the end; per unit, the codes' dot and one multiply-add. */
static void q4_k_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    const int64_t units = k->cols / UNIT;
    lanes acc[ROW_TILE], correction[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = correction[r] = lanes_zero();
    for (int64_t b = 0; b < units / 8; b++, w += 144) {
        float scale[8], minimum[8];
        lanes ds[ROW_TILE];
        K_SCALES(w, scale, minimum);
        const lanes scales = lanes_load(scale), minimums = lanes_load(minimum);
        for (int r = 0; r < mr; r++) {
            const int64_t at = (r0 + r) * units + 8 * b;
            ds[r] = lanes_mul(scales, lanes_load(k->dx + at));
            correction[r] = lanes_fma_f(minimums, lanes_load(k->dxs32 + at), correction[r]);
        }
        for (int j = 0; j < 8; j++) {
            const codes c = unit_nibbles(w + 16 + 32 * (j / 2), j % 2);
            const int8_t *q = k->q + r0 * k->cols + (8 * b + j) * UNIT;
            for (int r = 0; r < mr; r++)
                acc[r] = lanes_fma(unit_dot(c, q + r * k->cols), lanes_lane(ds[r], j), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = lanes_sum(acc[r]) - lanes_sum(correction[r]);
}

/* Q6_K: unit 4h + n of a superblock (h, n < 4) takes nibble n / 2 of low bytes 64h + 32(n % 2)
 * onwards and crumb n of high bytes 32h onwards; its halves the scales 8h + 2n and 8h + 2n + 1.
 * Its codes are stored 0..63 for -32..31: the correction is 32 x scale x dx x s per 16. */
static void q6_k_row(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    const int64_t units = k->cols / UNIT;
    lanes acc[ROW_TILE], correction[ROW_TILE];
    for (int r = 0; r < mr; r++) acc[r] = correction[r] = lanes_zero();
    for (int64_t b = 0; b < units / 8; b++, w += 210) {
        float scale[16];
        lanes ds[ROW_TILE][2];
        Q6_K_SCALES(w, scale);
        const lanes low = lanes_load(scale), high = lanes_load(scale + 8);
        for (int r = 0; r < mr; r++) {
            const int64_t at = (r0 + r) * units + 8 * b;
            const float *dx = k->dx + at;
            ds[r][0] = lanes_mul(low, lanes_spread(dx));
            ds[r][1] = lanes_mul(high, lanes_spread(dx + 4));
            const float *xs = k->dxs16 + 2 * at;
            correction[r] = lanes_fma_f(low, lanes_load(xs), correction[r]);
            correction[r] = lanes_fma_f(high, lanes_load(xs + 8), correction[r]);
        }
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, n = j % 4;
            const codes c = six_bits(w + 64 * h + 32 * (n % 2), n / 2, w + 128 + 32 * h, n);
            const int8_t *q = k->q + r0 * k->cols + (8 * b + j) * UNIT;
            for (int r = 0; r < mr; r++)
                acc[r] = lanes_fma(unit_dot(c, q + r * k->cols), lanes_pair(ds[r][j / 4], 2 * (j % 4)),
                                   acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) out[r] = lanes_sum(acc[r]) - 32.0f * lanes_sum(correction[r]);
}

typedef void (*row_kernel)(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out);

static row_kernel kernel_of(int type, int *block_size) {
    *block_size = type == GGUF_Q8_0 ? 32 : QK_K;
    if (type == GGUF_Q8_0) return q8_0_row;
    if (type == GGUF_Q4_K) return q4_k_row;
    if (type == GGUF_Q6_K) return q6_k_row;
    return NULL;
}

/* whether this library's integer mode takes GGML type `type` */
int triode_gguf_int8_takes(int type) {
    int size;
    return kernel_of(type, &size) != NULL;
}

/* x's quantization, as the product does it: q [rows, cols], dx [rows, cols / 32], s [rows,
 * cols / 16]. Returns 0, or -1 (cols not whole units, rows < 1, no memory). */
int triode_gguf_quantize_int8(const void *x, int64_t x_stride, int64_t rows, int64_t cols,
                              int bf16, int8_t *q, float *dx, int32_t *s) {
    qx k = {.rows = rows, .cols = cols};
    int status = -1;
    if (rows >= 1 && cols >= UNIT && cols % UNIT == 0 && quantize(x, x_stride, bf16, &k) == 0) {
        memcpy(q, k.q, (size_t)(rows * cols));
        memcpy(dx, k.dx, sizeof(float) * (size_t)(rows * cols / UNIT));
        memcpy(s, k.s, sizeof(int32_t) * (size_t)(rows * cols / 16));
        status = 0;
    }
    release(&k);
    return status;
}

/* y [rows, y_stride] = x [rows, x_stride] W^T (+ bias), as `triode_gguf_matmul` takes them,
 * in integer arithmetic. Returns 0, or -1 for arguments it does not take (a type without an
 * integer kernel, cols not whole blocks, rows outside 1..MAX_ROWS, no memory). */
int triode_gguf_matmul_int8(int type, const void *x, int64_t x_stride, int64_t rows,
                            int64_t cols, const uint8_t *w, int64_t w_stride, int64_t outputs,
                            const float *bias, void *y, int64_t y_stride, int bf16) {
    int block_size;
    const row_kernel kernel = kernel_of(type, &block_size);
    if (kernel == NULL || cols < 1 || cols % block_size || rows < 1 || rows > MAX_ROWS ||
        outputs < 0)
        return -1;
    qx k = {.rows = rows, .cols = cols};
    int status = quantize(x, x_stride, bf16, &k);
    if (status == 0) {
        const int64_t blocks = (outputs + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t o = b * OUTPUT_BLOCK; o < outputs && o < (b + 1) * OUTPUT_BLOCK; o++)
                for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
                    const int mr = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
                    float out[ROW_TILE];
                    kernel(w + o * w_stride, &k, r0, mr, out);
                    for (int r = 0; r < mr; r++) {
                        const float v = bias != NULL ? out[r] + bias[o] : out[r];
                        if (bf16)
                            ((uint16_t *)y)[(r0 + r) * y_stride + o] = f32_bf16(v);
                        else
                            ((float *)y)[(r0 + r) * y_stride + o] = v;
                    }
                }
    }
    release(&k);
    return status;
}
