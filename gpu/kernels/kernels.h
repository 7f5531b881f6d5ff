/* The entry points one kernel of this library calls in another (`decode_stack.c` runs the
 * others in turn), and `quant_matmul.c`'s call structure, which both build. */
#ifndef TRIODE_KERNELS_H
#define TRIODE_KERNELS_H

#include <stdint.h>

/* one call's arguments to `quant_matmul.c`, as `quant_matmul.py` keeps them (a call passes one
 * pointer) */
typedef struct quant_call {
    const void *x;
    int64_t x_stride, rows, cols;
    const uint8_t *w;
    const float *bias;
    int64_t outputs;
    void *y;
    int64_t y_stride;
    int32_t bits, bf16; /* bf16: x and y are bfloat16, else float32 */
    int32_t paired;     /* codes paired for `quant_paired.c` (bfloat16 x and y) */
    /* bits 0: w is `outputs` rows of GGUF blocks of GGML type `gguf_type` as the file stores
     * them, row r at w + r * w_stride (`gguf_matmul.c`); `next`, where not NULL, the weight
     * whose rows follow (a merged projection of parts of different types): it takes this
     * call's x, rows and element type and writes the next columns of y (and reads the next
     * stretch of the bias) */
    int32_t gguf_type;
    int64_t w_stride;
    const struct quant_call *next;
    /* bits 0: this part in the integer mode (`gguf_int8.c`) where its type has it, else the
     * exact mode */
    int32_t int8;
} quant_call;

int triode_quant_matmul_call(const quant_call *c);
/* `gguf_matmul.c`: y = x W^T (+ bias) for 1 to `triode_gguf_max_rows()` rows from W's GGUF
 * blocks as stored; 0, or -1 for arguments it does not take */
int triode_gguf_matmul(int type, const void *x, int64_t x_stride, int64_t rows, int64_t cols,
                       const uint8_t *w, int64_t w_stride, int64_t outputs, const float *bias,
                       void *y, int64_t y_stride, int bf16);
/* `gguf_int8.c`: the same in integer arithmetic, for the types `triode_gguf_int8_takes` */
int triode_gguf_matmul_int8(int type, const void *x, int64_t x_stride, int64_t rows,
                            int64_t cols, const uint8_t *w, int64_t w_stride, int64_t outputs,
                            const float *bias, void *y, int64_t y_stride, int bf16);
int triode_gguf_int8_takes(int type);
/* one part of a merged projection's stacked rows, as the file stores them */
#define GGUF_MAX_PARTS 8
typedef struct {
    int type;
    const uint8_t *w;
    int64_t w_stride, outputs;
} gguf_part;
/* the parts' rows stacked (y's columns part after part), x quantized once per unit size and
 * one parallel loop over every part's rows */
int triode_gguf_matmul_int8_parts(const gguf_part *parts, int count, const void *x,
                                  int64_t x_stride, int64_t rows, int64_t cols, const float *bias,
                                  void *y, int64_t y_stride, int bf16);
int triode_quant_paired_rows(const uint16_t *x, int64_t x_stride, float *xsums,
                             int64_t rows, int64_t cols, const uint8_t *w, int bits,
                             const float *bias, int64_t outputs, uint16_t *y, int64_t y_stride);

void triode_add_rms_norm_bf16(const uint16_t *x, int64_t x_stride, float *residual,
                              const uint16_t *weight, uint16_t *out, int64_t rows,
                              int64_t hidden, float eps, int add);
void triode_add_rms_norm_f32(const float *x, int64_t x_stride, float *residual,
                             const float *weight, float *out, int64_t rows, int64_t hidden,
                             float eps, int add);
void triode_rope_cache_bf16(uint16_t *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                            const float *cos, const float *sin, uint16_t *k_cache,
                            uint16_t *v_cache, const int64_t *slots);
void triode_rope_cache_f32(float *qkv, int64_t row_stride, int64_t rows, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                           const float *cos, const float *sin, float *k_cache, float *v_cache,
                           const int64_t *slots);
void triode_silu_mul_bf16(const uint16_t *x, uint16_t *out, int64_t rows, int64_t size);
void triode_silu_mul_f32(const float *x, float *out, int64_t rows, int64_t size);
/* decode attention's limits (`paged_attention.c`), and the first position a context of
 * `context` tokens reads under a sliding `window` (0: none) */
#define MAX_HEAD_DIM 256
#define MAX_HEADS 64
static inline int64_t window_start(int64_t context, int64_t window) {
    return window > 0 && context > window ? context - window : 0;
}

/* Decode attention's work items, which both paths hand out one at a time: from 8 sequences on,
 * a sequence with all its KV heads, so that each cached token row (every KV head side by side)
 * streams from memory once and in order; below that one KV head of a sequence, so that every
 * thread has work. Item i of kv_items(...) is sequence `seq`'s KV heads [first_kv, end_kv). */
typedef struct {
    int64_t seq, first_kv, end_kv;
} kv_item;
static inline int64_t kv_splits(int64_t num_seqs, int64_t num_kv_heads) {
    return num_seqs >= 8 ? 1 : num_kv_heads;
}
static inline int64_t kv_items(int64_t num_seqs, int64_t num_kv_heads) {
    return num_seqs * kv_splits(num_seqs, num_kv_heads);
}
static inline kv_item kv_item_at(int64_t i, int64_t num_seqs, int64_t num_kv_heads) {
    const int64_t splits = kv_splits(num_seqs, num_kv_heads), heads = num_kv_heads / splits;
    const int64_t first = i % splits * heads;
    return (kv_item){i / splits, first, first + heads};
}

/* `paged_attention_avx512.c`: 0, or -1 where the build has no AVX-512 or the shape is not one
 * it takes (the portable path then runs) */
int triode_paged_decode_avx512(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache,
                               const uint16_t *v_cache, const int64_t *block_tables,
                               const int64_t *context_lens, uint16_t *out, int64_t num_seqs,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t block_size, int64_t max_blocks, float scale,
                               int64_t window);
void triode_paged_decode_attention_bf16(
    const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, uint16_t *out, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int64_t window);
void triode_paged_decode_attention_f32(
    const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
    const int64_t *block_tables, const int64_t *context_lens, float *out, int64_t num_seqs,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int64_t window);

#endif
