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

/* rows in registers at once, each code decoded for all of them (an output row at a time:
 * tiles of several outputs were faster only while W fit in L2) */
#define FUSED_TILE 4
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

/* sums (the even or the odd ones) of rows 0..mr-1 += one unit (its codes, its scale): x at
 * the unit's first weight, rows `stride` apart */
INLINE void unit_rows(const float *x, int64_t stride, unit_bytes codes, __m256 scale,
                      __m256 *sums, const int mr) {
    __m256 dot[FUSED_TILE];
    for (int k = 0; k < 4; k++) {
        const __m256 q = unit_field(codes, k);
        for (int r = 0; r < mr; r++) {
            const __m256 xk = _mm256_loadu_ps(x + r * stride + 8 * k);
            dot[r] = k ? _mm256_fmadd_ps(xk, q, dot[r]) : _mm256_mul_ps(xk, q);
        }
    }
    for (int r = 0; r < mr; r++) sums[r] = _mm256_fmadd_ps(dot[r], scale, sums[r]);
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

/* rows 0..mr-1 of the call (x, xsum, sums at their first) against one row of superblocks */
INLINE void super_tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                       row_sums *sums, const int type, const int mr) {
    const int G = k->f.group, groups = QK_K / G, minimum = k->f.has_minimum;
    const int64_t blocks = k->cols / QK_K;
    __m256 even[FUSED_TILE], odd[FUSED_TILE];
    for (int r = 0; r < mr; r++) {
        even[r] = sums[r].even;
        odd[r] = sums[r].odd;
    }
    float scale[16] = {0}, minimums[16] = {0};
    for (int64_t b = 0; b < blocks; b++, w += k->f.block_bytes) {
        super_scales(type, w, scale, minimums);
        const float *xb = x + b * QK_K;
        for (int u = 0; u < QK_K / UNIT; u += 2) {
            unit_rows(xb + u * UNIT, k->padded, unit_codes(type, w, u), unit_scale(scale, u, G),
                      even, mr);
            unit_rows(xb + (u + 1) * UNIT, k->padded, unit_codes(type, w, u + 1),
                      unit_scale(scale, u + 1, G), odd, mr);
        }
        if (minimum)
            for (int j = 0; j < groups; j += 8)
                minimum_rows(minimums + j, xsum + xsum_index(b * groups + j, G), xsum_stride(k),
                             sums, mr);
    }
    for (int r = 0; r < mr; r++) {
        sums[r].even = even[r];
        sums[r].odd = odd[r];
    }
}

/* as `super_tile` for 32-weight blocks; the minimums go in 8 blocks at a time, as the chunk
 * path reads them */
INLINE void block_tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                       row_sums *sums, const int type, const int mr) {
    const int minimum = k->f.has_minimum;
    const int64_t blocks = k->cols / UNIT;
    __m256 even[FUSED_TILE], odd[FUSED_TILE];
    for (int r = 0; r < mr; r++) {
        even[r] = sums[r].even;
        odd[r] = sums[r].odd;
    }
    float minimums[8] = {0};
    for (int64_t b = 0; b < blocks; b++, w += k->f.block_bytes) {
        const __m256 scale = _mm256_set1_ps(half_at(w));
        unit_rows(x + b * UNIT, k->padded, unit_codes(type, w, 0), scale, b % 2 ? odd : even, mr);
        if (!minimum) continue;
        minimums[b % 8] = half_at(w + 2);
        if (b % 8 == 7 || b == blocks - 1) {
            minimum_rows(minimums, xsum + xsum_index(b / 8 * 8, UNIT), xsum_stride(k), sums, mr);
            for (int j = 0; j < 8; j++) minimums[j] = 0.0f;
        }
    }
    for (int r = 0; r < mr; r++) {
        sums[r].even = even[r];
        sums[r].odd = odd[r];
    }
}

INLINE void tile(const call *k, const float *x, const float *xsum, const uint8_t *w,
                 row_sums *sums, const int type, const int mr) {
    if (k->f.block_size == QK_K)
        super_tile(k, x, xsum, w, sums, type, mr);
    else
        block_tile(k, x, xsum, w, sums, type, mr);
}

/* n outputs' sums for every row, in tiles of up to FUSED_TILE rows */
INLINE void type_sums(const call *k, const uint8_t *w, int64_t w_stride, int n,
                      row_sums *sums, const int type) {
    const int64_t xsums = xsum_stride(k);
    for (int o = 0; o < n; o++, w += w_stride, sums += k->rows)
        for (int64_t r0 = 0; r0 < k->rows; r0 += FUSED_TILE) {
            const int mr = k->rows - r0 < FUSED_TILE ? (int)(k->rows - r0) : FUSED_TILE;
            const float *x = k->x + r0 * k->padded;
            const float *xsum = k->xsum != NULL ? k->xsum + r0 * xsums : NULL;
            switch (mr) {
            case 1: tile(k, x, xsum, w, sums + r0, type, 1); break;
            case 2: tile(k, x, xsum, w, sums + r0, type, 2); break;
            case 3: tile(k, x, xsum, w, sums + r0, type, 3); break;
            default: tile(k, x, xsum, w, sums + r0, type, 4); break;
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
