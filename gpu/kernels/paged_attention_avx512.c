/* `paged_attention.c`'s decode attention on AVX-512, for bfloat16 KV caches of head sizes 64
 * and 128 and up to 8 query heads per KV head.
 *
 * The scores of 16 tokens are one vector (bfloat16 dot products where the CPU has them), the
 * softmax rescales once per span of 128 tokens, which every KV head of a sequence walks in turn
 * while the span's rows are near, and keys and values are fetched a few tokens ahead. A sliding
 * window is entered at its first token, as in the portable path.
 */
#include <math.h>
#include <stdint.h>

#include "elements.h"
#include "kernels.h"

#if defined(__AVX512F__)
/* 32 bfloat16 values as two float32 vectors, the even elements and the odd ones: the bits
 * moved up to the high half, or kept there; no shuffle. */
static inline void load32(const uint16_t *p, __m512 *even, __m512 *odd) {
    const __m512i v = _mm512_loadu_si512((const void *)p);
    *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* lane j = the sum of v[j]'s 16 lanes: 15 adds and 30 shuffles for 16 sums */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: pairs of v[2i] and v[2i + 1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: v[4i] .. v[4i + 3] */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0 + 1 and 2 + 3 of two groups of four */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

#define TILE 16  /* tokens whose scores are one vector */
#define SPAN 128 /* tokens per softmax rescale, and per pass of one KV head */
#define MAXC 4    /* vector pairs a row of D <= 128 bfloat16 elements holds */

#define AHEAD 8 /* tokens ahead that the walks over keys and values fetch them */

/* bytes [from, to) of a token row at `p` on their way to the cache level `hint` */
#define prefetch_bytes(p, from, to, hint)                                    \
    do {                                                                     \
        for (int64_t b_ = (from); b_ < (to); b_ += 64)                       \
            _mm_prefetch((const char *)(p) + b_, hint);                      \
    } while (0)
#define prefetch_row(p, D, hint) prefetch_bytes(p, 0, (D) * 2, hint)

/* one query head's online softmax between spans: its weighted sums of the values (even and odd
 * elements apart, as `load32` gives them), its running maximum and denominator */
typedef struct {
    __m512 even[MAXC], odd[MAXC];
    float max, denom;
} head_sums;

/* One KV head's G query heads (`sums`, D / 32 pairs of vectors a row; G and D constants at each
 * call site, so the queries and sums stay in registers) against `span` tokens whose rows start
 * at element offsets `rows`: every tile's 16 scores a head as one vector (`sum16`), the span's
 * maximum kept as a vector; then one online-softmax rescale per head for the whole span, and
 * the values weighted into the sums. Rescaling once per span, not per tile, keeps the serial
 * scalar work (maximum, rescale factor, denominator) off most tokens. `lead_bytes`: on the
 * first of several KV heads' walks, the bytes of a token's row from this head's keys on (the
 * walk brings them all into L2), else 0.
 *
 * Keys come AHEAD tokens early one by one (the hardware cannot follow rows strided across
 * blocks, and a whole tile's fetches at once fill the miss buffers): against a 16-token tile
 * fetched a tile ahead this took 64 sequences of 100 tokens from 12 to 8 ms a step. */
static inline __attribute__((always_inline)) void attend_span(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *rows,
    const int span, head_sums *sums, float scale, const int G, const int D,
    const int64_t lead_bytes) {
    const int C = D / 32;
#if defined(__AVX512BF16__)
    __m512bh q_pairs[8][MAXC]; /* the query as it is: products of bfloat16 pairs are exact */
#else
    __m512 q_even[8][MAXC], q_odd[8][MAXC];
#endif
    __m512 acc_even[8][MAXC], acc_odd[8][MAXC];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) {
#if defined(__AVX512BF16__)
            q_pairs[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(q + g * D + c * 32));
#else
            load32(q + g * D + c * 32, &q_even[g][c], &q_odd[g][c]);
#endif
            acc_even[g][c] = sums[g].even[c];
            acc_odd[g][c] = sums[g].odd[c];
        }
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int j = 0; j < span && j < AHEAD; j++) prefetch_row(k_cache + rows[j], D, _MM_HINT_T0);
    float weights[8][SPAN] __attribute__((aligned(64)));
    __m512 span_max[8];
    for (int g = 0; g < G; g++) span_max[g] = _mm512_set1_ps(-INFINITY);
    for (int t0 = 0; t0 < span; t0 += TILE) {
        const int n = span - t0 < TILE ? span - t0 : TILE;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        __m512 dots[8][TILE]; /* per head and token: 16 partial sums of its score */
        for (int j = 0; j < TILE; j++) {
            if (j >= n) {
                for (int g = 0; g < G; g++) dots[g][j] = _mm512_setzero_ps();
                continue;
            }
            const int64_t row = rows[t0 + j];
            /* a key AHEAD tokens on into L1; this token's value into L2, for the values'
             * walk; on the first KV head's walk, the rest of the token's row too (the later
             * heads' keys and values), for theirs */
            if (t0 + j + AHEAD < span)
                prefetch_row(k_cache + rows[t0 + j + AHEAD], D, _MM_HINT_T0);
            prefetch_bytes(v_cache + row, 0, lead_bytes > D * 2 ? lead_bytes : D * 2, _MM_HINT_T1);
            prefetch_bytes(k_cache + row, D * 2, lead_bytes, _MM_HINT_T1);
#if defined(__AVX512BF16__)
            __m512bh key[MAXC];
            for (int c = 0; c < C; c++)
                key[c] = (__m512bh)_mm512_loadu_si512((const void *)(k_cache + row + c * 32));
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_setzero_ps();
                for (int c = 0; c < C; c++) dot = _mm512_dpbf16_ps(dot, q_pairs[g][c], key[c]);
                dots[g][j] = dot;
            }
#else
            __m512 k_even[MAXC], k_odd[MAXC];
            for (int c = 0; c < C; c++) load32(k_cache + row + c * 32, &k_even[c], &k_odd[c]);
            for (int g = 0; g < G; g++) {
                __m512 dot = _mm512_mul_ps(q_even[g][0], k_even[0]);
                dot = _mm512_fmadd_ps(q_odd[g][0], k_odd[0], dot);
                for (int c = 1; c < C; c++) {
                    dot = _mm512_fmadd_ps(q_even[g][c], k_even[c], dot);
                    dot = _mm512_fmadd_ps(q_odd[g][c], k_odd[c], dot);
                }
                dots[g][j] = dot;
            }
#endif
        }
        for (int g = 0; g < G; g++) {
            const __m512 scores = _mm512_mask_mov_ps(
                _mm512_set1_ps(-INFINITY), live, _mm512_mul_ps(sum16(dots[g]), scale16));
            span_max[g] = _mm512_max_ps(span_max[g], scores);
            _mm512_store_ps(weights[g] + t0, scores);
        }
    }
    for (int g = 0; g < G; g++) {
        const float top = _mm512_reduce_max_ps(span_max[g]);
        const float new_max = top > sums[g].max ? top : sums[g].max;
        /* the first span rescales empty sums: the factor does not matter */
        const float rescale = exp_clamped(sums[g].max - new_max);
        sums[g].max = new_max;
        const __m512 shift = _mm512_set1_ps(new_max);
        __m512 total = _mm512_setzero_ps();
        for (int t0 = 0; t0 < span; t0 += TILE) {
            const int n = span - t0 < TILE ? span - t0 : TILE;
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            const __m512 p = _mm512_maskz_mov_ps(
                live, exp16(_mm512_sub_ps(_mm512_load_ps(weights[g] + t0), shift)));
            total = _mm512_add_ps(total, p);
            _mm512_store_ps(weights[g] + t0, p);
        }
        sums[g].denom = sums[g].denom * rescale + _mm512_reduce_add_ps(total);
        const __m512 r = _mm512_set1_ps(rescale);
        for (int c = 0; c < C; c++) {
            acc_even[g][c] = _mm512_mul_ps(acc_even[g][c], r);
            acc_odd[g][c] = _mm512_mul_ps(acc_odd[g][c], r);
        }
    }
    for (int j = 0; j < span && j < AHEAD; j++) prefetch_row(v_cache + rows[j], D, _MM_HINT_T0);
    for (int j = 0; j < span; j++) {
        if (j + AHEAD < span) prefetch_row(v_cache + rows[j + AHEAD], D, _MM_HINT_T0);
        for (int c = 0; c < C; c++) {
            __m512 v_even, v_odd;
            load32(v_cache + rows[j] + c * 32, &v_even, &v_odd);
            for (int g = 0; g < G; g++) {
                const __m512 p = _mm512_set1_ps(weights[g][j]);
                acc_even[g][c] = _mm512_fmadd_ps(p, v_even, acc_even[g][c]);
                acc_odd[g][c] = _mm512_fmadd_ps(p, v_odd, acc_odd[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) {
            sums[g].even[c] = acc_even[g][c];
            sums[g].odd[c] = acc_odd[g][c];
        }
}

/* a query head's output: its weighted sums over its denominator, as bfloat16 */
static void head_output(const head_sums *sums, int D, uint16_t *out) {
    const __m512 inv = _mm512_set1_ps(sums->denom > 0.0f ? 1.0f / sums->denom : 0.0f);
    float even[16] __attribute__((aligned(64))), odd[16] __attribute__((aligned(64)));
    for (int c = 0; c < D / 32; c++) {
        _mm512_store_ps(even, _mm512_mul_ps(sums->even[c], inv));
        _mm512_store_ps(odd, _mm512_mul_ps(sums->odd[c], inv));
        for (int i = 0; i < 16; i++) {
            out[c * 32 + 2 * i] = f32_bf16(even[i]);
            out[c * 32 + 2 * i + 1] = f32_bf16(odd[i]);
        }
    }
}

#define ATTEND(G, D)                                                                          \
    attend_span(q + s * q_stride + kv * (G) * (D), k_cache + kv * (D), v_cache + kv * (D),  \
                rows, span, sums + kv * (G), scale, G, D,                               \
                kv == first_kv ? (end_kv - kv) * (D) * 2 : 0)

#define CASES(D)                                                                              \
    switch (group) {                                                                          \
    case 1: ATTEND(1, D); break;                                                              \
    case 2: ATTEND(2, D); break;                                                              \
    case 3: ATTEND(3, D); break;                                                              \
    case 4: ATTEND(4, D); break;                                                              \
    case 5: ATTEND(5, D); break;                                                              \
    case 6: ATTEND(6, D); break;                                                              \
    case 7: ATTEND(7, D); break;                                                              \
    case 8: ATTEND(8, D); break;                                                              \
    }

static int vector_path(int64_t group, int64_t head_dim) {
    return group >= 1 && group <= 8 && (head_dim == 64 || head_dim == 128);
}

/* Work items as `kv_item_at` (kernels.h) makes them, an item's KV heads one after the other
 * over each span of tokens. Items are handed out one at a time: a thread that another process
 * holds up delays one. */
int triode_paged_decode_avx512(
    const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, uint16_t *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
    const int64_t group = num_heads / num_kv_heads;
    if (!vector_path(group, head_dim)) return -1;
    const int64_t token_stride = num_kv_heads * head_dim;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < kv_items(num_seqs, num_kv_heads); i++) {
        const kv_item item = kv_item_at(i, num_seqs, num_kv_heads);
        const int64_t s = item.seq, first_kv = item.first_kv, end_kv = item.end_kv;
        head_sums sums[MAX_HEADS] __attribute__((aligned(64)));
        for (int64_t h = first_kv * group; h < end_kv * group; h++) {
            for (int c = 0; c < MAXC; c++) sums[h].even[c] = sums[h].odd[c] = _mm512_setzero_ps();
            sums[h].max = -INFINITY;
            sums[h].denom = 0.0f;
        }
        const int64_t context = context_lens[s];
        const int64_t first = window_start(context, window);
        const int64_t *table = block_tables + s * max_blocks;
        /* the next token's place in the cache, advanced one token at a time (no division past
         * the first): the walk starts at the window's first token, in whatever slot of its
         * block */
        int64_t block = first / block_size, slot = first % block_size;
        int64_t rows[SPAN];
        /* a span of tokens at a time, every KV head of the item over it in turn: the span's
         * token rows (every KV head side by side) are still in cache for the later heads */
        for (int64_t start = first; start < context; start += SPAN) {
            const int span = context - start < SPAN ? (int)(context - start) : SPAN;
            for (int j = 0; j < span; j++) {
                rows[j] = (table[block] * block_size + slot) * token_stride;
                if (++slot == block_size) slot = 0, block++;
            }
            for (int64_t kv = first_kv; kv < end_kv; kv++) {
                if (head_dim == 64) {
                    CASES(64)
                } else {
                    CASES(128)
                }
            }
        }
        for (int64_t h = first_kv * group; h < end_kv * group; h++)
            head_output(&sums[h], (int)head_dim, out + (s * num_heads + h) * head_dim);
    }
    return 0;
}
#else

int triode_paged_decode_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int64_t *block_tables,
                               const int64_t *context_lens, uint16_t *out, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, float scale,
                               int64_t window) {
    (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)block_tables;
    (void)context_lens, (void)out, (void)num_seqs, (void)num_heads, (void)num_kv_heads;
    (void)head_dim, (void)block_size, (void)max_blocks, (void)scale, (void)window;
    return -1;
}

#endif
