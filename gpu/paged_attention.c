/* Decode attention straight from the paged KV cache, bfloat16, for the CPU.
 *
 * One query token per sequence: each (sequence, KV head) walks its block table once, reading
 * every cached key and value exactly once for all the query heads that share them, with an
 * online softmax in float32 that rescales its sums once per chunk of 32 tokens. Nothing is
 * gathered or padded.
 *
 * Built at first use by `cpu_kernels.py` with the machine's compiler (-O3 -march=native
 * -fopenmp) and called through ctypes; OpenMP is torch's own runtime, already loaded.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_HEADS 64
#define CHUNK 32

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* e^x for x <= 0 (what softmax needs once the max is subtracted), vectorisable unlike libm's
 * expf: 2^(x log2 e) split into an integer power and a degree-5 polynomial on [0, 1); relative
 * error below 4e-6. Arguments under -87 give ~1e-38 instead of 0, which adds nothing. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const float whole = floorf(t);
    const float f = t - whole;
    float p = 1.8775767e-3f;
    p = p * f + 8.9893397e-3f;
    p = p * f + 5.5826318e-2f;
    p = p * f + 2.4015361e-1f;
    p = p * f + 6.9315308e-1f;
    p = p * f + 9.9999994e-1f;
    const uint32_t bits = (uint32_t)((int32_t)whole + 127) << 23;
    float power;
    memcpy(&power, &bits, sizeof power);
    return p * power;
}

int triode_max_head_dim(void) { return MAX_HEAD_DIM; }
int triode_max_heads(void) { return MAX_HEADS; }

/* q, out: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size,
 * num_kv_heads, head_dim]; block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs].
 * Query head h reads KV head h / (num_heads / num_kv_heads). A context of 0 gives zeros.
 *
 * A work item is a sequence and a range of its KV heads: all of them when there are sequences
 * enough to share out, so each cached token row (every KV head side by side) streams from
 * memory once and in order; one head each for a few sequences, so both cores have work. */
void triode_paged_decode_attention_bf16(
    const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, uint16_t *out,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t splits = num_seqs >= 8 ? 1 : num_kv_heads;
    const int64_t heads_per_item = num_kv_heads / splits;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * splits; item++) {
        const int64_t s = item / splits;
        const int64_t first_kv = (item % splits) * heads_per_item;
        const int64_t n_heads = heads_per_item * group; /* query heads of this item */
        const int64_t first_head = first_kv * group;
        float query[MAX_HEADS][MAX_HEAD_DIM];
        float acc[MAX_HEADS][MAX_HEAD_DIM];
        float value[MAX_HEAD_DIM];
        float running_max[MAX_HEADS], denom[MAX_HEADS];
        float scores[MAX_HEADS][CHUNK];
        for (int64_t h = 0; h < n_heads; h++) {
            const uint16_t *qh = q + (s * num_heads + first_head + h) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) {
                query[h][d] = bf16_to_f32(qh[d]) * scale;
                acc[h][d] = 0.0f;
            }
            running_max[h] = -INFINITY;
            denom[h] = 0.0f;
        }
        const int64_t context = context_lens[s];
        const int64_t *table = block_tables + s * max_blocks;
        /* a chunk of tokens at a time: their scores, one rescale of the sums per chunk */
        for (int64_t start = 0; start < context; start += CHUNK) {
            const int64_t n = context - start < CHUNK ? context - start : CHUNK;
            int64_t rows[CHUNK];
            for (int64_t j = 0; j < n; j++) {
                const int64_t t = start + j;
                rows[j] = (table[t / block_size] * block_size + t % block_size) * token_stride;
            }
            for (int64_t j = 0; j < n; j++) {
                for (int64_t kv = 0; kv < heads_per_item; kv++) {
                    const uint16_t *kp = k_cache + rows[j] + (first_kv + kv) * head_dim;
                    float key[MAX_HEAD_DIM];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) key[d] = bf16_to_f32(kp[d]);
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
                const float rescale = exp_nonpositive(running_max[h] - chunk_max);
                running_max[h] = chunk_max;
                denom[h] *= rescale;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[h][d] *= rescale;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) {
                    scores[h][j] = exp_nonpositive(scores[h][j] - chunk_max);
                    sum += scores[h][j];
                }
                denom[h] += sum;
            }
            for (int64_t j = 0; j < n; j++) {
                for (int64_t kv = 0; kv < heads_per_item; kv++) {
                    const uint16_t *vp = v_cache + rows[j] + (first_kv + kv) * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) value[d] = bf16_to_f32(vp[d]);
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
            uint16_t *oh = out + (s * num_heads + first_head + h) * head_dim;
            const float inv = denom[h] > 0.0f ? 1.0f / denom[h] : 0.0f;
            for (int64_t d = 0; d < head_dim; d++) oh[d] = f32_to_bf16(acc[h][d] * inv);
        }
    }
}
