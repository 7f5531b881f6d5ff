/* The integer mode's K-quant weights (Q4_K, Q5_K, Q6_K) repacked eight output rows at a time
 * ("x8"), made at load from the file's blocks, and their product with x's 8-bit rows.
 *
 * In the file a superblock is 256 weights of one row; a unit's 32 codes lie side by side, so a
 * row's dot with x takes two multiplies per 32 codes (`vpmaddubsw`, then `vpmaddwd` with the
 * unit's scale). Here a group's superblock holds the same superblock of 8 rows, its codes
 * interleaved so that one 32-byte vector is 4 consecutive codes of each of the 8 rows: one
 * `vpdpbusd` (AVX512-VNNI / AVX-VNNI; `vpmaddubsw` + `vpmaddwd` on AVX2) with x's 4 bytes on
 * every lane adds 32 products into 8 outputs' sums, and a unit's scales multiply 8 outputs'
 * unit sums at once. Half the multiplies of the row layout, and the codes' unpacking shared by
 * the tile's rows of x.
 *
 * A group's superblock (rows o < 8 of the group; a group past the last row has zero rows):
 *   Q4_K, 1184 bytes: d[8], dmin[8] (float16) | scales [unit j][o] (6 bits, a byte each) |
 *     minimums [unit pair p][o][2] (unit 2p + e) | codes [j][k < 4][o][i < 4]: low nibble
 *     weight 32j + 4k + i of row o, high nibble weight 32j + 16 + 4k + i.
 *   Q5_K, 1440 bytes: Q4_K's, then fifth bits [j][o][i]: bit 2k the fifth of the low nibble
 *     of codes [j][k][o][i], bit 2k + 1 of its high nibble.
 *   Q6_K, 1680 bytes: d[8] (float16) | scales [unit j][o][2] (int8: the unit's first 16
 *     weights, its last 16) | per unit j, its low nibbles as Q4_K's codes [k][o][i], then its
 *     high crumbs [m < 2][o][i]: bits 4n..4n+1 the top of the low nibble of nibbles
 *     [2m + n][o][i], bits 4n+2..4n+3 of its high nibble.
 *
 * The arithmetic is the row kernels' (`gguf_int8.c`) to the bit: per superblock and output an
 * exact int32 sum of the units' scaled dots (less the minimums' term, or Q6_K's offset of 32),
 * then one float multiply-add by d dx (and one by -dmin dx). So a layout does not change a
 * result, nor does the build.
 */
#include <stdlib.h>
#include <string.h>

#include "gguf_blocks.h"
#include "gguf_int8.h"

/* Q6_K's unit j: its nibbles' vector k, its crumbs' vector m */
#define Q6_NIBBLES(j, k) (144 + 192 * (j) + 32 * (k))
#define Q6_CRUMBS(j, m) (144 + 192 * (j) + 128 + 32 * (m))

/* Where the build has AVX512-VNNI (and BW), Q4_K's and Q6_K's unit vectors are 512-bit: vector
 * p of unit j holds, per row o, its codes k = 2p and 2p + 1 side by side ([p][o][k % 2][i]),
 * so that one `vpdpbusd` over 64 bytes takes 8 bytes of x per row (twice the 256-bit
 * form's products a cycle on Zen 4); Q6_K's crumbs of unit j then are one 64-byte vector
 * [o][k % 2][i], bits 4p..4p+1 and 4p+2..4p+3 those of code k = 2p + k % 2. Q5_K keeps the
 * 256-bit arrangement everywhere. A build repacks for its own kernels. */
#if defined(INT8_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define X8_ZMM 1
#define CODE_AT(base, k, o, i) ((base) + 64 * ((k) / 2) + 8 * (o) + 4 * ((k) % 2) + (i))
#define CRUMB_AT(j, k, o, i) (Q6_CRUMBS(j, 0) + 8 * (o) + 4 * ((k) % 2) + (i))
#define CRUMB_SHIFT(k) (4 * ((k) / 2))
#else
#define X8_ZMM 0
#define CODE_AT(base, k, o, i) ((base) + 32 * (k) + 4 * (o) + (i))
#define CRUMB_AT(j, k, o, i) (Q6_CRUMBS(j, (k) / 2) + 4 * (o) + (i))
#define CRUMB_SHIFT(k) (4 * ((k) % 2))
#endif

/* ---- the repacking ---- */

/* values[256], the codes (0..63) of a file superblock of `type` (`gguf_int8.h`'s decoders, as
 * the row kernels read them), and scales[16] (Q4_K, Q5_K: the 8 units' in the first 8,
 * minimums in the next 8; Q6_K: the 16 halves', signed) */
static void superblock_codes(int type, const uint8_t *w, uint8_t *values, int8_t *scales) {
    for (int j = 0; j < 8; j++) {
        const codes c = type == GGUF_Q4_K   ? q4_k_codes(w, j)
                        : type == GGUF_Q5_K ? q5_k_codes(w, j)
                                            : q6_k_codes(w, j);
        codes_store(c, values + 32 * j);
    }
    if (type == GGUF_Q6_K) {
        memcpy(scales, w + 192, 16);
        return;
    }
    uint64_t sc, m;
    gguf_k_scale_words(w, &sc, &m);
    for (int j = 0; j < 8; j++) {
        scales[j] = (int8_t)(sc >> 8 * j);
        scales[8 + j] = (int8_t)(m >> 8 * j);
    }
}

int gguf_x8_bytes(int type) {
    return type == GGUF_Q4_K ? 1184 : type == GGUF_Q5_K ? 1440 : type == GGUF_Q6_K ? 1680 : 0;
}

/* superblock b of rows 8g.. (fewer than 8 past `outputs`: zeros) into out */
static void repack_superblock(int type, const uint8_t *w, int64_t w_stride, int64_t outputs,
                              int64_t g, int64_t b, uint8_t *out) {
    const int file_bytes = type == GGUF_Q4_K ? 144 : type == GGUF_Q5_K ? 176 : 210;
    uint8_t codes[8][QK_K];
    int8_t scales[8][16];
    memset(out, 0, (size_t)gguf_x8_bytes(type));
    memset(codes, 0, sizeof codes);
    memset(scales, 0, sizeof scales);
    for (int o = 0; o < 8 && 8 * g + o < outputs; o++) {
        const uint8_t *block = w + (8 * g + o) * w_stride + b * file_bytes;
        superblock_codes(type, block, codes[o], scales[o]);
        memcpy(out + 2 * o, block + (type == GGUF_Q6_K ? 208 : 0), 2);
        if (type != GGUF_Q6_K) memcpy(out + 16 + 2 * o, block + 2, 2);
    }
    const int k_type = type != GGUF_Q6_K;
    for (int o = 0; o < 8; o++) {
        for (int j = 0; j < 8; j++) {
            if (k_type) {
                out[32 + 8 * j + o] = (uint8_t)scales[o][j];
                out[96 + 16 * (j / 2) + 2 * o + j % 2] = (uint8_t)scales[o][8 + j];
            } else {
                out[16 + 16 * j + 2 * o] = (uint8_t)scales[o][2 * j];
                out[16 + 16 * j + 2 * o + 1] = (uint8_t)scales[o][2 * j + 1];
            }
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) {
                    const int low = codes[o][32 * j + 4 * k + i];
                    const int high = codes[o][32 * j + 16 + 4 * k + i];
                    const int base = k_type ? 160 + 128 * j : Q6_NIBBLES(j, 0);
                    const int at = type == GGUF_Q5_K ? base + 32 * k + 4 * o + i
                                                     : CODE_AT(base, k, o, i);
                    out[at] = (uint8_t)((low & 15) | (high & 15) << 4);
                    if (type == GGUF_Q5_K)
                        out[1184 + 32 * j + 4 * o + i] |=
                            (uint8_t)((low >> 4) << (2 * k) | (high >> 4) << (2 * k + 1));
                    if (type == GGUF_Q6_K)
                        out[CRUMB_AT(j, k, o, i)] |= (uint8_t)((low >> 4) << CRUMB_SHIFT(k) |
                                                               (high >> 4) << (CRUMB_SHIFT(k) + 2));
                }
        }
    }
}

/* `outputs` rows of `type` (cols whole superblocks, row r at w + r * w_stride) as x8 groups:
 * out [ceil(outputs / 8)][cols / 256][gguf_x8_bytes(type)]. Returns 0, or -1 for a type
 * without an x8 layout or cols not whole superblocks. */
int triode_gguf_repack_x8(int type, const uint8_t *w, int64_t w_stride, int64_t outputs,
                          int64_t cols, uint8_t *out) {
    const int bytes = gguf_x8_bytes(type);
    if (bytes == 0 || cols < QK_K || cols % QK_K || outputs < 1) return -1;
    const int64_t groups = (outputs + 7) / 8, blocks = cols / QK_K;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++)
            repack_superblock(type, w, w_stride, outputs, g, b, out + (g * blocks + b) * bytes);
    return 0;
}

/* ---- the product: a group's 8 outputs against rows r0..r0+mr-1 of x ---- */

#define INLINE static inline __attribute__((always_inline))

static inline int32_t word_at(const void *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef INT8_SIMD
/* acc + lane o: the dot of lane o's 4 codes (unsigned) with x's 4 bytes (signed) */
static inline __m256i dot4(__m256i acc, __m256i c, int32_t x4) {
    const __m256i x = _mm256_set1_epi32(x4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, c, x);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, c, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(c, x),
                                                   _mm256_set1_epi16(1)));
#endif
}
static inline __m256i pairs8(__m256i acc, __m256i a, int32_t pair) {
    return pairs_dot(acc, a, _mm256_set1_epi32(pair));
}
#define LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
/* each byte's bits from `from` on moved to bit 4 on, masked with `mask` (from < 8: a 16-bit
 * shift keeps every byte's bits its own once masked) */
static inline __m256i bits_to_4(__m256i v, int from, int mask) {
    const __m256i moved = from <= 4 ? _mm256_slli_epi16(v, 4 - from) : _mm256_srli_epi16(v, from - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)mask));
}

/* a Q4_K or Q5_K superblock b's float step for row `row` of x, its 8 outputs' integer sums
 * `sum`: acc + d dx sum - dmin dx (the minimums . x's unit sums) */
static inline __m256 k_superblock(__m256 acc, __m256i sum, const uint8_t *w, const qx *k,
                                  int64_t row, int64_t b) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 16)));
    const int16_t *u = k->u + row * (k->cols / UNIT) + 8 * b;
    __m256i mins = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++)
        mins = pairs8(mins, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + 96 + 16 * p))),
                      word_at(u + 2 * p));
    const __m256 dx = _mm256_set1_ps(k->dx[row * (k->cols / QK_K) + b]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, dx), acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, dx), acc);
}
/* a Q6_K superblock's float step: acc + d dx (sum - 32 offset) */
static inline __m256 q6_superblock(__m256 acc, __m256i sum, __m256i offset, __m256 d, float dx) {
    const __m256i total = _mm256_sub_epi32(sum, _mm256_slli_epi32(offset, 5));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
}

/* Q4_K and Q5_K (`five`) */
INLINE void k_x8(const uint8_t *w, const int five, const qx *k, int64_t r0, float *out,
                 const int mr) {
    const int64_t blocks = k->cols / QK_K, bytes = five ? 1440 : 1184;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[X8_TILE];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += bytes) {
        const uint8_t *nibbles = w + 160;
        __m256i sum[X8_TILE];
        for (int r = 0; r < mr; r++) sum[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i scale =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 32 + 8 * j)));
            const __m256i fifth = five ? LOAD(w + 1184 + 32 * j) : _mm256_setzero_si256();
            __m256i unit[X8_TILE];
            for (int r = 0; r < mr; r++) unit[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; kk++) {
                const __m256i raw = LOAD(nibbles + 128 * j + 32 * kk);
                __m256i lo = _mm256_and_si256(raw, low4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                if (five) {
                    lo = _mm256_or_si256(lo, bits_to_4(fifth, 2 * kk, 0x10));
                    hi = _mm256_or_si256(hi, bits_to_4(fifth, 2 * kk + 1, 0x10));
                }
                for (int r = 0; r < mr; r++) {
                    const int8_t *q = k->q + (r0 + r) * k->cols + b * QK_K + 32 * j + 4 * kk;
                    unit[r] = dot4(dot4(unit[r], lo, word_at(q)), hi, word_at(q + 16));
                }
            }
            for (int r = 0; r < mr; r++)
                sum[r] = _mm256_add_epi32(sum[r], _mm256_mullo_epi32(unit[r], scale));
        }
        for (int r = 0; r < mr; r++) acc[r] = k_superblock(acc[r], sum[r], w, k, r0 + r, b);
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

INLINE void q6_k_x8_rows(const uint8_t *w, const qx *k, int64_t r0, float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    const __m256i low4 = _mm256_set1_epi8(15);
    __m256 acc[X8_TILE];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += 1680) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        __m256i sum[X8_TILE], offset[X8_TILE];
        for (int r = 0; r < mr; r++) sum[r] = offset[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i pair =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 + 16 * j)));
            const __m256i first = _mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16);
            const __m256i last = _mm256_srai_epi32(pair, 16);
            __m256i lows[X8_TILE], highs[X8_TILE];
            for (int r = 0; r < mr; r++) lows[r] = highs[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; kk++) {
                const __m256i raw = LOAD(w + Q6_NIBBLES(j, kk));
                const __m256i crumbs = LOAD(w + Q6_CRUMBS(j, kk / 2));
                const int n = kk % 2;
                const __m256i lo =
                    _mm256_or_si256(_mm256_and_si256(raw, low4), bits_to_4(crumbs, 4 * n, 0x30));
                const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                                   bits_to_4(crumbs, 4 * n + 2, 0x30));
                for (int r = 0; r < mr; r++) {
                    const int8_t *q = k->q + (r0 + r) * k->cols + b * QK_K + 32 * j + 4 * kk;
                    lows[r] = dot4(lows[r], lo, word_at(q));
                    highs[r] = dot4(highs[r], hi, word_at(q + 16));
                }
            }
            for (int r = 0; r < mr; r++) {
                const int16_t *s = k->s + (r0 + r) * (k->cols / 16) + 16 * b + 2 * j;
                sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_mullo_epi32(lows[r], first),
                                                                   _mm256_mullo_epi32(highs[r], last)));
                offset[r] = pairs8(offset[r], pair, word_at(s));
            }
        }
        for (int r = 0; r < mr; r++)
            acc[r] = q6_superblock(acc[r], sum[r], offset[r], d, k->dx[(r0 + r) * blocks + b]);
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#if X8_ZMM
static inline int64_t qword_at(const void *p) {
    int64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* lanes 2o and 2o + 1 of a 512-bit sum (row o's codes 2p and 2p + 1) added: row o's sum */
static inline __m256i lane_pairs(__m512i v) {
    return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32)));
}
/* 8 int32 each on two lanes (2o, 2o + 1) */
static inline __m512i twice(__m256i v) {
    const __m512i order = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    return _mm512_permutexvar_epi32(order, _mm512_castsi256_si512(v));
}
static inline __m512i bits_to_4z(__m512i v, int from, int mask) {
    const __m512i moved = from <= 4 ? _mm512_slli_epi16(v, 4 - from) : _mm512_srli_epi16(v, from - 4);
    return _mm512_and_si512(moved, _mm512_set1_epi8((char)mask));
}

INLINE void q4_k_x8z_rows(const uint8_t *w, const qx *k, int64_t r0, float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m256 acc[X8_TILE];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += 1184) {
        __m512i sum[X8_TILE];
        for (int r = 0; r < mr; r++) sum[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {
            const __m512i scale =
                twice(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + 32 + 8 * j))));
            __m512i unit[X8_TILE];
            for (int r = 0; r < mr; r++) unit[r] = _mm512_setzero_si512();
            for (int p = 0; p < 2; p++) {
                const __m512i raw = _mm512_loadu_si512(w + 160 + 128 * j + 64 * p);
                const __m512i lo = _mm512_and_si512(raw, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                for (int r = 0; r < mr; r++) {
                    const int8_t *q = k->q + (r0 + r) * k->cols + b * QK_K + 32 * j + 8 * p;
                    unit[r] = _mm512_dpbusd_epi32(unit[r], lo, _mm512_set1_epi64(qword_at(q)));
                    unit[r] = _mm512_dpbusd_epi32(unit[r], hi, _mm512_set1_epi64(qword_at(q + 16)));
                }
            }
            for (int r = 0; r < mr; r++)
                sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(unit[r], scale));
        }
        for (int r = 0; r < mr; r++)
            acc[r] = k_superblock(acc[r], lane_pairs(sum[r]), w, k, r0 + r, b);
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

INLINE void q6_k_x8z_rows(const uint8_t *w, const qx *k, int64_t r0, float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    const __m512i low4 = _mm512_set1_epi8(15);
    __m256 acc[X8_TILE];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, w += 1680) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)w));
        __m512i sum[X8_TILE];
        __m256i offset[X8_TILE];
        for (int r = 0; r < mr; r++) sum[r] = _mm512_setzero_si512(), offset[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i pair =
                _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16 + 16 * j)));
            const __m512i first = twice(_mm256_srai_epi32(_mm256_slli_epi32(pair, 16), 16));
            const __m512i last = twice(_mm256_srai_epi32(pair, 16));
            const __m512i crumbs = _mm512_loadu_si512(w + Q6_CRUMBS(j, 0));
            __m512i lows[X8_TILE], highs[X8_TILE];
            for (int r = 0; r < mr; r++) lows[r] = highs[r] = _mm512_setzero_si512();
            for (int p = 0; p < 2; p++) {
                const __m512i raw = _mm512_loadu_si512(w + Q6_NIBBLES(j, 0) + 64 * p);
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, low4),
                                                   bits_to_4z(crumbs, 4 * p, 0x30));
                const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low4),
                                                   bits_to_4z(crumbs, 4 * p + 2, 0x30));
                for (int r = 0; r < mr; r++) {
                    const int8_t *q = k->q + (r0 + r) * k->cols + b * QK_K + 32 * j + 8 * p;
                    lows[r] = _mm512_dpbusd_epi32(lows[r], lo, _mm512_set1_epi64(qword_at(q)));
                    highs[r] = _mm512_dpbusd_epi32(highs[r], hi, _mm512_set1_epi64(qword_at(q + 16)));
                }
            }
            for (int r = 0; r < mr; r++) {
                const int16_t *s = k->s + (r0 + r) * (k->cols / 16) + 16 * b + 2 * j;
                sum[r] = _mm512_add_epi32(sum[r], _mm512_add_epi32(_mm512_mullo_epi32(lows[r], first),
                                                                   _mm512_mullo_epi32(highs[r], last)));
                offset[r] = pairs8(offset[r], pair, word_at(s));
            }
        }
        for (int r = 0; r < mr; r++)
            acc[r] = q6_superblock(acc[r], lane_pairs(sum[r]), offset[r], d,
                                   k->dx[(r0 + r) * blocks + b]);
    }
    for (int r = 0; r < mr; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}
#endif
#else
/* the same integers and float operations, output by output */
INLINE void k_x8(const uint8_t *w, const int five, const qx *k, int64_t r0, float *out,
                 const int mr) {
    const int64_t blocks = k->cols / QK_K, bytes = five ? 1440 : 1184;
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < 8; o++) out[8 * r + o] = 0.0f;
    for (int64_t b = 0; b < blocks; b++, w += bytes)
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const int8_t *q = k->q + row * k->cols + b * QK_K;
            const int16_t *u = k->u + row * (k->cols / UNIT) + 8 * b;
            const float dx = k->dx[row * blocks + b];
            for (int o = 0; o < 8; o++) {
                int32_t sum = 0, mins = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t unit = 0;
                    for (int kk = 0; kk < 4; kk++)
                        for (int i = 0; i < 4; i++) {
                            const int byte = w[160 + 128 * j + 32 * kk + 4 * o + i];
                            int lo = byte & 15, hi = byte >> 4;
                            if (five) {
                                const int f = w[1184 + 32 * j + 4 * o + i];
                                lo |= ((f >> (2 * kk)) & 1) << 4;
                                hi |= ((f >> (2 * kk + 1)) & 1) << 4;
                            }
                            unit += lo * q[32 * j + 4 * kk + i] + hi * q[32 * j + 16 + 4 * kk + i];
                        }
                    sum += unit * w[32 + 8 * j + o];
                    mins += w[96 + 16 * (j / 2) + 2 * o + j % 2] * u[j];
                }
                const float v = out[8 * r + o];
                const float t = __builtin_fmaf((float)sum, half_at(w + 2 * o) * dx, v);
                out[8 * r + o] = __builtin_fmaf(-(float)mins, half_at(w + 16 + 2 * o) * dx, t);
            }
        }
}

INLINE void q6_k_x8_rows(const uint8_t *w, const qx *k, int64_t r0, float *out, const int mr) {
    const int64_t blocks = k->cols / QK_K;
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < 8; o++) out[8 * r + o] = 0.0f;
    for (int64_t b = 0; b < blocks; b++, w += 1680)
        for (int r = 0; r < mr; r++) {
            const int64_t row = r0 + r;
            const int8_t *q = k->q + row * k->cols + b * QK_K;
            const int16_t *s = k->s + row * (k->cols / 16) + 16 * b;
            const float dx = k->dx[row * blocks + b];
            for (int o = 0; o < 8; o++) {
                int32_t sum = 0, offset = 0;
                for (int j = 0; j < 8; j++) {
                    int32_t lows = 0, highs = 0;
                    for (int kk = 0; kk < 4; kk++)
                        for (int i = 0; i < 4; i++) {
                            const int byte = w[Q6_NIBBLES(j, kk) + 4 * o + i];
                            const int crumbs = w[Q6_CRUMBS(j, kk / 2) + 4 * o + i];
                            const int n = kk % 2;
                            const int lo = (byte & 15) | ((crumbs >> (4 * n)) & 3) << 4;
                            const int hi = (byte >> 4) | ((crumbs >> (4 * n + 2)) & 3) << 4;
                            lows += lo * q[32 * j + 4 * kk + i];
                            highs += hi * q[32 * j + 16 + 4 * kk + i];
                        }
                    const int first = (int8_t)w[16 + 16 * j + 2 * o];
                    const int last = (int8_t)w[16 + 16 * j + 2 * o + 1];
                    sum += lows * first + highs * last;
                    offset += first * s[2 * j] + last * s[2 * j + 1];
                }
                out[8 * r + o] =
                    __builtin_fmaf((float)(sum - 32 * offset), half_at(w + 2 * o) * dx, out[8 * r + o]);
            }
        }
}
#endif

#define BY_ROWS(name, ...)                                                                    \
    switch (mr) {                                                                             \
    case 1: name(__VA_ARGS__, 1); break;                                                      \
    case 2: name(__VA_ARGS__, 2); break;                                                      \
    case 3: name(__VA_ARGS__, 3); break;                                                      \
    case 4: name(__VA_ARGS__, 4); break;                                                      \
    TILE_8(name, __VA_ARGS__)                                                                 \
    }
#if X8_TILE == 8
#define TILE_8(name, ...)                                                                     \
    case 5: name(__VA_ARGS__, 5); break;                                                      \
    case 6: name(__VA_ARGS__, 6); break;                                                      \
    case 7: name(__VA_ARGS__, 7); break;                                                      \
    default: name(__VA_ARGS__, 8); break;
#else
#define TILE_8(name, ...)
#endif

static void q4_k_x8(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
#if X8_ZMM
    BY_ROWS(q4_k_x8z_rows, w, k, r0, out)
#else
    BY_ROWS(k_x8, w, 0, k, r0, out)
#endif
}
static void q5_k_x8(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
    BY_ROWS(k_x8, w, 1, k, r0, out)
}
static void q6_k_x8(const uint8_t *w, const qx *k, int64_t r0, int mr, float *out) {
#if X8_ZMM
    BY_ROWS(q6_k_x8z_rows, w, k, r0, out)
#else
    BY_ROWS(q6_k_x8_rows, w, k, r0, out)
#endif
}

x8_kernel gguf_x8_kernel(int type) {
    if (type == GGUF_X8 + GGUF_Q4_K) return q4_k_x8;
    if (type == GGUF_X8 + GGUF_Q5_K) return q5_k_x8;
    if (type == GGUF_X8 + GGUF_Q6_K) return q6_k_x8;
    return NULL;
}
