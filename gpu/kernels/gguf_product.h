/* What `gguf_matmul.c`'s two paths share: the call's prepared x, each row's running sums, and
 * the order every row sums in, which both keep, so that a row's result is the same whichever
 * path and whatever rows beside it computed it.
 *
 * Per unit of 32 weights (`gguf_blocks.h`) a row takes x . codes in float32 fused
 * multiply-adds, LANES partial sums (the unit's first vector multiplied, the next added on),
 * then adds those times the unit's scale (a 16-weight type: each half's scale on its lanes)
 * into `even` or `odd` by the unit's parity: two chains of additions where one would wait on
 * itself. The minimums come in per chunk, in vectors of LANES groups, as minimum x sum(x over
 * the group) into `minimum`. At the end: (even + odd) + or - minimum, its lanes added.
 */
#ifndef TRIODE_GGUF_PRODUCT_H
#define TRIODE_GGUF_PRODUCT_H

#include "gguf_blocks.h"
#include "gguf_simd.h"

#define GGUF_MAX_ROWS 64
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    vf even, odd, minimum;
} row_sums;

/* x [rows, padded] float32 in unit order, zero past cols to whole chunks; for types with
 * minimums xsum [rows, chunks x MAX_GROUPS], each group's sum of x, zero past a chunk's
 * groups */
typedef struct {
    gguf_format f;
    int type;
    float *x, *xsum;
    int64_t rows, cols, padded, chunks;
} call;

static inline int64_t xsum_stride(const call *k) { return k->chunks * MAX_GROUPS; }

/* unit u's scale: the group's, or each half's on its lanes */
INLINE vf unit_scale(const float *scale, int u, const int G) {
    return G == 32 ? vf_set1(scale[u]) : vf_halves(scale[2 * u], scale[2 * u + 1]);
}

static inline float row_result(const gguf_format *f, const row_sums *s) {
    vf total = vf_add(s->even, s->odd);
    if (f->has_minimum) total = f->subtract ? vf_sub(total, s->minimum) : vf_add(total, s->minimum);
    return vf_sum(total);
}

/* `gguf_fused_avx2.c`: the sums of W's n rows at w (w_stride bytes apart) for every row of
 * the call, output j's at sums + j x rows, the codes decoded in registers; 0, or -1 where it
 * has no kernel for the call (and nothing is done) */
int gguf_fused_sums(const call *k, const uint8_t *w, int64_t w_stride, int n, row_sums *sums);

#endif
