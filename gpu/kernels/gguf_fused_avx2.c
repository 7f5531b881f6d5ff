/* `gguf_matmul.c`'s product with each unit's codes decoded in registers (`gguf_avx2.h`) and
 * multiplied there, for up to FUSED_ROWS rows of x: a decode step's few rows do too little
 * with each code to pay for storing it and loading it back. The sums run in the order the
 * chunk path's do (`gguf_product.h`), so either path gives a row the same result.
 *
 * Built where the target has AVX2, FMA and F16C but not AVX-512 (whose wider vectors take the
 * chunk path); elsewhere `gguf_fused_sums` declines every call.
 */
#include "gguf_product.h"

#if LANES == 8 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "gguf_avx2.h"

/* rows in registers at once, each code decoded for all of them; a single row takes
 * FUSED_OUTPUTS outputs at once instead, for more sums in flight (measured a little faster at
 * one row; at four rows, four outputs a tile were slower than one) */
#define FUSED_TILE 4
#define FUSED_OUTPUTS 4
/* the most rows this path takes; more share each decoded chunk (the chunk path) */
#define FUSED_ROWS 8

/* unit u of block w of `type` (a superblock's u-th, or a 32-weight block's only one) */
INLINE unit_bytes unit_codes(const int type, const uint8_t *w, int u) {
    switch (type) {
    case GGUF_Q4_0: return q4_0_unit(w);
    case GGUF_Q4_1: return q4_1_unit(w);
    case GGUF_Q5_0: return q5_0_unit(w);
    case GGUF_Q5_1: return q5_1_unit(w);
    case GGUF_Q8_0: return q8_0_unit(w);
    case GGUF_IQ4_NL: return iq4_nl_unit(w);
    case GGUF_Q2_K: return q2_k_unit(w, u);
    case GGUF_Q3_K: return q3_k_unit(w, u);
    case GGUF_Q4_K: return q4_k_unit(w, u);
    case GGUF_Q5_K: return q5_k_unit(w, u);
    case GGUF_Q6_K: return q6_k_unit(w, u);
    default: return iq4_xs_unit(w, u);
    }
}

/* a superblock's scales and minimums */
INLINE void super_scales(const int type, const uint8_t *w, float *scale, float *minimum) {
    switch (type) {
    case GGUF_Q2_K: gguf_q2_k_scales(w, scale, minimum); break;
    case GGUF_Q3_K: gguf_q3_k_scales(w, scale); break;
    case GGUF_Q4_K:
    case GGUF_Q5_K: k_scales(w, scale, minimum); break;
    case GGUF_Q6_K: q6_k_scales(w, scale); break;
    default: gguf_iq4_xs_scales(w, scale); break;
    }
}

/* sums[r][o] (the even or the odd ones) += one unit of each of no outputs (codes[o], scales
 * scale[o]) for rows 0..mr-1 (x at the unit's first weight, rows `stride` apart) */
INLINE void unit_tile(const float *x, int64_t stride, const unit_bytes *codes, const __m256 *scale,
                      __m256 sums[][FUSED_OUTPUTS], const int mr, const int no) {
    __m256 dot[FUSED_TILE][FUSED_OUTPUTS];
    for (int k = 0; k < 4; k++) {
        __m256 q[FUSED_OUTPUTS];
        for (int o = 0; o < no; o++) q[o] = unit_field(codes[o], k);
        for (int r = 0; r < mr; r++) {
            const __m256 xk = _mm256_loadu_ps(x + r * stride + 8 * k);
            for (int o = 0; o < no; o++)
                dot[r][o] = k ? _mm256_fmadd_ps(xk, q[o], dot[r][o]) : _mm256_mul_ps(xk, q[o]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < no; o++) sums[r][o] = _mm256_fmadd_ps(dot[r][o], scale[o], sums[r][o]);
}

/* minimum += 8 groups' minimums times their sums of x, for rows 0..mr-1 */
INLINE void minimum_rows(const float *minimum, const float *xsum, int64_t xsums,
                         row_sums *sums, const int mr) {
    const __m256 m = _mm256_loadu_ps(minimum);
    for (int r = 0; r < mr; r++)
        sums[r].minimum = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + r * xsums), sums[r].minimum);
}

/* where group g's sum of x sits in a row's xsum */
static inline int64_t xsum_index(int64_t g, int G) {
    return g / (CHUNK / G) * MAX_GROUPS + g % (CHUNK / G);
}

/* a tile's even and odd sums in registers, from and back to output o's row_sums (sums +
 * o x rows) */
typedef struct {
    __m256 even[FUSED_TILE][FUSED_OUTPUTS], odd[FUSED_TILE][FUSED_OUTPUTS];
} tile_sums;

INLINE void tile_load(tile_sums *t, const row_sums *sums, int64_t rows, const int mr,
                      const int no) {
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < no; o++) {
            t->even[r][o] = sums[o * rows + r].even;
            t->odd[r][o] = sums[o * rows + r].odd;
        }
}

INLINE void tile_store(const tile_sums *t, row_sums *sums, int64_t rows, const int mr,
                       const int no) {
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < no; o++) {
            sums[o * rows + r].even = t->even[r][o];
            sums[o * rows + r].odd = t->odd[r][o];
        }
}

/* rows 0..mr-1 of the call (x, xsum at their first; sums: output o's at sums + o x rows)
 * against no rows of superblocks, w_stride bytes apart */
INLINE void super_tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                       int64_t w_stride, row_sums *sums, const int type, const int mr,
                       const int no) {
    const int G = k->f.group, groups = QK_K / G, minimum = k->f.has_minimum;
    const int64_t blocks = k->cols / QK_K, bytes_per_block = k->f.block_bytes;
    tile_sums t;
    tile_load(&t, sums, k->rows, mr, no);
    float scale[FUSED_OUTPUTS][16] = {{0}}, minimums[FUSED_OUTPUTS][16] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block[FUSED_OUTPUTS];
        for (int o = 0; o < no; o++) {
            block[o] = w + o * w_stride + b * bytes_per_block;
            super_scales(type, block[o], scale[o], minimums[o]);
        }
        const float *xb = x + b * QK_K;
        for (int u = 0; u < QK_K / UNIT; u += 2) {
            unit_bytes codes[FUSED_OUTPUTS];
            __m256 s[FUSED_OUTPUTS];
            for (int o = 0; o < no; o++) {
                codes[o] = unit_codes(type, block[o], u);
                s[o] = unit_scale(scale[o], u, G);
            }
            unit_tile(xb + u * UNIT, k->padded, codes, s, t.even, mr, no);
            for (int o = 0; o < no; o++) {
                codes[o] = unit_codes(type, block[o], u + 1);
                s[o] = unit_scale(scale[o], u + 1, G);
            }
            unit_tile(xb + (u + 1) * UNIT, k->padded, codes, s, t.odd, mr, no);
        }
        if (minimum)
            for (int o = 0; o < no; o++)
                for (int j = 0; j < groups; j += 8)
                    minimum_rows(minimums[o] + j, xsum + xsum_index(b * groups + j, G),
                                 xsum_stride(k), sums + o * k->rows, mr);
    }
    tile_store(&t, sums, k->rows, mr, no);
}

/* as `super_tile` for 32-weight blocks; the minimums go in 8 blocks at a time, as the chunk
 * path reads them */
INLINE void block_tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                       int64_t w_stride, row_sums *sums, const int type, const int mr,
                       const int no) {
    const int minimum = k->f.has_minimum;
    const int64_t blocks = k->cols / UNIT, bytes_per_block = k->f.block_bytes;
    tile_sums t;
    tile_load(&t, sums, k->rows, mr, no);
    float minimums[FUSED_OUTPUTS][8] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        unit_bytes codes[FUSED_OUTPUTS];
        __m256 s[FUSED_OUTPUTS];
        for (int o = 0; o < no; o++) {
            const uint8_t *block = w + o * w_stride + b * bytes_per_block;
            codes[o] = unit_codes(type, block, 0);
            s[o] = _mm256_set1_ps(half_at(block));
            if (minimum) minimums[o][b % 8] = half_at(block + 2);
        }
        unit_tile(x + b * UNIT, k->padded, codes, s, b % 2 ? t.odd : t.even, mr, no);
        if (minimum && (b % 8 == 7 || b == blocks - 1))
            for (int o = 0; o < no; o++) {
                minimum_rows(minimums[o], xsum + xsum_index(b / 8 * 8, UNIT), xsum_stride(k),
                             sums + o * k->rows, mr);
                for (int j = 0; j < 8; j++) minimums[o][j] = 0.0f;
            }
    }
    tile_store(&t, sums, k->rows, mr, no);
}

INLINE void tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                 int64_t w_stride, row_sums *sums, const int type, const int mr, const int no) {
    if (k->f.block_size == QK_K)
        super_tile(k, x, xsum, w, w_stride, sums, type, mr, no);
    else
        block_tile(k, x, xsum, w, w_stride, sums, type, mr, no);
}

/* n outputs' sums for every row: tiles of up to FUSED_TILE rows by one output; a single row
 * by FUSED_OUTPUTS outputs */
INLINE void type_sums(const call *k, const uint8_t *w, int64_t w_stride, int n,
                      row_sums *sums, const int type) {
    const int64_t xsums = xsum_stride(k);
    for (int64_t r0 = 0; r0 < k->rows; r0 += FUSED_TILE) {
        const int mr = k->rows - r0 < FUSED_TILE ? (int)(k->rows - r0) : FUSED_TILE;
        const float *x = k->x + r0 * k->padded;
        const float *xsum = k->xsum != NULL ? k->xsum + r0 * xsums : NULL;
        row_sums *s = sums + r0;
        int o = 0;
        if (mr == 1)
            for (; o + FUSED_OUTPUTS <= n; o += FUSED_OUTPUTS)
                tile(k, x, xsum, w + o * w_stride, w_stride, s + o * k->rows, type, 1,
                     FUSED_OUTPUTS);
        for (; o < n; o++) {
            const uint8_t *wo = w + o * w_stride;
            switch (mr) {
            case 1: tile(k, x, xsum, wo, w_stride, s + o * k->rows, type, 1, 1); break;
            case 2: tile(k, x, xsum, wo, w_stride, s + o * k->rows, type, 2, 1); break;
            case 3: tile(k, x, xsum, wo, w_stride, s + o * k->rows, type, 3, 1); break;
            default: tile(k, x, xsum, wo, w_stride, s + o * k->rows, type, 4, 1); break;
            }
        }
    }
}

int gguf_fused_sums(const call *k, const uint8_t *w, int64_t w_stride, int n, row_sums *sums) {
    if (k->rows > FUSED_ROWS) return -1;
    switch (k->type) {
#define TYPE_CASE(t) \
    case t: type_sums(k, w, w_stride, n, sums, t); return 0;
        TYPE_CASE(GGUF_Q4_0) TYPE_CASE(GGUF_Q4_1) TYPE_CASE(GGUF_Q5_0) TYPE_CASE(GGUF_Q5_1)
        TYPE_CASE(GGUF_Q8_0) TYPE_CASE(GGUF_IQ4_NL) TYPE_CASE(GGUF_Q2_K) TYPE_CASE(GGUF_Q3_K)
        TYPE_CASE(GGUF_Q4_K) TYPE_CASE(GGUF_Q5_K) TYPE_CASE(GGUF_Q6_K) TYPE_CASE(GGUF_IQ4_XS)
#undef TYPE_CASE
    default: return -1;
    }
}
#else
int gguf_fused_sums(const call *k, const uint8_t *w, int64_t w_stride, int n, row_sums *sums) {
    (void)k;
    (void)w;
    (void)w_stride;
    (void)n;
    (void)sums;
    return -1;
}
#endif
