/* One unit (32 weights) of each GGUF block type's codes as four AVX2 float vectors in unit
 * order (`gguf_blocks.h`): vector k holds weights 4j + k, j = 0..7. `gguf_decode_avx2.c`
 * stores them into a chunk; `gguf_fused_avx2.c` multiplies by them straight from registers.
 *
 * Each type makes the unit's 32 codes as fields of bytes in the file's order, without sign
 * (nibbles, high bits put on, table values looked up: whole-register byte operations), then
 * takes field k of every 32-bit word as vector k: a shift, an and, a conversion; no shuffles.
 * Included only where the target has AVX2, FMA and F16C. */
#ifndef TRIODE_GGUF_AVX2_H
#define TRIODE_GGUF_AVX2_H

#include <immintrin.h>

#include "gguf_blocks.h"

static inline __m256i bytes(int v) { return _mm256_set1_epi8((char)v); }
static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* field k of every 32-bit word as 8 floats: bits 8k + shift.. under `mask`, less `offset`
 * (codes are stored without sign, so a field takes a shift and an and; fields at a word's
 * top or bottom need only one of them) */
static inline __m256 field(__m256i words, int k, int shift, int mask, int offset) {
    const int from = 8 * k + shift, width = 32 - __builtin_clz((unsigned)mask);
    __m256i v = from ? _mm256_srli_epi32(words, from) : words;
    if (from + width < 32) v = _mm256_and_si256(v, _mm256_set1_epi32(mask));
    if (offset) v = _mm256_sub_epi32(v, _mm256_set1_epi32(offset));
    return _mm256_cvtepi32_ps(v);
}

/* a unit's codes as fields of bytes: weight l's is bits shift.. of byte l (under mask), less
 * offset */
typedef struct {
    __m256i b;
    int shift, mask, offset;
} unit_bytes;

static inline __m256 unit_field(unit_bytes u, int k) {
    return field(u.b, k, u.shift, u.mask, u.offset);
}

/* nibble n of every byte */
static inline __m256i nibbles(__m256i b, int n) {
    return _mm256_and_si256(n ? _mm256_srli_epi16(b, 4) : b, bytes(15));
}

/* 16 bytes of nibbles as 32, the low nibbles first (a 32-weight block's layout), each in the
 * low half of its byte */
static inline __m256i nibbles16(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
}

/* byte i: `value` where bit i of `bits` is set, else 0 */
static inline __m256i bit_bytes(uint32_t bits, int value) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(value));
}

/* bit j of every byte, moved to bit `to` */
static inline __m256i bit_to(__m256i b, int j, int to) {
    const __m256i one = _mm256_and_si256(_mm256_srli_epi16(b, j), bytes(1));
    return _mm256_slli_epi16(one, to);
}

/* bits 2s, 2s + 1 of every byte */
static inline __m256i crumbs(__m256i b, int s) {
    return _mm256_and_si256(_mm256_srli_epi16(b, 2 * s), bytes(3));
}

/* IQ4's value for each nibble (the low half of each byte), plus 128: no sign */
static inline __m256i iq4_values(__m256i nibble_bytes) {
    const __m128i table = _mm_add_epi8(_mm_loadu_si128((const __m128i *)IQ4_VALUES),
                                       _mm_set1_epi8((char)128));
    return _mm256_shuffle_epi8(_mm256_set_m128i(table, table),
                               _mm256_and_si256(nibble_bytes, bytes(15)));
}

static inline unit_bytes unit(__m256i b, int shift, int mask, int offset) {
    return (unit_bytes){b, shift, mask, offset};
}

/* the unit of block w (its only one) of each 32-weight type */
static inline unit_bytes q4_0_unit(const uint8_t *w) { return unit(nibbles16(w + 2), 0, 15, 8); }
static inline unit_bytes q4_1_unit(const uint8_t *w) { return unit(nibbles16(w + 4), 0, 15, 0); }
static inline unit_bytes q5_0_unit(const uint8_t *w) {
    const __m256i low = _mm256_and_si256(nibbles16(w + 6), bytes(15));
    return unit(_mm256_or_si256(low, bit_bytes(u32_at(w + 2), 16)), 0, 31, 16);
}
static inline unit_bytes q5_1_unit(const uint8_t *w) {
    const __m256i low = _mm256_and_si256(nibbles16(w + 8), bytes(15));
    return unit(_mm256_or_si256(low, bit_bytes(u32_at(w + 4), 16)), 0, 31, 0);
}
static inline unit_bytes q8_0_unit(const uint8_t *w) {
    return unit(_mm256_xor_si256(load32(w + 2), bytes(128)), 0, 255, 128);
}
static inline unit_bytes iq4_nl_unit(const uint8_t *w) {
    return unit(iq4_values(nibbles16(w + 2)), 0, 255, 128);
}

/* unit u (0..7) of superblock w of each K type: 32 weights 32u.. */

/* weight 128 h + 32 s + l: bits 2s, 2s + 1 of byte 32 h + l of the codes */
static inline unit_bytes q2_k_unit(const uint8_t *w, int u) {
    return unit(load32(w + 16 + 32 * (u / 4)), 2 * (u % 4), 3, 0);
}

/* Q2_K's layout, less 4 where bit u of hmask byte l is clear */
static inline unit_bytes q3_k_unit(const uint8_t *w, int u) {
    const __m256i low = crumbs(load32(w + 32 + 32 * (u / 4)), u % 4);
    return unit(_mm256_or_si256(low, bit_to(load32(w), u, 2)), 0, 7, 4);
}

/* nibble u % 2 of the 32 bytes 32 (u / 2).. */
static inline unit_bytes q4_k_unit(const uint8_t *w, int u) {
    return unit(load32(w + 16 + 32 * (u / 2)), 4 * (u % 2), 15, 0);
}

/* Q4_K's nibbles, the fifth bit bit u of the high bits' byte l */
static inline unit_bytes q5_k_unit(const uint8_t *w, int u) {
    const __m256i low = nibbles(load32(w + 48 + 32 * (u / 2)), u % 2);
    return unit(_mm256_or_si256(low, bit_to(load32(w + 16), u, 4)), 0, 31, 0);
}

/* weight 128 h + 32 s + l: nibble s / 2 of low byte 64 h + 32 (s % 2) + l, over bits 2s,
 * 2s + 1 of high byte 32 h + l; less 32 */
static inline unit_bytes q6_k_unit(const uint8_t *w, int u) {
    const int h = u / 4, s = u % 4;
    const __m256i low = nibbles(load32(w + 64 * h + 32 * (s % 2)), s / 2);
    const __m256i high = _mm256_slli_epi16(crumbs(load32(w + 128 + 32 * h), s), 4);
    return unit(_mm256_or_si256(low, high), 0, 63, 32);
}

static inline unit_bytes iq4_xs_unit(const uint8_t *w, int u) {
    return unit(iq4_values(nibbles16(w + 8 + 16 * u)), 0, 255, 128);
}

/* a unit's 32 floats between the file's order and unit order: weight 4j + k is row j, column
 * k of an 8 x 4 matrix, which the file stores by rows and unit order by columns; each way is a
 * transpose of four 4 x 4 blocks */
static inline void file_to_unit_order(const __m256 n[4], __m256 v[4]) {
    const __m256 a0 = _mm256_permute2f128_ps(n[0], n[2], 0x20);
    const __m256 a1 = _mm256_permute2f128_ps(n[0], n[2], 0x31);
    const __m256 a2 = _mm256_permute2f128_ps(n[1], n[3], 0x20);
    const __m256 a3 = _mm256_permute2f128_ps(n[1], n[3], 0x31);
    const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
    const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
    v[0] = _mm256_shuffle_ps(t0, t2, 0x44);
    v[1] = _mm256_shuffle_ps(t0, t2, 0xee);
    v[2] = _mm256_shuffle_ps(t1, t3, 0x44);
    v[3] = _mm256_shuffle_ps(t1, t3, 0xee);
}

static inline void unit_to_file_order(const __m256 v[4], __m256 n[4]) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
    n[0] = _mm256_permute2f128_ps(u0, u1, 0x20);
    n[1] = _mm256_permute2f128_ps(u2, u3, 0x20);
    n[2] = _mm256_permute2f128_ps(u0, u1, 0x31);
    n[3] = _mm256_permute2f128_ps(u2, u3, 0x31);
}

/* the 8 bytes of b (unsigned) times d, as float32 */
static inline void scaled_bytes(uint64_t b, float d, float *out) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((int64_t)b)));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), v));
}

/* `gguf_k_scales`, vectorised */
static inline void k_scales(const uint8_t *w, float *scale, float *minimum) {
    uint64_t sc, m;
    gguf_k_scale_words(w, &sc, &m);
    scaled_bytes(sc, half_at(w), scale);
    scaled_bytes(m, half_at(w + 2), minimum);
}

/* 16 signed bytes times d, as float32 (Q6_K's scales) */
static inline void scaled_int8(__m128i b, float d, float *out) {
    const __m256 scale = _mm256_set1_ps(d);
    const __m128i high = _mm_unpackhi_epi64(b, b);
    _mm256_storeu_ps(out, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high))));
}

static inline void q6_k_scales(const uint8_t *w, float *scale) {
    scaled_int8(_mm_loadu_si128((const __m128i *)(w + 192)), half_at(w + 208), scale);
}

#endif
