/* y = x W^T for a few rows of x (1 to QUANT_MAX_ROWS) from W's GGUF blocks as the file stores
 * them: Q4_0 / Q4_1 (a 4-bit code per weight; per 32 inputs a float16 scale and minimum,
 * w = scale * code + minimum) or Q8_0 (an int8 code per weight; per 32 inputs a float16
 * scale, w = scale * code). A step of a few rows is bound by how fast the weights stream from
 * memory: these read 5 (Q4) or 8.5 (Q8_0) bits a weight where float32 weights take 32.
 *
 * Per group of 32 inputs a row's outputs take scale x (x . codes) + minimum x sum(x): the
 * codes widen in registers to floats (exact) for one fused multiply-add a weight and row, and
 * the group's two constants apply once. The arithmetic is float32 throughout; an input of
 * one 1 and zeros gives exactly the dense float32 weights (scale x code is exact in float32,
 * + minimum rounds once, as the checkpoint's dequantization does). Each row's sums run in
 * the same order at any row count, so a row's result does not depend on the rows beside it.
 * x and y are float32 or bfloat16 (widened before, rounded once after).
 *
 * W arrives packed for this kernel (`quant_matmul.py`), in blocks of NR = 2 x LANES outputs
 * (LANES: float32 lanes of the widest vector this build targets) and groups of 32 inputs; per
 * block and group: NR float16 scales, (Q4) NR float16 minimums, then per input the codes of
 * the NR outputs: (Q4) LANES bytes, byte j holding output j in its low nibble and output
 * LANES + j in its high one, (Q8_0) NR int8 codes. A block's groups follow each other, so a
 * thread streams its block's bytes in order.
 *
 * Up to MR_DIRECT rows take each code from memory into registers once for all of them (a
 * decode step of a few requests: one pass over the weights). More rows widen a chunk of a
 * block's codes into a float buffer in L1 once and run tiles of MR_TILE rows over each group
 * of it. Blocks of outputs are split over torch's OpenMP threads. bfloat16 rows of paired
 * weights take `quant_paired.c`'s product instead (AVX512-BF16).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "group_sum.h"
#include "kernels.h"

#define QUANT_MAX_ROWS 64
#define GROUP 32

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define MR_DIRECT 8
#define MR_TILE 12
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline void vf_nibbles(const uint8_t *p, vf *low, vf *high) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *high = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
static inline vf vf_int8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LANES 8
#define MR_DIRECT 4
#define MR_TILE 4 /* 6 measured slower: 32 rows 131 against 119 ms for SmolLM2, 2 cores */
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_half(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline void vf_nibbles(const uint8_t *p, vf *low, vf *high) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *low = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *high = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
}
static inline vf vf_int8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
/* any other CPU: the same loops over plain arrays, which the compiler vectorises as it can */
#define LANES 8
#define MR_DIRECT 4
#define MR_TILE 4
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
static inline vf vf_fma(vf a, vf b, vf c) {
    for (int i = 0; i < LANES; i++) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
    return c;
}
static inline vf vf_mul(vf a, vf b) {
    for (int i = 0; i < LANES; i++) a.v[i] *= b.v[i];
    return a;
}
static inline vf vf_half(const uint16_t *p) {
    vf r;
    for (int i = 0; i < LANES; i++) r.v[i] = half_f32(p[i]);
    return r;
}
static inline void vf_nibbles(const uint8_t *p, vf *low, vf *high) {
    for (int i = 0; i < LANES; i++) {
        low->v[i] = (float)(p[i] & 15);
        high->v[i] = (float)(p[i] >> 4);
    }
}
static inline vf vf_int8(const int8_t *p) {
    vf r;
    for (int i = 0; i < LANES; i++) r.v[i] = (float)p[i];
    return r;
}
#endif

#define NR (2 * LANES)
/* inputs widened at a time into the L1 buffer of the tiled path */
#define CHUNK (4 * GROUP)

typedef struct {
    vf scale[2], minimum[2];
} constants;

/* bytes of one block's group: constants, then codes */
static inline int64_t group_bytes(int bits) {
    return bits == 4 ? NR * 2 * 2 + GROUP * LANES : NR * 2 + GROUP * NR;
}

static inline constants load_constants(const uint8_t *group, int bits) {
    const uint16_t *half = (const uint16_t *)group;
    constants c;
    c.scale[0] = vf_half(half);
    c.scale[1] = vf_half(half + LANES);
    c.minimum[0] = c.minimum[1] = vf_zero();
    if (bits == 4) {
        c.minimum[0] = vf_half(half + NR);
        c.minimum[1] = vf_half(half + NR + LANES);
    }
    return c;
}

static inline const uint8_t *group_codes(const uint8_t *group, int bits) {
    return group + (bits == 4 ? NR * 4 : NR * 2);
}

/* the NR codes of input k of a group as floats: outputs 0..LANES-1 in q[0], the rest in q[1] */
static inline __attribute__((always_inline)) void codes_at(const uint8_t *codes, int k, int bits,
                                                           vf q[2]) {
    if (bits == 4) {
        vf_nibbles(codes + (int64_t)k * LANES, &q[0], &q[1]);
    } else {
        const int8_t *c = (const int8_t *)codes + (int64_t)k * NR;
        q[0] = vf_int8(c);
        q[1] = vf_int8(c + LANES);
    }
}

/* sums[h] += scale[h] x dot + minimum[h] x xsum: a group's share of a row's outputs, from the
 * group's dot products of x with the codes (`dot`) and its sum of x */
static inline __attribute__((always_inline)) void add_group(float *sums, const constants *c,
                                                            const vf dot[2], float xsum,
                                                            int bits) {
    for (int h = 0; h < 2; h++) {
        vf sum = vf_fma(c->scale[h], dot[h], vf_load(sums + h * LANES));
        if (bits == 4) sum = vf_fma(c->minimum[h], vf_set1(xsum), sum);
        vf_store(sums + h * LANES, sum);
    }
}

/* rows 0..mr-1 of x (float32, `cols` apart; `xsums`: their sums per group, `groups` apart)
 * against `span` consecutive blocks, each group's dot products in registers: a span of
 * several blocks gives a single row enough independent sums not to wait on one chain of
 * additions. Block s's sums land in tile rows s * QUANT_MAX_ROWS + r. */
static inline __attribute__((always_inline)) void blocks_direct(
    const float *x, const float *xsums, int64_t cols, const uint8_t *block, int64_t block_bytes,
    int bits, float *tile, const int mr, const int span) {
    const int64_t stride = group_bytes(bits), groups = cols / GROUP;
    for (int s = 0; s < span; s++) memset(tile + s * QUANT_MAX_ROWS * NR, 0, sizeof(float) * mr * NR);
    for (int64_t g = 0; g < groups; g++) {
        vf dot[4][MR_DIRECT][2];
        for (int s = 0; s < span; s++)
            for (int r = 0; r < mr; r++) dot[s][r][0] = dot[s][r][1] = vf_zero();
        const float *xg = x + g * GROUP;
        for (int k = 0; k < GROUP; k++) {
            for (int s = 0; s < span; s++) {
                vf q[2];
                codes_at(group_codes(block + s * block_bytes + g * stride, bits), k, bits, q);
                for (int r = 0; r < mr; r++) {
                    const vf xb = vf_set1(xg[r * cols + k]);
                    dot[s][r][0] = vf_fma(xb, q[0], dot[s][r][0]);
                    dot[s][r][1] = vf_fma(xb, q[1], dot[s][r][1]);
                }
            }
        }
        for (int s = 0; s < span; s++) {
            const constants c = load_constants(block + s * block_bytes + g * stride, bits);
            for (int r = 0; r < mr; r++)
                add_group(tile + (s * QUANT_MAX_ROWS + r) * NR, &c, dot[s][r],
                          xsums[r * groups + g], bits);
        }
    }
}

/* tile rows 0..mr-1 (x `cols` apart, from the group's first input; `xsums` `groups` apart)
 * += one group, its codes as floats in `q` [GROUP][NR] */
static inline __attribute__((always_inline)) void tile_group(const float *x, int64_t cols,
                                                             const float *xsums, int64_t groups,
                                                             const float *q, const constants *c,
                                                             int bits, float *tile,
                                                             const int mr) {
    vf dot[MR_TILE][2];
    for (int r = 0; r < mr; r++) dot[r][0] = dot[r][1] = vf_zero();
    for (int k = 0; k < GROUP; k++) {
        const vf q0 = vf_load(q + k * NR), q1 = vf_load(q + k * NR + LANES);
        for (int r = 0; r < mr; r++) {
            const vf xb = vf_set1(x[r * cols + k]);
            dot[r][0] = vf_fma(xb, q0, dot[r][0]);
            dot[r][1] = vf_fma(xb, q1, dot[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) add_group(tile + r * NR, c, dot[r], xsums[r * groups], bits);
}

static void tile_rows(const float *x, int64_t cols, const float *xsums, int64_t groups,
                      const float *q, const constants *c, int bits, float *tile, int mr) {
    switch (mr) {
#define TILE_CASE(m) \
    case m:          \
        tile_group(x, cols, xsums, groups, q, c, bits, tile, m); break;
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if MR_TILE > 4
        TILE_CASE(5) TILE_CASE(6)
#endif
#if MR_TILE > 6
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
#undef TILE_CASE
    }
}

/* more rows than the registers hold: a chunk of a block's codes widened to floats in L1 once,
 * then tiles of MR_TILE rows over each group of it */
static void block_tiled(const float *x, const float *xsums, int64_t rows, int64_t cols,
                        const uint8_t *block, int bits, float *tile) {
    float q[CHUNK * NR] __attribute__((aligned(64)));
    constants c[CHUNK / GROUP];
    memset(tile, 0, sizeof(float) * rows * NR);
    const int64_t stride = group_bytes(bits), groups = cols / GROUP;
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK / GROUP) {
        const int n = groups - g0 < CHUNK / GROUP ? (int)(groups - g0) : CHUNK / GROUP;
        for (int g = 0; g < n; g++) {
            const uint8_t *group = block + (g0 + g) * stride;
            c[g] = load_constants(group, bits);
            for (int k = 0; k < GROUP; k++) {
                vf pair[2];
                codes_at(group_codes(group, bits), k, bits, pair);
                vf_store(q + (g * GROUP + k) * NR, pair[0]);
                vf_store(q + (g * GROUP + k) * NR + LANES, pair[1]);
            }
        }
        for (int g = 0; g < n; g++)
            for (int64_t r = 0; r < rows; r += MR_TILE) {
                const int mr = rows - r < MR_TILE ? (int)(rows - r) : MR_TILE;
                tile_rows(x + r * cols + (g0 + g) * GROUP, cols, xsums + r * groups + g0 + g,
                          groups, q + g * GROUP * NR, &c[g], bits, tile + r * NR, mr);
            }
    }
}

/* the blocks one task computes: several for one or two rows (`blocks_direct`), else one */
static inline int span_for(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

/* `span` blocks (fewer at the end: `n`) for `rows` rows; block s's sums land in tile rows
 * s * QUANT_MAX_ROWS + r */
static void blocks_rows(const float *x, const float *xsums, int64_t rows, int64_t cols,
                        const uint8_t *block, int64_t block_bytes, int bits, float *tile, int n) {
    if (rows <= 2 && n == span_for(rows)) {
        if (rows == 1)
            blocks_direct(x, xsums, cols, block, block_bytes, bits, tile, 1, 4);
        else
            blocks_direct(x, xsums, cols, block, block_bytes, bits, tile, 2, 2);
        return;
    }
    for (int s = 0; s < n; s++, block += block_bytes, tile += QUANT_MAX_ROWS * NR) {
        switch (rows) {
#define DIRECT_CASE(m) \
    case m:            \
        blocks_direct(x, xsums, cols, block, block_bytes, bits, tile, m, 1); break;
            DIRECT_CASE(1) DIRECT_CASE(2) DIRECT_CASE(3) DIRECT_CASE(4)
#if MR_DIRECT > 4
            DIRECT_CASE(5) DIRECT_CASE(6) DIRECT_CASE(7) DIRECT_CASE(8)
#endif
#undef DIRECT_CASE
        default: block_tiled(x, xsums, rows, cols, block, bits, tile);
        }
    }
}

int triode_quant_lanes(void) { return LANES; }
int triode_quant_max_rows(void) { return QUANT_MAX_ROWS; }

/* y [rows, outputs] (row stride y_stride; bfloat16 if y_bf16 else float32) = x [rows, cols]
 * (row stride x_stride; bfloat16 if x_bf16) times the packed W^T, + bias (float32, or NULL).
 * Returns 0, or -1 for arguments it does not take (rows outside 1..QUANT_MAX_ROWS, cols not
 * whole groups, bits other than 4 and 8). */
static int quant_matmul(const void *x, int64_t x_stride, int x_bf16, int64_t rows, int64_t cols,
                        const uint8_t *w, int bits, const float *bias, int64_t outputs,
                        void *y, int64_t y_stride, int y_bf16, int paired) {
    if (rows < 1 || rows > QUANT_MAX_ROWS || cols < GROUP || cols % GROUP || outputs < 1 ||
        (bits != 4 && bits != 8) || (paired && (!x_bf16 || !y_bf16)))
        return -1;
    const float *xf = (const float *)x;
    float *widened = NULL;
    if (!paired && (x_bf16 || x_stride != cols)) { /* the paired product reads x as it is */
        widened = malloc(sizeof(float) * rows * cols);
        if (widened == NULL) return -1;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < cols; c++)
                widened[r * cols + c] = x_bf16 ? bf16_f32(((const uint16_t *)x)[r * x_stride + c])
                                               : ((const float *)x)[r * x_stride + c];
        xf = widened;
    }
    const int64_t groups = cols / GROUP;
    float *xsums = malloc(sizeof(float) * rows * groups);
    if (xsums == NULL) {
        free(widened);
        return -1;
    }
    if (paired) { /* which sums the groups itself, its threads sharing the rows */
        const int status = triode_quant_paired_rows(x, x_stride, xsums, rows, cols, w, bits,
                                                    bias, outputs, y, y_stride);
        free(xsums);
        free(widened);
        return status;
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++)
            xsums[r * groups + g] = group_sum(xf + r * cols + g * GROUP);
    const int64_t blocks = (outputs + NR - 1) / NR;
    const int64_t block_bytes = cols / GROUP * group_bytes(bits);
    const int span = span_for(rows);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t first_block = 0; first_block < blocks; first_block += span) {
        float tile[4 * QUANT_MAX_ROWS * NR] __attribute__((aligned(64)));
        const int n = blocks - first_block < span ? (int)(blocks - first_block) : span;
        blocks_rows(xf, xsums, rows, cols, w + first_block * block_bytes, block_bytes, bits, tile,
                    n);
        for (int s = 0; s < n; s++) {
            const int64_t first = (first_block + s) * NR;
            const int width = outputs - first < NR ? (int)(outputs - first) : NR;
            const float *sums = tile + s * QUANT_MAX_ROWS * NR;
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < width; j++) {
                    const float v = bias ? sums[r * NR + j] + bias[first + j] : sums[r * NR + j];
                    if (y_bf16)
                        ((uint16_t *)y)[r * y_stride + first + j] = f32_bf16(v);
                    else
                        ((float *)y)[r * y_stride + first + j] = v;
                }
        }
    }
    free(xsums);
    free(widened);
    return 0;
}

/* a GGUF weight's rows as stored, part by part (`quant_call.next`), each part's columns of y:
 * each run of parts in the integer mode (`quant_call.int8`, a type that has it) in one call,
 * the others exactly */
static int gguf_rows(const quant_call *c) {
    const int64_t size = c->bf16 ? 2 : 4;
    int64_t first = 0;
    for (const quant_call *part = c; part != NULL;) {
        gguf_part run[GGUF_MAX_PARTS];
        int count = 0;
        int64_t outputs = 0;
        while (part != NULL && count < GGUF_MAX_PARTS && part->int8 &&
               triode_gguf_int8_takes(part->gguf_type)) {
            run[count++] = (gguf_part){.type = part->gguf_type, .w = part->w,
                                       .w_stride = part->w_stride, .outputs = part->outputs};
            outputs += part->outputs;
            part = part->next;
        }
        const float *bias = c->bias ? c->bias + first : NULL;
        void *y = (char *)c->y + first * size;
        if (count > 0) {
            if (triode_gguf_matmul_int8_parts(run, count, c->x, c->x_stride, c->rows, c->cols,
                                              bias, y, c->y_stride, c->bf16))
                return -1;
        } else {
            if (triode_gguf_matmul(part->gguf_type, c->x, c->x_stride, c->rows, c->cols, part->w,
                                   part->w_stride, part->outputs, bias, y, c->y_stride, c->bf16))
                return -1;
            outputs = part->outputs;
            part = part->next;
        }
        first += outputs;
    }
    return 0;
}

int triode_quant_matmul_call(const quant_call *c) {
    if (c->bits == 0) return gguf_rows(c);
    return quant_matmul(c->x, c->x_stride, c->bf16, c->rows, c->cols, c->w, c->bits, c->bias,
                        c->outputs, c->y, c->y_stride, c->bf16, c->paired);
}
