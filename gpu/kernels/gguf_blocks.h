/* GGUF's weight blocks as the file stores them, row-major (`gguf_decode.c` decodes them,
 * `gguf_dequant.c` writes the float weights, `gguf_matmul.c` multiplies by them).
 *
 * Every type here decodes to the same shape, a "chunk" of up to CHUNK consecutive weights of
 * a row: integer codes (as floats, exact), and per group of 16 or 32 weights a scale and, for
 * the types that have one, a minimum. A weight is scale x code, then plus or minus (`subtract`)
 * the minimum: the operations gguf's numpy `dequantize` does, in its order, so that the
 * products round as its do. The K-quants' and IQ4_XS's chunk is whole superblocks, the other
 * types' whole blocks; the float types have groups of 32 with scale 1.
 *
 * Codes sit in "unit order": in each unit of 32 weights, weight 4j + k at position 8k + j
 * (j < 8, k < 4). Byte k of each 32-bit word of 32 code bytes is then one vector of 8 codes,
 * which shifts take out where widening bytes in file order would take a shuffle each, and
 * shuffles are what an x86 core has fewest of. The product reorders x the same way.
 */
#ifndef TRIODE_GGUF_BLOCKS_H
#define TRIODE_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* gguf.GGMLQuantizationType */
enum {
    GGUF_F32 = 0,
    GGUF_F16 = 1,
    GGUF_Q4_0 = 2,
    GGUF_Q4_1 = 3,
    GGUF_Q5_0 = 6,
    GGUF_Q5_1 = 7,
    GGUF_Q8_0 = 8,
    GGUF_Q2_K = 10,
    GGUF_Q3_K = 11,
    GGUF_Q4_K = 12,
    GGUF_Q5_K = 13,
    GGUF_Q6_K = 14,
    GGUF_IQ4_NL = 20,
    GGUF_IQ4_XS = 23,
    GGUF_BF16 = 30,
};

#define QK_K 256
#define UNIT 32
#define CHUNK 1024
#define MAX_GROUPS (CHUNK / 16)

typedef struct {
    float code[CHUNK] __attribute__((aligned(64))); /* in unit order */
    /* zero past the chunk's groups where the product reads whole vectors of them */
    float scale[MAX_GROUPS] __attribute__((aligned(64)));
    float minimum[MAX_GROUPS] __attribute__((aligned(64)));
} gguf_chunk;

/* decodes `blocks` consecutive blocks (a chunk's worth or fewer) into `c` */
typedef void (*gguf_decoder)(const uint8_t *w, int blocks, gguf_chunk *c);

typedef struct {
    int block_size;  /* weights a block */
    int block_bytes;
    int group;       /* weights sharing a scale: 16 or 32 */
    int has_minimum; /* the weights add or subtract a minimum per group */
    int subtract;    /* ... subtract it (the K-quants: scale x code - minimum) */
    int plain;       /* the float types: the code is the weight, no scale */
    gguf_decoder decode;
} gguf_format;

/* the format of GGML type `type` into f: 0, or -1 where this library does not take it. Its
 * decoder is this build's fastest: `gguf_decode_avx2.c`'s where the target has AVX2. */
int gguf_format_of(int type, gguf_format *f);
/* a decoder that this build vectorises by hand for `type`, or NULL */
gguf_decoder gguf_vector_decoder(int type);

/* the scales (and minimums) of one superblock, as every decoder of its type takes them */
void gguf_q2_k_scales(const uint8_t *w, float *scale, float *minimum);
void gguf_q3_k_scales(const uint8_t *w, float *scale);
void gguf_k_scales(const uint8_t *w, float *scale, float *minimum); /* Q4_K and Q5_K */
void gguf_q6_k_scales(const uint8_t *w, float *scale);
void gguf_iq4_xs_scales(const uint8_t *w, float *scale);

/* blocks a chunk holds */
static inline int chunk_blocks(const gguf_format *f) { return CHUNK / f->block_size; }

/* where weight i of a chunk sits in its unit order */
static inline int unit_position(int i) { return (i & ~31) | (i & 3) << 3 | (i & 31) >> 2; }

/* IQ4_NL's and IQ4_XS's 16 code values */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

static inline uint16_t u16_at(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Q4_K's and Q5_K's 6-bit scale and minimum codes of a superblock's 8 units, byte j of each
 * word unit j's (the floats are d and dmin times them): its 12 bytes taken as three words,
 * four 6-bit values a word */
static inline void gguf_k_scale_words(const uint8_t *w, uint64_t *sc, uint64_t *m) {
    const uint32_t a = u32_at(w + 4), b = u32_at(w + 8), c = u32_at(w + 12);
    *sc = (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32 | (a & 0x3f3f3f3fu);
    *m = (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32 | (b & 0x3f3f3f3fu);
}

static inline float half_at(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss(u16_at(p));
#else
    return half_f32(u16_at(p));
#endif
}

#endif
