/* y = x W^T (+ bias) for 1 to GGUF_MAX_ROWS rows of x, W given as rows of GGUF blocks as the
 * file stores them: a decode step reads each weight's few bits once instead of a float.
 *
 * Two paths, one order of sums (`gguf_product.h`). Where `gguf_fused_avx2.c` takes the call
 * (AVX2 builds, the quantized types, up to 8 rows) each unit's codes go from the bytes into
 * registers and straight into the rows' sums. Otherwise each chunk of W's row decodes once
 * into L1 (`gguf_decode*.c`) and every row of x takes it from there, TILE rows at a time.
 *
 * The arithmetic is float32. Factoring the scales out rounds differently from the dense
 * product over the float weights, by a few units in the last place of |x| . |w|. x and y are
 * float32 or bfloat16 (widened once before, rounded once after). Output rows are split over
 * torch's OpenMP threads, OUTPUT_BLOCK at a time.
 */
#include <stdlib.h>
#include <string.h>

#include "gguf_product.h"

/* output rows a thread takes at a time, each chunk of x read for all of them */
#define OUTPUT_BLOCK 8

/* x . codes over one unit for rows 0..mr-1 of x (`stride` apart) */
INLINE void unit_dots(const float *x, int64_t stride, const float *code, const int mr, vf *dot) {
    const vf first = vf_load(code);
    for (int r = 0; r < mr; r++) dot[r] = vf_mul(vf_load(x + r * stride), first);
    for (int v = LANES; v < UNIT; v += LANES) {
        const vf q = vf_load(code + v);
        for (int r = 0; r < mr; r++) dot[r] = vf_fma(vf_load(x + r * stride + v), q, dot[r]);
    }
}

/* rows 0..mr-1 (x at the chunk's first weight, rows `stride` apart; xsum at the chunk's slot,
 * rows `xsum_stride` apart) += one decoded chunk of `units` units */
INLINE void tile_chunk(const float *x, int64_t stride, const float *xsum, int64_t xsums,
                       const gguf_chunk *c, int units, const int G, const int minimum,
                       row_sums *sums, const int mr) {
    vf even[TILE], odd[TILE], dot[TILE];
    for (int r = 0; r < mr; r++) {
        even[r] = sums[r].even;
        odd[r] = sums[r].odd;
    }
    int u = 0;
    for (; u + 1 < units; u += 2) {
        unit_dots(x + u * UNIT, stride, c->code + u * UNIT, mr, dot);
        const vf s = unit_scale(c->scale, u, G);
        for (int r = 0; r < mr; r++) even[r] = vf_fma(dot[r], s, even[r]);
        unit_dots(x + (u + 1) * UNIT, stride, c->code + (u + 1) * UNIT, mr, dot);
        const vf t = unit_scale(c->scale, u + 1, G);
        for (int r = 0; r < mr; r++) odd[r] = vf_fma(dot[r], t, odd[r]);
    }
    if (u < units) {
        unit_dots(x + u * UNIT, stride, c->code + u * UNIT, mr, dot);
        const vf s = unit_scale(c->scale, u, G);
        for (int r = 0; r < mr; r++) even[r] = vf_fma(dot[r], s, even[r]);
    }
    for (int r = 0; r < mr; r++) {
        sums[r].even = even[r];
        sums[r].odd = odd[r];
    }
    if (minimum)
        for (int j = 0; j < units * UNIT / G; j += LANES) {
            const vf m = vf_load(c->minimum + j);
            for (int r = 0; r < mr; r++)
                sums[r].minimum = vf_fma(m, vf_load(xsum + r * xsums + j), sums[r].minimum);
        }
}

/* every row of the call += one decoded chunk (chunk number `chunk` of W's row) */
static void rows_chunk(const call *k, int64_t chunk, const gguf_chunk *c, int units,
                       row_sums *sums) {
    const int64_t xsums = xsum_stride(k);
    const int G = k->f.group, minimum = k->f.has_minimum;
    for (int64_t r0 = 0; r0 < k->rows; r0 += TILE) {
        const int mr = k->rows - r0 < TILE ? (int)(k->rows - r0) : TILE;
        const float *x = k->x + r0 * k->padded + chunk * CHUNK;
        const float *xsum = minimum ? k->xsum + r0 * xsums + chunk * MAX_GROUPS : NULL;
        row_sums *s = sums + r0;
        /* each shape its own copy, its loops unrolled and its sums in registers */
#define TILE_CASE(m)                                                                  \
    case m:                                                                           \
        if (G == 16 && minimum)                                                       \
            tile_chunk(x, k->padded, xsum, xsums, c, units, 16, 1, s, m);             \
        else if (G == 16)                                                             \
            tile_chunk(x, k->padded, xsum, xsums, c, units, 16, 0, s, m);             \
        else if (minimum)                                                             \
            tile_chunk(x, k->padded, xsum, xsums, c, units, 32, 1, s, m);             \
        else                                                                          \
            tile_chunk(x, k->padded, xsum, xsums, c, units, 32, 0, s, m);             \
        break;
        switch (mr) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if TILE > 4
            TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
#endif
        }
#undef TILE_CASE
    }
}

/* decodes chunk number `chunk` of W's row at w into c; returns its units */
static inline int decode_chunk(const call *k, const uint8_t *w, int64_t chunk, gguf_chunk *c) {
    const gguf_format *f = &k->f;
    const int64_t per_chunk = chunk_blocks(f), first = chunk * per_chunk;
    const int64_t blocks = k->cols / f->block_size - first;
    const int n = blocks < per_chunk ? (int)blocks : (int)per_chunk;
    f->decode(w + first * f->block_bytes, n, c);
    if (n == per_chunk && !f->plain) return CHUNK / UNIT;
    const int weights = n * f->block_size, units = (weights + UNIT - 1) / UNIT;
    if (weights % UNIT) /* a float row's last unit, part of one */
        for (int i = weights; i < units * UNIT; i++) c->code[unit_position(i)] = 0.0f;
    if (f->plain)
        for (int u = 0; u < units; u++) c->scale[u] = 1.0f;
    const int groups = units * UNIT / f->group;
    if (f->has_minimum && groups % LANES) /* the sums read whole vectors of minimums */
        memset(c->minimum + groups, 0, sizeof(float) * (MAX_GROUPS - groups));
    return units;
}

/* the sums of outputs w's n rows (w_stride bytes apart) for every row, output j's at
 * sums + j x rows */
static void block_sums(const call *k, const uint8_t *w, int64_t w_stride, int n,
                       row_sums *sums) {
    for (int64_t i = 0; i < n * k->rows; i++) sums[i] = (row_sums){vf_zero(), vf_zero(), vf_zero()};
    if (gguf_fused_sums(k, w, w_stride, n, sums) == 0) return;
    /* chunk by chunk, each output's in turn, so that a chunk of x stays in L1 for all */
    gguf_chunk c;
    for (int64_t chunk = 0; chunk < k->chunks; chunk++)
        for (int i = 0; i < n; i++) {
            const int units = decode_chunk(k, w + i * w_stride, chunk, &c);
            rows_chunk(k, chunk, &c, units, sums + i * k->rows);
        }
}

/* the sum of n (16 or 32) floats, halves added pairwise */
static float group_total(const float *x, int n) {
    float s[32];
    memcpy(s, x, sizeof(float) * n);
    for (int half = n / 2; half > 0; half /= 2)
        for (int i = 0; i < half; i++) s[i] += s[i + half];
    return s[0];
}

/* row r of x as float32 in the file's order, zero past cols to whole chunks */
static void widen_row(const void *x, int64_t x_stride, int bf16, int64_t r, const call *k,
                      float *row) {
    if (bf16)
        for (int64_t i = 0; i < k->cols; i++)
            row[i] = bf16_f32(((const uint16_t *)x)[r * x_stride + i]);
    else
        memcpy(row, (const float *)x + r * x_stride, sizeof(float) * k->cols);
    memset(row + k->cols, 0, sizeof(float) * (k->padded - k->cols));
}

/* the call's x in unit order, and its groups' sums where the type has minimums */
static int prepare(call *k, const void *x, int64_t x_stride, int bf16) {
    const int G = k->f.group;
    float *row = malloc(sizeof(float) * k->padded);
    k->x = aligned_alloc(64, sizeof(float) * k->rows * k->padded);
    k->xsum = k->f.has_minimum ? calloc((size_t)(k->rows * xsum_stride(k)), sizeof(float)) : NULL;
    if (row == NULL || k->x == NULL || (k->f.has_minimum && k->xsum == NULL)) {
        free(row);
        return -1;
    }
    for (int64_t r = 0; r < k->rows; r++) {
        widen_row(x, x_stride, bf16, r, k, row);
        float *unit_ordered = k->x + r * k->padded;
        for (int64_t i = 0; i < k->padded; i += UNIT)
            for (int j = 0; j < UNIT; j++) unit_ordered[i + unit_position(j)] = row[i + j];
        if (k->xsum != NULL)
            for (int64_t g = 0; g * G < k->cols; g++)
                k->xsum[r * xsum_stride(k) + g / (CHUNK / G) * MAX_GROUPS + g % (CHUNK / G)] =
                    group_total(row + g * G, G);
    }
    free(row);
    return 0;
}

int triode_gguf_max_rows(void) { return GGUF_MAX_ROWS; }

/* y [rows, y_stride] = x [rows, x_stride] W^T (+ bias[outputs], float32, or NULL); W:
 * `outputs` rows of `type` blocks, w_stride bytes apart, of `cols` weights; x and y bfloat16
 * if bf16, else float32. Returns 0, or -1 for arguments it does not take (a type it does not
 * take, cols not whole blocks, rows outside 1..GGUF_MAX_ROWS). */
int triode_gguf_matmul(int type, const void *x, int64_t x_stride, int64_t rows, int64_t cols,
                       const uint8_t *w, int64_t w_stride, int64_t outputs, const float *bias,
                       void *y, int64_t y_stride, int bf16) {
    call k = {.type = type, .rows = rows, .cols = cols};
    if (gguf_format_of(type, &k.f) || cols < 1 || cols % k.f.block_size || rows < 1 ||
        rows > GGUF_MAX_ROWS || outputs < 0)
        return -1;
    k.chunks = (cols + CHUNK - 1) / CHUNK;
    k.padded = k.chunks * CHUNK;
    if (prepare(&k, x, x_stride, bf16)) {
        free(k.xsum);
        free(k.x);
        return -1;
    }
    const int64_t blocks = (outputs + OUTPUT_BLOCK - 1) / OUTPUT_BLOCK;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks; b++) {
        row_sums sums[OUTPUT_BLOCK * GGUF_MAX_ROWS];
        const int64_t first = b * OUTPUT_BLOCK;
        const int n = outputs - first < OUTPUT_BLOCK ? (int)(outputs - first) : OUTPUT_BLOCK;
        block_sums(&k, w + first * w_stride, w_stride, n, sums);
        for (int j = 0; j < n; j++)
            for (int64_t r = 0; r < rows; r++) {
                float v = row_result(&k.f, &sums[j * rows + r]);
                if (bias != NULL) v += bias[first + j];
                if (bf16)
                    ((uint16_t *)y)[r * y_stride + first + j] = f32_bf16(v);
                else
                    ((float *)y)[r * y_stride + first + j] = v;
            }
    }
    free(k.xsum);
    free(k.x);
    return 0;
}
