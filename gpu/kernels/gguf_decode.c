/* Each GGUF block type decoded into a chunk (`gguf_blocks.h`): codes, scales and minimums as
 * gguf's numpy `dequantize_blocks` derives them (the layouts are gguf/quants.py's), the scales'
 * products in float32 as numpy rounds them (d x sc here, x code in the caller).
 *
 * These are the plain C decoders, one code at a time in the file's order, which any target
 * runs; `gguf_decode_avx2.c` has faster ones for AVX2 that give the same chunk. */
#include <string.h>

#include "gguf_blocks.h"

/* code i of the chunk (its index in the file's order) */
static inline void put(gguf_chunk *c, int i, int code) { c->code[unit_position(i)] = (float)code; }

/* a 32-weight block's nibbles: bytes q[0..15], the low nibbles weights 0..15, the high ones
 * 16..31 */
static inline int nibble(const uint8_t *q, int l) { return (q[l % 16] >> (4 * (l / 16))) & 15; }

/* bit i of the 32-bit word at p */
static inline int bit(const uint8_t *p, int i) { return (int)(u32_at(p) >> i) & 1; }

/* weight i of 256: bits 2s, 2s + 1 of byte 32 h + l of q, i = 128 h + 32 s + l (Q2_K's and
 * Q3_K's codes, Q6_K's upper two bits) */
static inline int crumb(const uint8_t *q, int i) {
    return (q[i / 128 * 32 + i % 32] >> (2 * (i % 128 / 32))) & 3;
}

/* weight i of 256 in Q4_K's and Q5_K's nibbles: 32 bytes hold 64 weights, the low nibbles
 * first */
static inline int k_nibble(const uint8_t *q, int i) {
    return (q[i / 64 * 32 + i % 32] >> (4 * (i % 64 / 32))) & 15;
}

static void decode_q4_0(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 18) {
        c->scale[b] = half_at(w);
        for (int l = 0; l < 32; l++) put(c, 32 * b + l, nibble(w + 2, l) - 8);
    }
}

static void decode_q4_1(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 20) {
        c->scale[b] = half_at(w);
        c->minimum[b] = half_at(w + 2);
        for (int l = 0; l < 32; l++) put(c, 32 * b + l, nibble(w + 4, l));
    }
}

/* the fifth bit of weight l: bit l of the 32-bit word before the nibbles */
static void decode_q5_0(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 22) {
        c->scale[b] = half_at(w);
        for (int l = 0; l < 32; l++)
            put(c, 32 * b + l, (nibble(w + 6, l) | bit(w + 2, l) << 4) - 16);
    }
}

static void decode_q5_1(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 24) {
        c->scale[b] = half_at(w);
        c->minimum[b] = half_at(w + 2);
        for (int l = 0; l < 32; l++) put(c, 32 * b + l, nibble(w + 8, l) | bit(w + 4, l) << 4);
    }
}

static void decode_q8_0(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 34) {
        c->scale[b] = half_at(w);
        for (int l = 0; l < 32; l++) put(c, 32 * b + l, (int8_t)w[2 + l]);
    }
}

static void decode_iq4_nl(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 18) {
        c->scale[b] = half_at(w);
        for (int l = 0; l < 32; l++) put(c, 32 * b + l, IQ4_VALUES[nibble(w + 2, l)]);
    }
}

/* scales[16] | codes[64] | d | dmin: per 16 weights d x (sc & 15) and dmin x (sc >> 4) */
void gguf_q2_k_scales(const uint8_t *w, float *scale, float *minimum) {
    const float d = half_at(w + 80), dmin = half_at(w + 82);
    for (int j = 0; j < 16; j++) {
        scale[j] = d * (float)(w[j] & 15);
        minimum[j] = dmin * (float)(w[j] >> 4);
    }
}

static void decode_q2_k(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 84) {
        gguf_q2_k_scales(w, c->scale + 16 * b, c->minimum + 16 * b);
        for (int i = 0; i < QK_K; i++) put(c, QK_K * b + i, crumb(w + 16, i));
    }
}

/* hmask[32] | codes[64] | scales[12] | d: 6-bit scales less 32; 2-bit codes, less 4 where bit
 * i / 32 of hmask byte i % 32 is clear */
void gguf_q3_k_scales(const uint8_t *w, float *scale) {
    const uint8_t *sc = w + 96;
    const float d = half_at(w + 108);
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4;
        const int high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
        scale[j] = d * (float)((low | high << 4) - 32);
    }
}

static void decode_q3_k(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 110) {
        gguf_q3_k_scales(w, c->scale + 16 * b);
        for (int i = 0; i < QK_K; i++) {
            const int high = (w[i % 32] >> (i / 32)) & 1;
            put(c, QK_K * b + i, crumb(w + 32, i) - (high ? 0 : 4));
        }
    }
}

/* Q4_K's and Q5_K's d, dmin and 12 bytes of 6-bit scales and minimums, eight of each */
void gguf_k_scales(const uint8_t *w, float *scale, float *minimum) {
    uint64_t sc, m;
    gguf_k_scale_words(w, &sc, &m);
    const float d = half_at(w), dmin = half_at(w + 2);
    for (int j = 0; j < 8; j++) {
        scale[j] = d * (float)(uint8_t)(sc >> 8 * j);
        minimum[j] = dmin * (float)(uint8_t)(m >> 8 * j);
    }
}

/* d | dmin | scales[12] | codes[128] */
static void decode_q4_k(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 144) {
        gguf_k_scales(w, c->scale + 8 * b, c->minimum + 8 * b);
        for (int i = 0; i < QK_K; i++) put(c, QK_K * b + i, k_nibble(w + 16, i));
    }
}

/* d | dmin | scales[12] | high bits[32] | codes[128]: Q4_K's codes, and bit j of byte l the
 * fifth bit of weight 32 j + l */
static void decode_q5_k(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 176) {
        gguf_k_scales(w, c->scale + 8 * b, c->minimum + 8 * b);
        for (int i = 0; i < QK_K; i++)
            put(c, QK_K * b + i, k_nibble(w + 48, i) | ((w[16 + i % 32] >> (i / 32)) & 1) << 4);
    }
}

/* low nibbles[128] | high crumbs[64] | int8 scales[16] | d: 6-bit codes less 32; weight
 * 128 h + 64 n + l takes nibble n of byte 64 h + l */
void gguf_q6_k_scales(const uint8_t *w, float *scale) {
    const float d = half_at(w + 208);
    for (int j = 0; j < 16; j++) scale[j] = d * (float)(int8_t)w[192 + j];
}

static void decode_q6_k(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 210) {
        gguf_q6_k_scales(w, c->scale + 16 * b);
        for (int i = 0; i < QK_K; i++) {
            const int low = (w[i / 128 * 64 + i % 64] >> (4 * (i % 128 / 64))) & 15;
            put(c, QK_K * b + i, (low | crumb(w + 128, i) << 4) - 32);
        }
    }
}

/* d | high scale bits (16-bit) | low scale nibbles[4] | codes[128], 16 bytes a group of 32 */
void gguf_iq4_xs_scales(const uint8_t *w, float *scale) {
    const float d = half_at(w);
    const uint16_t high = u16_at(w + 2);
    for (int j = 0; j < 8; j++) {
        const int low = (w[4 + j / 2] >> (4 * (j % 2))) & 15;
        scale[j] = d * (float)((low | ((high >> (2 * j)) & 3) << 4) - 32);
    }
}

static void decode_iq4_xs(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int b = 0; b < blocks; b++, w += 136) {
        gguf_iq4_xs_scales(w, c->scale + 8 * b);
        for (int i = 0; i < QK_K; i++)
            put(c, QK_K * b + i, IQ4_VALUES[nibble(w + 8 + i / 32 * 16, i % 32)]);
    }
}

static void decode_f32(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int i = 0; i < blocks; i++) memcpy(&c->code[unit_position(i)], w + 4 * i, 4);
}

/* numpy's conversion, which keeps a signalling NaN signalling (F16C's quiets it) */
static void decode_f16(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int i = 0; i < blocks; i++) c->code[unit_position(i)] = half_f32(u16_at(w + 2 * i));
}

static void decode_bf16(const uint8_t *w, int blocks, gguf_chunk *c) {
    for (int i = 0; i < blocks; i++) c->code[unit_position(i)] = bf16_f32(u16_at(w + 2 * i));
}

static const gguf_format FORMATS[] = {
    [GGUF_F32] = {1, 4, 32, 0, 0, 1, decode_f32},
    [GGUF_F16] = {1, 2, 32, 0, 0, 1, decode_f16},
    [GGUF_Q4_0] = {32, 18, 32, 0, 0, 0, decode_q4_0},
    [GGUF_Q4_1] = {32, 20, 32, 1, 0, 0, decode_q4_1},
    [GGUF_Q5_0] = {32, 22, 32, 0, 0, 0, decode_q5_0},
    [GGUF_Q5_1] = {32, 24, 32, 1, 0, 0, decode_q5_1},
    [GGUF_Q8_0] = {32, 34, 32, 0, 0, 0, decode_q8_0},
    [GGUF_Q2_K] = {256, 84, 16, 1, 1, 0, decode_q2_k},
    [GGUF_Q3_K] = {256, 110, 16, 0, 0, 0, decode_q3_k},
    [GGUF_Q4_K] = {256, 144, 32, 1, 1, 0, decode_q4_k},
    [GGUF_Q5_K] = {256, 176, 32, 1, 1, 0, decode_q5_k},
    [GGUF_Q6_K] = {256, 210, 16, 0, 0, 0, decode_q6_k},
    [GGUF_IQ4_NL] = {32, 18, 32, 0, 0, 0, decode_iq4_nl},
    [GGUF_IQ4_XS] = {256, 136, 32, 0, 0, 0, decode_iq4_xs},
    [GGUF_BF16] = {1, 2, 32, 0, 0, 1, decode_bf16},
};

int gguf_format_of(int type, gguf_format *f) {
    if (type < 0 || type >= (int)(sizeof FORMATS / sizeof FORMATS[0]) || !FORMATS[type].decode)
        return -1;
    *f = FORMATS[type];
    const gguf_decoder vector = gguf_vector_decoder(type);
    if (vector != NULL) f->decode = vector;
    return 0;
}

int triode_gguf_block_size(int type) {
    gguf_format f;
    return gguf_format_of(type, &f) ? 0 : f.block_size;
}

int triode_gguf_block_bytes(int type) {
    gguf_format f;
    return gguf_format_of(type, &f) ? 0 : f.block_bytes;
}
