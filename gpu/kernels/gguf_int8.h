/* The integer mode's vector operations (`gguf_int8.c`), with a portable C twin of each that
 * gives the same integers and the same float roundings in the same order: eight lanes of int32
 * sums and float accumulators, a unit's 32 codes (with or without sign), 16-bit scales per
 * pair of products, and the dots of codes with x's 8-bit values. INT8_SIMD where the target
 * has AVX2, FMA and F16C (`vpdpwssd` where it has AVX512-VNNI or AVX-VNNI). */
#ifndef TRIODE_GGUF_INT8_H
#define TRIODE_GGUF_INT8_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INT8_SIMD 1
#endif

/* rows of x a kernel call takes at once: the row layout's, and the x8 layout's (8 where the
 * target has 32 vector registers) */
#define ROW_TILE 4
#if defined(__AVX512VL__)
#define X8_TILE 8
#else
#define X8_TILE 4
#endif

/* x quantized: q [rows, cols] in file order, dx [rows, cols / unit], s [rows, cols / 16] (at
 * most 16 x 127: 16 bits) and, for the K-quants' unit of 256, u [rows, cols / 32], the sums of
 * each 32 */
typedef struct {
    int8_t *q;
    float *dx;
    int16_t *s, *u;
    int64_t rows, cols, unit;
} qx;

/* `gguf_int8_x8.c`: the K-quants repacked 8 output rows at a time, GGML type GGUF_X8 + the
 * file's type; a kernel writes out [mr][8], the group's outputs for rows r0..r0+mr-1 of x */
#define GGUF_X8 256
typedef void (*x8_kernel)(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out);
x8_kernel gguf_x8_kernel(int type);
int gguf_x8_bytes(int type);

/* ---- eight lanes: int32 sums, float accumulators; one order for every build ---- */

#ifdef INT8_SIMD
typedef __m256 lanes;
typedef __m256i ints;
typedef __m256i codes;  /* a unit's 32 codes, unsigned bytes */
typedef __m256i scales; /* 16 int16: a scale per pair of int16 products */
static inline lanes lanes_zero(void) { return _mm256_setzero_ps(); }
/* acc + scale x v, lane by lane */
static inline lanes lanes_fma(ints v, float scale, lanes acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(scale), acc);
}
static inline float lanes_sum(lanes v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline ints ints_zero(void) { return _mm256_setzero_si256(); }
/* the lanes' exact sum */
static inline int32_t ints_sum(ints v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1)));
}
static inline ints ints_sub32(ints a, ints b) {
    return _mm256_sub_epi32(a, _mm256_slli_epi32(b, 5));
}
/* acc + lane m: a[2m] b[2m] + a[2m+1] b[2m+1] over int16 pairs */
static inline ints pairs_dot(ints acc, __m256i a, scales b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
/* acc + lane m: scale of bytes 4m..4m+3 times (c . q) over its pairs; c < 64, so the pairs'
 * int16 sums never saturate */
static inline ints scaled_dot(ints acc, codes c, const int8_t *q, scales s) {
    return pairs_dot(acc, _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)q)), s);
}
/* the first 16 bytes of a unit scaled by a, the last 16 by b */
static inline scales scales_halves(int a, int b) {
    return _mm256_setr_m128i(_mm_set1_epi16((short)a), _mm_set1_epi16((short)b));
}
/* a superblock's 8 unit scales (bytes of a word) as int16, in both 128-bit halves */
typedef __m256i unit_scales;
static inline unit_scales unit_scales_of(uint64_t bytes) {
    return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)bytes)));
}
/* unit j's scale on every lane */
static inline scales unit_scale(unit_scales u, int j) {
    return _mm256_shuffle_epi8(u, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
}
/* Q6_K's 16 int8 scales as int16; unit j's halves take scales 2j and 2j + 1 */
static inline scales half_scales(scales all, int j) {
    const __m256i pair = _mm256_permutevar8x32_epi32(all, _mm256_set1_epi32(j));
    const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(pair, spread);
}
static inline scales scales_load(const int16_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
static inline scales scales_of_bytes(const int8_t *p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
}
/* lane i: byte i / 2 of m (a pair of 16 per unit) */
static inline scales scales_pairs(uint64_t m) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m));
    const __m128i lo = _mm_unpacklo_epi16(v, v), hi = _mm_unpackhi_epi16(v, v);
    return _mm256_setr_m128i(lo, hi);
}
static inline codes unit_nibbles(const uint8_t *p, int high) {
    const __m256i b = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(high ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(15));
}
/* Q5_K: a nibble and bit `bit` of h's bytes as the fifth */
static inline codes five_bits(const uint8_t *p, int high, const uint8_t *h, int bit) {
    const __m256i hb = _mm256_loadu_si256((const __m256i *)h);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, bit), _mm256_set1_epi8(1));
    return _mm256_or_si256(unit_nibbles(p, high), _mm256_slli_epi16(top, 4));
}
/* Q6_K: 4 low bits from p's nibble, 2 high bits from h's crumb */
static inline codes six_bits(const uint8_t *p, int high, const uint8_t *h, int crumb) {
    const __m256i hb = _mm256_loadu_si256((const __m256i *)h);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * crumb), _mm256_set1_epi8(3));
    return _mm256_or_si256(unit_nibbles(p, high), _mm256_slli_epi16(top, 4));
}
/* ---- the 32-weight blocks: codes of a block, signed or not ---- */
typedef __m256i signed_codes;
/* lane m: w . q over bytes 4m..4m+3 (|w| and q with w's sign) */
static inline ints signed_dot(signed_codes w, const int8_t *q) {
    const __m256i qv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q), w);
    return pairs_dot(ints_zero(), _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), qv),
                     _mm256_set1_epi16(1));
}
static inline ints unsigned_dot(codes c, const int8_t *q) {
    return pairs_dot(ints_zero(), _mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)q)),
                     _mm256_set1_epi16(1));
}
static inline signed_codes bytes_at(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
/* a block's 16 bytes: low nibbles weights 0..15, high nibbles 16..31 */
static inline codes block_nibbles(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_setr_m128i(b, _mm_srli_epi16(b, 4)), _mm256_set1_epi8(15));
}
/* c with bit i of h as weight i's fifth bit */
static inline codes with_fifth(codes c, uint32_t h) {
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    const __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread),
                                          _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    const __m256i set = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
    return _mm256_or_si256(c, _mm256_and_si256(set, _mm256_set1_epi8(16)));
}
static inline signed_codes less(codes c, int offset) {
    return _mm256_sub_epi8(c, _mm256_set1_epi8((char)offset));
}
#else
typedef struct {
    float v[8];
} lanes;
typedef struct {
    int32_t v[8];
} ints;
typedef struct {
    uint8_t v[32];
} codes;
typedef struct {
    int16_t v[16];
} scales;
static inline lanes lanes_zero(void) { return (lanes){{0}}; }
static inline lanes lanes_fma(ints v, float scale, lanes acc) {
    for (int m = 0; m < 8; m++) acc.v[m] = __builtin_fmaf((float)v.v[m], scale, acc.v[m]);
    return acc;
}
static inline float lanes_sum(lanes v) {
    const float h0 = v.v[0] + v.v[4], h1 = v.v[1] + v.v[5], h2 = v.v[2] + v.v[6],
                h3 = v.v[3] + v.v[7];
    return (h0 + h2) + (h1 + h3);
}
static inline ints ints_zero(void) { return (ints){{0}}; }
static inline int32_t ints_sum(ints v) {
    int32_t sum = 0;
    for (int m = 0; m < 8; m++) sum += v.v[m];
    return sum;
}
static inline ints ints_sub32(ints a, ints b) {
    for (int m = 0; m < 8; m++) a.v[m] -= 32 * b.v[m];
    return a;
}
static inline ints pairs_dot16(ints acc, const int32_t *a, scales b) {
    for (int m = 0; m < 8; m++) acc.v[m] += a[2 * m] * b.v[2 * m] + a[2 * m + 1] * b.v[2 * m + 1];
    return acc;
}
static inline ints scaled_dot(ints acc, codes c, const int8_t *q, scales s) {
    int32_t pairs[16];
    for (int i = 0; i < 16; i++) pairs[i] = c.v[2 * i] * q[2 * i] + c.v[2 * i + 1] * q[2 * i + 1];
    return pairs_dot16(acc, pairs, s);
}
static inline scales scales_halves(int a, int b) {
    scales s;
    for (int i = 0; i < 16; i++) s.v[i] = (int16_t)(i < 8 ? a : b);
    return s;
}
static inline scales scales_load(const int16_t *p) {
    scales s;
    memcpy(s.v, p, sizeof s.v);
    return s;
}
static inline scales scales_of_bytes(const int8_t *p) {
    scales s;
    for (int i = 0; i < 16; i++) s.v[i] = p[i];
    return s;
}
typedef uint64_t unit_scales;
static inline unit_scales unit_scales_of(uint64_t bytes) { return bytes; }
static inline scales unit_scale(unit_scales u, int j) {
    const int v = (uint8_t)(u >> 8 * j);
    return scales_halves(v, v);
}
static inline scales half_scales(scales all, int j) {
    return scales_halves(all.v[2 * j], all.v[2 * j + 1]);
}
static inline scales scales_pairs(uint64_t m) {
    scales s;
    for (int i = 0; i < 16; i++) s.v[i] = (uint8_t)(m >> 8 * (i / 2));
    return s;
}
/* acc + lane m: a[2m] b[2m] + a[2m+1] b[2m+1] over int16 pairs */
static inline ints pairs_dot(ints acc, scales a, scales b) {
    int32_t wide[16];
    for (int i = 0; i < 16; i++) wide[i] = a.v[i];
    return pairs_dot16(acc, wide, b);
}
static inline codes unit_nibbles(const uint8_t *p, int high) {
    codes c;
    for (int i = 0; i < 32; i++) c.v[i] = (p[i] >> (4 * high)) & 15;
    return c;
}
static inline codes five_bits(const uint8_t *p, int high, const uint8_t *h, int bit) {
    codes c = unit_nibbles(p, high);
    for (int i = 0; i < 32; i++) c.v[i] |= ((h[i] >> bit) & 1) << 4;
    return c;
}
static inline codes six_bits(const uint8_t *p, int high, const uint8_t *h, int crumb) {
    codes c = unit_nibbles(p, high);
    for (int i = 0; i < 32; i++) c.v[i] |= ((h[i] >> (2 * crumb)) & 3) << 4;
    return c;
}
typedef struct {
    int8_t v[32];
} signed_codes;
static inline ints signed_dot(signed_codes w, const int8_t *q) {
    ints d;
    for (int m = 0; m < 8; m++) {
        d.v[m] = 0;
        for (int i = 4 * m; i < 4 * m + 4; i++) d.v[m] += w.v[i] * q[i];
    }
    return d;
}
static inline signed_codes bytes_at(const uint8_t *p) {
    signed_codes c;
    memcpy(c.v, p, sizeof c.v);
    return c;
}
static inline codes block_nibbles(const uint8_t *p) {
    codes c;
    for (int i = 0; i < 16; i++) {
        c.v[i] = p[i] & 15;
        c.v[i + 16] = p[i] >> 4;
    }
    return c;
}
static inline codes with_fifth(codes c, uint32_t h) {
    for (int i = 0; i < 32; i++) c.v[i] |= ((h >> i) & 1) << 4;
    return c;
}
static inline signed_codes less(codes c, int offset) {
    signed_codes s;
    for (int i = 0; i < 32; i++) s.v[i] = (int8_t)(c.v[i] - offset);
    return s;
}
/* codes without sign are below 32: as signed codes they are the same values */
static inline ints unsigned_dot(codes c, const int8_t *q) { return signed_dot(less(c, 0), q); }
#endif

/* ---- a K-quant superblock's unit j of 32 codes, as the file stores them ---- */

static inline codes q4_k_codes(const uint8_t *w, int j) {
    return unit_nibbles(w + 16 + 32 * (j / 2), j % 2);
}
/* d | dmin | scales[12] | high bits[32] | codes[128]: bit j of high byte l is weight 32j + l's
 * fifth */
static inline codes q5_k_codes(const uint8_t *w, int j) {
    return five_bits(w + 48 + 32 * (j / 2), j % 2, w + 16, j);
}
/* Q6_K: unit 4h + n (h, n < 4) takes nibble n / 2 of low bytes 64h + 32(n % 2) onwards and
 * crumb n of high bytes 32h onwards (codes 0..63 for -32..31) */
static inline codes q6_k_codes(const uint8_t *w, int j) {
    const int h = j / 4, n = j % 4;
    return six_bits(w + 64 * h + 32 * (n % 2), n / 2, w + 128 + 32 * h, n);
}
/* a unit's codes as 32 bytes at p */
static inline void codes_store(codes c, uint8_t *p) {
#ifdef INT8_SIMD
    _mm256_storeu_si256((__m256i *)p, c);
#else
    memcpy(p, c.v, sizeof c.v);
#endif
}

#endif
