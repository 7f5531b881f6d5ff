/* `quant_matmul.c`'s product for bfloat16 rows on CPUs with AVX512-BF16: 4-bit and 8-bit codes
 * widen to bfloat16 (exact: 0..15, -128..127) and `vdpbf16ps` takes two inputs a lane per
 * instruction, where the float32 path widens each code to a float and takes one. A bfloat16 x
 * times a bfloat16 code is exact in float32, so per group of 32 inputs the dot products are
 * float32 sums of the same exact terms as the float32 path's, added in pairs (odd input, then
 * even) in one fixed order; the group's constants then apply as there. Every row count takes
 * the same instructions in the same order, so a row's result does not depend on the rows
 * beside it.
 *
 * The codes arrive paired (`quant_matmul.QuantRows`): per block of NR = 32 outputs and group,
 * the 32 float16 scales, (4-bit) the 32 minimums, then per pair of inputs (2p, 2p + 1): (4-bit)
 * 32 bytes, byte 2j holding input 2p's codes of outputs j (low nibble) and 16 + j (high
 * nibble), byte 2j + 1 input 2p + 1's; (8-bit) 64 int8 codes, 2j and 2j + 1 output j's. Either
 * way one load widens to 16 lanes of (input 2p, input 2p + 1) pairs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "group_sum.h"
#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "simd.h"

#define LANES 16
#define NR 32
#define GROUP 32
#define PAIRS (GROUP / 2)
#define MAX_ROWS 64
#define MR_DIRECT 8
#define MR_TILE 7 /* 7 rows x 2 x (sums, dot products) + 2 codes + x: 31 of 32 registers */
#define CHUNK_GROUPS 4 /* groups widened at a time by the tiled path */

/* bytes of one block's group: constants, then codes */
static inline int64_t group_bytes(int bits) {
    return bits == 4 ? NR * 2 * 2 + GROUP * LANES : NR * 2 + GROUP * NR;
}

int triode_quant_paired_available(void) { return 1; }

/* bfloat16 0..15, indexed by a code */
static const uint16_t CODE_VALUES[32] = {
    0x0, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
};

typedef struct {
    __m512 scale[2], minimum[2];
} constants;

static inline constants load_constants(const uint8_t *group, int bits) {
    const uint16_t *half = (const uint16_t *)group;
    constants c;
    for (int h = 0; h < 2; h++) {
        c.scale[h] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + h * LANES)));
        c.minimum[h] = bits == 4 ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                       (const __m256i *)(half + NR + h * LANES)))
                                 : _mm512_setzero_ps();
    }
    return c;
}

/* 16 int8 codes as float32 */
static inline __m512 int8_floats(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* pair p's codes as bfloat16 pairs: outputs 0..15 in q[0], 16..31 in q[1] */
static inline __attribute__((always_inline)) void pair_codes(const uint8_t *group, int p,
                                                             int bits, __m512i table,
                                                             __m512i q[2]) {
    if (bits == 4) {
        const __m256i bytes =
            _mm256_loadu_si256((const __m256i *)(group + NR * 4 + p * 2 * LANES));
        const __m512i words = _mm512_cvtepu8_epi16(bytes);
        q[0] = _mm512_permutexvar_epi16(_mm512_and_si512(words, _mm512_set1_epi16(15)), table);
        q[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
    } else {
        const uint8_t *codes = group + NR * 2 + p * 2 * NR;
        for (int h = 0; h < 2; h++) /* words 0..15 from the first 16 codes, 16..31 the next */
            q[h] = (__m512i)_mm512_cvtne2ps_pbh(int8_floats(codes + h * NR + LANES),
                                                 int8_floats(codes + h * NR));
    }
}

/* inputs 2p and 2p + 1 of a bfloat16 row, in every lane */
static inline __m512bh x_pair(const uint16_t *x, int p) {
    int32_t both;
    memcpy(&both, x + 2 * p, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
}

static inline __m512 dot_pair(__m512 sum, __m512i codes, __m512bh x) {
    return _mm512_dpbf16_ps(sum, (__m512bh)codes, x);
}

/* sum + scale[h] x dot + minimum[h] x xsum: a group's terms in half h of a block's outputs, in
 * `quant_matmul.c`'s order (both paths take them from here, so they give the same bits) */
static inline __m512 group_terms(__m512 sum, const constants *c, int h, __m512 dot, float xsum,
                                 int bits) {
    sum = _mm512_fmadd_ps(c->scale[h], dot, sum);
    return bits == 4 ? _mm512_fmadd_ps(c->minimum[h], _mm512_set1_ps(xsum), sum) : sum;
}

/* sums[h] += a group's terms, as `quant_matmul.c`'s add_group */
static inline __attribute__((always_inline)) void add_group(float *sums, const constants *c,
                                                            const __m512 dot[2], float xsum,
                                                            int bits) {
    for (int h = 0; h < 2; h++)
        _mm512_storeu_ps(sums + h * LANES, group_terms(_mm512_loadu_ps(sums + h * LANES), c, h,
                                                       dot[h], xsum, bits));
}

/* rows 0..mr-1 against `span` blocks, each code from memory into registers once for all rows;
 * block s's sums land in tile rows s * MAX_ROWS + r */
static inline __attribute__((always_inline)) void blocks_direct(
    const uint16_t *x, int64_t x_stride, const float *xsums, int64_t groups,
    const uint8_t *block, int64_t block_bytes, int bits, float *tile, const int mr,
    const int span) {
    const __m512i table = _mm512_loadu_si512(CODE_VALUES);
    const int64_t stride = group_bytes(bits);
    for (int s = 0; s < span; s++) memset(tile + s * MAX_ROWS * NR, 0, sizeof(float) * mr * NR);
    for (int64_t g = 0; g < groups; g++) {
        __m512 dot[4][MR_DIRECT][2];
        for (int s = 0; s < span; s++)
            for (int r = 0; r < mr; r++) dot[s][r][0] = dot[s][r][1] = _mm512_setzero_ps();
        for (int p = 0; p < PAIRS; p++)
            for (int s = 0; s < span; s++) {
                __m512i q[2];
                pair_codes(block + s * block_bytes + g * stride, p, bits, table, q);
                for (int r = 0; r < mr; r++) {
                    const __m512bh xb = x_pair(x + r * x_stride + g * GROUP, p);
                    dot[s][r][0] = dot_pair(dot[s][r][0], q[0], xb);
                    dot[s][r][1] = dot_pair(dot[s][r][1], q[1], xb);
                }
            }
        for (int s = 0; s < span; s++) {
            const constants c = load_constants(block + s * block_bytes + g * stride, bits);
            for (int r = 0; r < mr; r++)
                add_group(tile + (s * MAX_ROWS + r) * NR, &c, dot[s][r], xsums[r * groups + g],
                          bits);
        }
    }
}

/* tile rows 0..mr-1 += groups 0..n-1 of a chunk, their codes widened in `q` [n][PAIRS][2][NR]
 * words: each row's sums stay in registers over the chunk (`group_terms`, as add_group) */
static inline __attribute__((always_inline)) void tile_chunk(const uint32_t *xt,
                                                             const float *xsums, int64_t groups,
                                                             const uint16_t *q,
                                                             const constants *c, int n,
                                                             int bits, float *tile, const int mr) {
    __m512 sum[MR_TILE][2];
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) sum[r][h] = _mm512_loadu_ps(tile + r * NR + h * LANES);
#pragma GCC unroll 1 /* unrolled, every group's constants would take registers the codes need */
    for (int g = 0; g < n; g++) {
        __m512 dot[MR_TILE][2];
        for (int r = 0; r < mr; r++) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
        const uint16_t *qg = q + g * PAIRS * 2 * NR;
        for (int p = 0; p < PAIRS; p++) {
            const __m512i q0 = _mm512_load_si512(qg + p * 2 * NR);
            const __m512i q1 = _mm512_load_si512(qg + p * 2 * NR + NR);
            for (int r = 0; r < mr; r++) {
                const __m512bh xb =
                    (__m512bh)_mm512_set1_epi32((int32_t)xt[(g * PAIRS + p) * mr + r]);
                dot[r][0] = dot_pair(dot[r][0], q0, xb);
                dot[r][1] = dot_pair(dot[r][1], q1, xb);
            }
        }
        for (int r = 0; r < mr; r++)
            for (int h = 0; h < 2; h++)
                sum[r][h] =
                    group_terms(sum[r][h], &c[g], h, dot[r][h], xsums[r * groups + g], bits);
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++) _mm512_storeu_ps(tile + r * NR + h * LANES, sum[r][h]);
}

static void tile_rows(const uint32_t *xt, const float *xsums, int64_t groups, const uint16_t *q,
                      const constants *c, int n, int bits, float *tile, int mr) {
    switch (mr) {
#define TILE_CASE(m) \
    case m:          \
        tile_chunk(xt, xsums, groups, q, c, n, bits, tile, m); break;
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7)
#undef TILE_CASE
    }
}

/* the tiled path's tiles of rows: as few as hold MR_TILE rows at most, their sizes as even as
 * can be; tile t starts at row tile_row(rows, tiles, t) */
static inline int row_tiles(int64_t rows) { return (int)((rows + MR_TILE - 1) / MR_TILE); }
static inline int64_t tile_row(int64_t rows, int tiles, int t) { return rows * t / tiles; }

/* rows 0..mr-1 of x as one tile's pairs: per group and pair p, each row's inputs (2p, 2p + 1)
 * side by side, so that the tile's broadcasts walk one run of memory */
static void pack_tile(const uint16_t *x, int64_t x_stride, int64_t groups, int mr, uint32_t *xt) {
    for (int64_t k = 0; k < groups * PAIRS; k++)
        for (int r = 0; r < mr; r++) memcpy(xt + k * mr + r, x + r * x_stride + 2 * k, 4);
}

/* room for MAX_ROWS rows of `cols` packed: one buffer per calling thread (the engine calls from
 * one), kept for the next call and grown when a wider x comes; NULL when out of memory */
static uint32_t *packing_buffer(int64_t cols) {
    static _Thread_local uint32_t *buffer = NULL;
    static _Thread_local size_t size = 0;
    const size_t need = (size_t)MAX_ROWS * cols * sizeof(uint16_t);
    if (need > size) {
        free(buffer);
        buffer = aligned_alloc(64, need);
        size = buffer ? need : 0;
    }
    return buffer;
}

/* more rows than the registers hold: a few groups' codes widened to bfloat16 in L1 once, then
 * each tile of rows (packed by `pack_tile`) over those groups */
static void block_tiled(const uint32_t *xp, const float *xsums, int64_t rows, int64_t groups,
                        const uint8_t *block, int bits, float *tile) {
    uint16_t q[CHUNK_GROUPS * PAIRS * 2 * NR] __attribute__((aligned(64)));
    constants c[CHUNK_GROUPS];
    const __m512i table = _mm512_loadu_si512(CODE_VALUES);
    memset(tile, 0, sizeof(float) * rows * NR);
    for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
        const int n = groups - g0 < CHUNK_GROUPS ? (int)(groups - g0) : CHUNK_GROUPS;
        for (int g = 0; g < n; g++) {
            const uint8_t *group = block + (g0 + g) * group_bytes(bits);
            c[g] = load_constants(group, bits);
            for (int p = 0; p < PAIRS; p++) {
                __m512i pair[2];
                pair_codes(group, p, bits, table, pair);
                _mm512_store_si512(q + ((g * PAIRS + p) * 2) * NR, pair[0]);
                _mm512_store_si512(q + ((g * PAIRS + p) * 2 + 1) * NR, pair[1]);
            }
        }
        for (int t = 0, tiles = row_tiles(rows); t < tiles; t++) {
            const int64_t r = tile_row(rows, tiles, t);
            const int mr = (int)(tile_row(rows, tiles, t + 1) - r);
            tile_rows(xp + r * groups * PAIRS + g0 * PAIRS * mr, xsums + r * groups + g0, groups,
                      q, c, n, bits, tile + r * NR, mr);
        }
    }
}

static inline int span_for(int64_t rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

static void blocks_rows(const uint16_t *x, int64_t x_stride, const uint32_t *xp,
                        const float *xsums, int64_t rows, int64_t groups, const uint8_t *block,
                        int64_t block_bytes, int bits, float *tile, int n) {
    if (rows <= 2 && n == span_for(rows)) {
        if (rows == 1)
            blocks_direct(x, x_stride, xsums, groups, block, block_bytes, bits, tile, 1, 4);
        else
            blocks_direct(x, x_stride, xsums, groups, block, block_bytes, bits, tile, 2, 2);
        return;
    }
    for (int s = 0; s < n; s++, block += block_bytes, tile += MAX_ROWS * NR) {
        switch (rows) {
#define DIRECT_CASE(m) \
    case m:            \
        blocks_direct(x, x_stride, xsums, groups, block, block_bytes, bits, tile, m, 1); break;
            DIRECT_CASE(1) DIRECT_CASE(2) DIRECT_CASE(3) DIRECT_CASE(4)
            DIRECT_CASE(5) DIRECT_CASE(6) DIRECT_CASE(7) DIRECT_CASE(8)
#undef DIRECT_CASE
        default: block_tiled(xp, xsums, rows, groups, block, bits, tile);
        }
    }
}

/* rows first..last-1 of x's sums per group */
static void sum_rows(const uint16_t *x, int64_t x_stride, int64_t first, int64_t last,
                     int64_t groups, float *xsums) {
    for (int64_t r = first; r < last; r++)
        for (int64_t g = 0; g < groups; g++)
            xsums[r * groups + g] = group_sum_bf16(x + r * x_stride + g * GROUP);
}

/* y's columns of a block, rounded to bfloat16: rows of `width` <= NR sums (+ bias) */
static void store_rows(const float *sums, int64_t rows, int width, const float *bias, uint16_t *y,
                       int64_t y_stride) {
    for (int64_t r = 0; r < rows; r++, sums += NR, y += y_stride) {
        if (width == NR) {
            for (int h = 0; h < 2; h++) {
                __m512 v = _mm512_loadu_ps(sums + h * LANES);
                if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + h * LANES));
                bf16x16_store(y + h * LANES, v);
            }
        } else {
            for (int j = 0; j < width; j++) y[j] = f32_bf16(bias ? sums[j] + bias[j] : sums[j]);
        }
    }
}

/* y [rows, outputs] bfloat16 (row stride y_stride) = x [rows, cols] bfloat16 (x_stride) times
 * the paired 4- or 8-bit W^T, + bias (float32, or NULL); `xsums` [rows, cols / 32]: room for
 * each row's float32 sum per group, which it fills. Returns 0, or -1 for arguments it does not
 * take. */
int triode_quant_paired_rows(const uint16_t *x, int64_t x_stride, float *xsums,
                             int64_t rows, int64_t cols, const uint8_t *w, int bits,
                             const float *bias, int64_t outputs, uint16_t *y, int64_t y_stride) {
    if (rows < 1 || rows > MAX_ROWS || cols < GROUP || cols % GROUP || outputs < 1 ||
        (bits != 4 && bits != 8))
        return -1;
    const int64_t groups = cols / GROUP, blocks = (outputs + NR - 1) / NR;
    const int64_t block_bytes = groups * group_bytes(bits);
    const int span = span_for(rows);
    uint32_t *xp = NULL; /* x's pairs tile by tile, for the tiled path */
    if (rows > MR_DIRECT && !(xp = packing_buffer(cols))) return -1;
    if (!xp) sum_rows(x, x_stride, 0, rows, groups, xsums); /* few: not worth a barrier */
    const int tiles = row_tiles(rows);
#pragma omp parallel
    {
        if (xp) {
#pragma omp for nowait
            for (int64_t r = 0; r < rows; r++) sum_rows(x, x_stride, r, r + 1, groups, xsums);
#pragma omp for
            for (int t = 0; t < tiles; t++) {
                const int64_t r = tile_row(rows, tiles, t);
                const int mr = (int)(tile_row(rows, tiles, t + 1) - r);
                pack_tile(x + r * x_stride, x_stride, groups, mr, xp + r * groups * PAIRS);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t first_block = 0; first_block < blocks; first_block += span) {
            float tile[4 * MAX_ROWS * NR] __attribute__((aligned(64)));
            const int n = blocks - first_block < span ? (int)(blocks - first_block) : span;
            blocks_rows(x, x_stride, xp, xsums, rows, groups, w + first_block * block_bytes,
                        block_bytes, bits, tile, n);
            for (int s = 0; s < n; s++) {
                const int64_t first = (first_block + s) * NR;
                const int width = outputs - first < NR ? (int)(outputs - first) : NR;
                store_rows(tile + s * MAX_ROWS * NR, rows, width, bias ? bias + first : NULL,
                           y + first, y_stride);
            }
        }
    }
    return 0;
}

#else

int triode_quant_paired_available(void) { return 0; }

int triode_quant_paired_rows(const uint16_t *x, int64_t x_stride, float *xsums,
                             int64_t rows, int64_t cols, const uint8_t *w, int bits,
                             const float *bias, int64_t outputs, uint16_t *y, int64_t y_stride) {
    (void)x, (void)x_stride, (void)xsums, (void)rows, (void)cols, (void)w, (void)bits, (void)bias;
    (void)outputs, (void)y, (void)y_stride;
    return -1;
}

#endif
