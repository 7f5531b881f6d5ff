/* Decode attention straight from the paged KV cache, bfloat16 or float32, for the CPU.
 *
 * One query token per row (a decode, or one token of a short prompt chunk, whose context ends
 * at its own position): each (row, KV head) walks its block table once, reading every cached
 * key and value exactly once for all the query heads that share them, with an online softmax
 * in float32. Nothing is gathered or padded.
 *
 * Two paths: with AVX-512, for bfloat16 head sizes 64 and 128 and up to 8 query heads per KV
 * head, `paged_attention_avx512.c`; elsewhere, and for float32, this file's portable loop,
 * which the compiler vectorises over the head dimension and which rescales once per 32 tokens.
 * Float32 takes libm's expf, as torch's softmax is near exact.
 *
 * A sliding window of w tokens (0: none) limits a row whose context is n tokens to the keys at
 * positions n - w .. n - 1: both paths start their walk at position n - w, so the blocks before
 * it are never read and the first block in the window is entered at its slot.
 *
 * Built at first use by `cpu_kernels.py` with the machine's compiler (-O3 -march=native
 * -fopenmp) and called through ctypes; OpenMP is torch's own runtime, already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "elements.h"
#include "kernels.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
/* GCC tunes for AMD's first EPYC here and vectorises in halves of AVX2's 256 bits: whole
 * registers halve the dot products and the weighted sums of the values */
#pragma GCC target("prefer-vector-width=256")
#endif

#define CHUNK 32

int triode_max_head_dim(void) { return MAX_HEAD_DIM; }
int triode_max_heads(void) { return MAX_HEADS; }

/* q: [num_seqs, num_heads, head_dim] with q_stride elements from one sequence's row to the
 * next; out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs].
 * Query head h reads KV head h / (num_heads / num_kv_heads). A context of 0 gives zeros.
 * window > 0: a row reads only its context's last `window` tokens.
 *
 * A work item is a sequence and a range of its KV heads (`kv_item_at`, kernels.h). */
INLINE void paged_decode_generic(
    const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, void *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window, int f32) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < kv_items(num_seqs, num_kv_heads); i++) {
        const kv_item item = kv_item_at(i, num_seqs, num_kv_heads);
        const int64_t s = item.seq, first_kv = item.first_kv;
        const int64_t heads_per_item = item.end_kv - first_kv;
        const int64_t n_heads = heads_per_item * group; /* query heads of this item */
        const int64_t first_head = first_kv * group;
        float query[MAX_HEADS][MAX_HEAD_DIM];
        float acc[MAX_HEADS][MAX_HEAD_DIM];
        float value[MAX_HEAD_DIM];
        float running_max[MAX_HEADS], denom[MAX_HEADS];
        float scores[MAX_HEADS][CHUNK];
        for (int64_t h = 0; h < n_heads; h++) {
            const void *qh = elem_at(q, s * q_stride + (first_head + h) * head_dim, f32);
            for (int64_t d = 0; d < head_dim; d++) {
                query[h][d] = load_elem(qh, d, f32) * scale;
                acc[h][d] = 0.0f;
            }
            running_max[h] = -INFINITY;
            denom[h] = 0.0f;
        }
        const int64_t context = context_lens[s];
        const int64_t first = window_start(context, window);
        const int64_t *table = block_tables + s * max_blocks;
        /* a chunk of tokens at a time: their scores, one rescale of the sums per chunk */
        for (int64_t start = first; start < context; start += CHUNK) {
            const int64_t n = context - start < CHUNK ? context - start : CHUNK;
            int64_t rows[CHUNK];
            for (int64_t j = 0; j < n; j++) {
                const int64_t t = start + j;
                rows[j] = (table[t / block_size] * block_size + t % block_size) * token_stride;
            }
            for (int64_t j = 0; j < n; j++) {
                for (int64_t kv = 0; kv < heads_per_item; kv++) {
                    const void *kp = elem_at(k_cache, rows[j] + (first_kv + kv) * head_dim, f32);
                    float key[MAX_HEAD_DIM];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) key[d] = load_elem(kp, d, f32);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = kv * group + g;
                        float score = 0.0f;
#pragma omp simd reduction(+ : score)
                        for (int64_t d = 0; d < head_dim; d++) score += query[h][d] * key[d];
                        scores[h][j] = score;
                    }
                }
            }
            for (int64_t h = 0; h < n_heads; h++) {
                float chunk_max = running_max[h];
                for (int64_t j = 0; j < n; j++)
                    chunk_max = scores[h][j] > chunk_max ? scores[h][j] : chunk_max;
                /* the first chunk rescales empty sums: the factor does not matter */
                const float rescale = exp_for(running_max[h] - chunk_max, f32);
                running_max[h] = chunk_max;
                denom[h] *= rescale;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[h][d] *= rescale;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) {
                    scores[h][j] = exp_for(scores[h][j] - chunk_max, f32);
                    sum += scores[h][j];
                }
                denom[h] += sum;
            }
            for (int64_t j = 0; j < n; j++) {
                for (int64_t kv = 0; kv < heads_per_item; kv++) {
                    const void *vp = elem_at(v_cache, rows[j] + (first_kv + kv) * head_dim, f32);
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) value[d] = load_elem(vp, d, f32);
                    for (int64_t g = 0; g < group; g++) {
                        const int64_t h = kv * group + g;
                        const float p = scores[h][j];
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; d++) acc[h][d] += p * value[d];
                    }
                }
            }
        }
        for (int64_t h = 0; h < n_heads; h++) {
            void *oh = (char *)out + (s * num_heads + first_head + h) * head_dim * elem_size(f32);
            const float inv = denom[h] > 0.0f ? 1.0f / denom[h] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) store_elem(oh, d, acc[h][d] * inv, f32);
        }
    }
}


void triode_paged_decode_attention_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, uint16_t *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
    if (triode_paged_decode_avx512(q, q_stride, k_cache, v_cache, block_tables, context_lens, out,
                                   num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                   max_blocks, scale, window) == 0)
        return;
    paged_decode_generic(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, num_seqs,
                         num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window,
                         0);
}

void triode_paged_decode_attention_f32(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, float *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
    paged_decode_generic(q, q_stride, k_cache, v_cache, block_tables, context_lens, out, num_seqs,
                         num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, window,
                         1);
}
