/* `gguf_decode.c`'s decoders in AVX2 (`gguf_avx2.h`'s units stored into the chunk, and F16C
 * for float16): the same chunks, several times faster. A target without AVX2 has none of
 * these and decodes with the plain C ones; AVX-512 targets take these too (the product's
 * vectors are wider there, the decoding is the same).
 */
#include "gguf_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "gguf_avx2.h"

static inline void store_unit(unit_bytes u, float *out) {
    for (int k = 0; k < 4; k++) _mm256_storeu_ps(out + 8 * k, unit_field(u, k));
}

/* a decoder of 32-weight blocks from its unit function */
#define BLOCK_DECODER(name, bytes_per_block, has_min)                          \
    static void decode_##name(const uint8_t *w, int blocks, gguf_chunk *c) {  \
        for (int b = 0; b < blocks; b++, w += bytes_per_block) {              \
            c->scale[b] = half_at(w);                                         \
            if (has_min) c->minimum[b] = half_at(w + 2);                      \
            store_unit(name##_unit(w), c->code + UNIT * b);                   \
        }                                                                     \
    }
BLOCK_DECODER(q4_0, 18, 0)
BLOCK_DECODER(q4_1, 20, 1)
BLOCK_DECODER(q5_0, 22, 0)
BLOCK_DECODER(q5_1, 24, 1)
BLOCK_DECODER(q8_0, 34, 0)
BLOCK_DECODER(iq4_nl, 18, 0)
#undef BLOCK_DECODER

/* a decoder of superblocks from its unit function and its scales' (groups: a superblock's) */
#define SUPER_DECODER(name, bytes_per_block, groups, scales)                   \
    static void decode_##name(const uint8_t *w, int blocks, gguf_chunk *c) {  \
        for (int b = 0; b < blocks; b++, w += bytes_per_block) {              \
            float *scale = c->scale + groups * b, *minimum = c->minimum + groups * b; \
            (void)minimum;                                                    \
            scales;                                                           \
            for (int u = 0; u < QK_K / UNIT; u++)                             \
                store_unit(name##_unit(w, u), c->code + QK_K * b + UNIT * u); \
        }                                                                     \
    }
SUPER_DECODER(q2_k, 84, 16, gguf_q2_k_scales(w, scale, minimum))
SUPER_DECODER(q3_k, 110, 16, gguf_q3_k_scales(w, scale))
SUPER_DECODER(q4_k, 144, 8, k_scales(w, scale, minimum))
SUPER_DECODER(q5_k, 176, 8, k_scales(w, scale, minimum))
SUPER_DECODER(q6_k, 210, 16, q6_k_scales(w, scale))
SUPER_DECODER(iq4_xs, 136, 8, gguf_iq4_xs_scales(w, scale))
#undef SUPER_DECODER

/* whether any of the 32 halves at p is a NaN */
static inline int any_nan(const uint8_t *p) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff), infinity = _mm256_set1_epi16(0x7c00);
    const __m256i low = _mm256_and_si256(load32(p), magnitude);
    const __m256i high = _mm256_and_si256(load32(p + 32), magnitude);
    const __m256i nan =
        _mm256_or_si256(_mm256_cmpgt_epi16(low, infinity), _mm256_cmpgt_epi16(high, infinity));
    return !_mm256_testz_si256(nan, nan);
}

/* F16C's conversion, but a NaN's bits as numpy keeps them (F16C quiets a signalling one):
 * units with a NaN take `half_f32` */
static void decode_f16(const uint8_t *w, int blocks, gguf_chunk *c) {
    int i = 0;
    for (; i + UNIT <= blocks; i += UNIT) {
        const uint8_t *p = w + 2 * i;
        if (any_nan(p)) {
            for (int j = 0; j < UNIT; j++)
                c->code[i + unit_position(j)] = half_f32(u16_at(p + 2 * j));
            continue;
        }
        __m256 natural[4], unit[4];
        for (int k = 0; k < 4; k++)
            natural[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
        file_to_unit_order(natural, unit);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(c->code + i + 8 * k, unit[k]);
    }
    for (; i < blocks; i++) c->code[unit_position(i)] = half_f32(u16_at(w + 2 * i));
}

gguf_decoder gguf_vector_decoder(int type) {
    switch (type) {
    case GGUF_F16: return decode_f16;
    case GGUF_Q4_0: return decode_q4_0;
    case GGUF_Q4_1: return decode_q4_1;
    case GGUF_Q5_0: return decode_q5_0;
    case GGUF_Q5_1: return decode_q5_1;
    case GGUF_Q8_0: return decode_q8_0;
    case GGUF_IQ4_NL: return decode_iq4_nl;
    case GGUF_Q2_K: return decode_q2_k;
    case GGUF_Q3_K: return decode_q3_k;
    case GGUF_Q4_K: return decode_q4_k;
    case GGUF_Q5_K: return decode_q5_k;
    case GGUF_Q6_K: return decode_q6_k;
    case GGUF_IQ4_XS: return decode_iq4_xs;
    default: return NULL;
    }
}
#else
gguf_decoder gguf_vector_decoder(int type) {
    (void)type;
    return NULL;
}
#endif
