/* A decode step's whole run of decoder layers in one call: for rows that are each one
 * request's next token, every layer of a Llama-family decoder (RMS norm, the Q/K/V projection,
 * rotary embedding and the KV-cache write, paged attention, the output projection, the second
 * norm, the gate/up projection, SiLU-and-multiply, the down projection) runs the same kernels
 * that the Python modules call one by one (`quant_matmul.c`, `fused_ops.c`,
 * `paged_attention.c`), with the same arguments, so each row's result is the modules' bit for
 * bit; what goes is the interpreter's work between them, about a third of a one-request step
 * of a small model. `decode_stack.py` builds the structures and decides when a step may take
 * this path. */
#include <stdint.h>

#include "kernels.h"

/* one decoder layer: its weights as the kernels hold them and its KV cache */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden] in the step's element type */
    float input_eps, post_eps;
    /* the four projections: w, bits, cols, outputs and bias set; x, y and rows per step */
    quant_call qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [blocks, block_size, kv_heads, head_dim] */
    int64_t window;          /* sliding window in tokens, 0: the whole context */
} stack_layer;

/* one step: the layers, the shapes, the rows and their scratch */
typedef struct {
    const stack_layer *layers;
    int64_t num_layers, rows, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    int64_t block_size, max_blocks;
    float scale;
    int32_t f32; /* elements are float32, else bfloat16 */
    void *hidden_states; /* [rows, hidden]: the embeddings in, the last layer's output out */
    float *residual;     /* [rows, hidden]: the float32 residual stream out */
    void *normed, *qkv, *attn, *gate_up, *act; /* scratch, [rows, each width] */
    const int64_t *positions, *slots, *block_tables, *context_lens;
    const float *cos, *sin; /* the rotary tables, [positions, head_dim] */
} decode_step;

static int project(quant_call call, const void *x, void *y, int64_t rows) {
    call.x = x;
    call.x_stride = call.cols;
    call.rows = rows;
    call.y = y;
    call.y_stride = call.outputs;
    return triode_quant_matmul_call(&call);
}

static void norm(const decode_step *s, const void *x, const void *weight, float eps, int add) {
    if (s->f32)
        triode_add_rms_norm_f32(x, s->hidden, s->residual, weight, s->normed, s->rows, s->hidden,
                                eps, add);
    else
        triode_add_rms_norm_bf16(x, s->hidden, s->residual, weight, s->normed, s->rows,
                                 s->hidden, eps, add);
}

static void rope_and_attend(const decode_step *s, const stack_layer *l) {
    const int64_t width = (s->num_heads + 2 * s->num_kv_heads) * s->head_dim;
    if (s->f32) {
        triode_rope_cache_f32(s->qkv, width, s->rows, s->num_heads, s->num_kv_heads, s->head_dim,
                              s->positions, s->cos, s->sin, l->k_cache, l->v_cache, s->slots);
        triode_paged_decode_attention_f32(s->qkv, width, l->k_cache, l->v_cache, s->block_tables,
                                          s->context_lens, s->attn, s->rows, s->num_heads,
                                          s->num_kv_heads, s->head_dim, s->block_size,
                                          s->max_blocks, s->scale, l->window);
    } else {
        triode_rope_cache_bf16(s->qkv, width, s->rows, s->num_heads, s->num_kv_heads,
                               s->head_dim, s->positions, s->cos, s->sin, l->k_cache, l->v_cache,
                               s->slots);
        triode_paged_decode_attention_bf16(s->qkv, width, l->k_cache, l->v_cache,
                                           s->block_tables, s->context_lens, s->attn, s->rows,
                                           s->num_heads, s->num_kv_heads, s->head_dim,
                                           s->block_size, s->max_blocks, s->scale, l->window);
    }
}

/* Returns 0, or -1 where a projection refused its arguments (the outputs are then partial). */
int triode_decode_stack(const decode_step *s) {
    for (int64_t i = 0; i < s->num_layers; i++) {
        const stack_layer *l = &s->layers[i];
        /* the first layer starts the residual stream from the embeddings */
        norm(s, s->hidden_states, l->input_norm, l->input_eps, i > 0);
        if (project(l->qkv, s->normed, s->qkv, s->rows)) return -1;
        rope_and_attend(s, l);
        if (project(l->o, s->attn, s->hidden_states, s->rows)) return -1;
        norm(s, s->hidden_states, l->post_norm, l->post_eps, 1);
        if (project(l->gate_up, s->normed, s->gate_up, s->rows)) return -1;
        if (s->f32)
            triode_silu_mul_f32(s->gate_up, s->act, s->rows, s->intermediate);
        else
            triode_silu_mul_bf16(s->gate_up, s->act, s->rows, s->intermediate);
        if (project(l->down, s->act, s->hidden_states, s->rows)) return -1;
    }
    return 0;
}
