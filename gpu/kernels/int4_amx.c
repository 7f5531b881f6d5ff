/* y = x W^T with W in GGUF's 4-bit blocks, on Intel AMX: the weights stream from memory at a
 * quarter of the bytes of bfloat16 ones and are widened in cache, 16 outputs by 32 inputs at a
 * time, into the bfloat16 values the dense path holds, for every row of x.
 *
 * W arrives packed for this kernel (`int4.py`): for each block of 16 outputs and each group of
 * 32 inputs, 256 bytes of codes, byte [r / 4][l][r % 4] holding the codes of input 2r + l % 2
 * for outputs l / 2 (low nibble) and 8 + l / 2 (high nibble), and 16 scales and 16 minimums
 * in float16 (GGUF's own, exactly). A weight is
 * scale * code + minimum in float32, then rounded to bfloat16 (nearest, ties to even): the
 * same arithmetic, and so the same bits, as the dense bfloat16 weights the checkpoint
 * dequantizes to. Rows of 16 outputs x 32 inputs in bfloat16 pairs are the B operand of
 * TDPBF16PS as they stand; 16 rows of x the A operand; sums are float32.
 *
 * Work is split by blocks of outputs over torch's OpenMP threads, two blocks at a time to
 * whichever thread is free (one that another process holds up delays little); each thread
 * configures and releases its own tiles. Built with the other CPU kernels by `cpu_kernels.py`; where the
 * compiler's target has no AMX, `triode_int4_amx_available` says 0.
 */
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "simd.h"
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 once the kernel asked the kernel for AMX's tile state (every thread may then use it) */
int triode_int4_amx_available(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tiles 0-3: sums for up to 4 blocks of 16 rows; 4 and 7: 16 rows of x; 5: the weights; 6:
 * the last rows of x when fewer than 16 (the tile intrinsics take literal numbers) */
#define A_TILE 4
#define A_NEXT 7
#define B_TILE 5
#define A_TAIL 6
#define MAX_BLOCKS 4
/* rows whose x stays in L2 while every block of outputs passes over them: past this many the
 * weights are widened again rather than x read again from memory */
#define SPAN 256
/* groups ahead whose codes are fetched while this one widens (a prefetch never faults: those
 * of the last groups run past the end harmlessly) */
#define PREFETCH 8

/* the group's 16 x 32 weights as TDPBF16PS's B operand: 16 rows (input pairs) of 16 outputs.
 * Codes come 64 bytes per 4 rows: 32-bit lane l holds, for rows 4q .. 4q + 3, a byte each whose
 * low nibble is the code of output l / 2, input 2r + l % 2, and whose high nibble that of output
 * 8 + l / 2 (`int4.py` packs them so). A row's codes are then a shift away; their float32 values
 * a permute of 0 .. 15 (which reads only an index's low 4 bits); scale * code + minimum one
 * fused multiply-add (the product of a float16 scale and a code below 16 is exact in float32,
 * so this rounds as the dense path's multiply, then add); and one conversion rounds the row's
 * 32 weights to bfloat16 (nearest, ties to even; weights are never subnormal) in exactly the
 * pair order of the B operand. */
static inline void widen(const uint8_t *codes, const uint16_t *scale, const uint16_t *minimum,
                         uint16_t *b) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scale));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)minimum));
    const __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 d_low = _mm512_permutexvar_ps(first, d), d_high = _mm512_permutexvar_ps(second, d);
    const __m512 m_low = _mm512_permutexvar_ps(first, m), m_high = _mm512_permutexvar_ps(second, m);
    const __m512 codes_f32 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int q = 0; q < 4; q++) {
        const __m512i four = _mm512_loadu_si512((const void *)(codes + 64 * q));
        for (int j = 0; j < 4; j++) {
            const __m512i v = _mm512_srli_epi32(four, 8 * j);
            const __m512 low = _mm512_permutexvar_ps(v, codes_f32);
            const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), codes_f32);
            const __m512 w_low = _mm512_fmadd_ps(d_low, low, m_low);
            const __m512 w_high = _mm512_fmadd_ps(d_high, high, m_high);
            _mm512_store_si512((void *)(b + 32 * (4 * q + j)), (__m512i)_mm512_cvtne2ps_pbh(w_high, w_low));
        }
    }
}

/* group t of the codes widened into b, the codes PREFETCH groups on fetched meanwhile */
static inline void widen_group(const uint8_t *codes, const uint16_t *scales,
                               const uint16_t *minimums, int64_t t, uint16_t *b) {
    const uint8_t *ahead = codes + (t + PREFETCH) * 256;
    for (int line = 0; line < 256; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
    _mm_prefetch((const char *)(scales + (t + PREFETCH) * 16), _MM_HINT_T0);
    _mm_prefetch((const char *)(minimums + (t + PREFETCH) * 16), _MM_HINT_T0);
    widen(codes + t * 256, scales + t * 16, minimums + t * 16, b);
}

#define LOAD_DP(i, A)                                                                         \
    do {                                                                                      \
        if ((i) < full) {                                                                     \
            _tile_loadd(A, a + (i) * 16 * x_stride, x_stride * 2);                           \
            _tile_dpbf16ps(i, A, B_TILE);                                                     \
        } else if ((i) == full && tail) {                                                     \
            _tile_loadd(A_TAIL, a + (i) * 16 * x_stride, x_stride * 2);                       \
            _tile_dpbf16ps(i, A_TAIL, B_TILE);                                                \
        }                                                                                     \
    } while (0)

#define STORE(i)                                                                              \
    do {                                                                                      \
        if ((i) < blocks) _tile_stored(i, sums[i], 64);                                       \
    } while (0)

/* the tile shapes for a pass over `here` rows (1 .. 64) */
static void configure(tile_config *config, int64_t here) {
    const int full = (int)(here / 16), tail = (int)(here % 16);
    memset(config, 0, sizeof *config);
    config->palette_id = 1;
    for (int i = 0; i < full + (tail > 0); i++) {
        config->rows[i] = i < full ? 16 : tail;
        config->colsb[i] = 64;
    }
    config->rows[A_TILE] = config->rows[A_NEXT] = config->rows[B_TILE] = 16;
    config->colsb[A_TILE] = config->colsb[A_NEXT] = config->colsb[B_TILE] = 64;
    config->rows[A_TAIL] = tail ? tail : 16;
    config->colsb[A_TAIL] = 64;
}

/* x: [rows, in_features] bfloat16, rows x_stride apart; y: [rows, out_features] bfloat16, rows
 * y_stride apart; bias: [out_features] bfloat16 or NULL. 0 on success, -1 for shapes it does
 * not take (in_features not a multiple of 32, out_features not of 16) or no memory.
 *
 * Each block of 16 outputs is widened whole (in_features / 32 tiles of 1 KB, in L2) once per
 * span of 256 rows, then multiplied with each pass of up to 64 of them: a row's sums are the
 * same at any row count. */
int triode_int4_matmul_amx(const uint16_t *x, int64_t x_stride, int64_t rows,
                           int64_t in_features, const uint8_t *codes, const uint16_t *scales,
                           const uint16_t *minimums, const uint16_t *bias, int64_t out_features,
                           uint16_t *y, int64_t y_stride) {
    if (in_features % 32 || out_features % 16) return -1;
    const int64_t groups = in_features / 32, out_blocks = out_features / 16;
    const int64_t pass = 16 * MAX_BLOCKS, last = rows - (rows - 1) / pass * pass;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *widened = aligned_alloc(64, (size_t)groups * 16 * 32 * sizeof(uint16_t));
        float sums[MAX_BLOCKS][16 * 16] __attribute__((aligned(64)));
        tile_config full_pass, last_pass;
        configure(&full_pass, rows < pass ? rows : pass);
        configure(&last_pass, last);
        const tile_config *loaded = &full_pass;
        _tile_loadconfig(loaded);
        if (widened == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t first = 0; first < rows; first += SPAN)
#pragma omp for schedule(dynamic, 2) nowait
        for (int64_t ob = 0; ob < out_blocks; ob++) {
            if (widened == NULL) continue;
            const int64_t end = rows - first < SPAN ? rows : first + SPAN;
            const __m512 bias16 =
                bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                           _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + ob * 16))), 16))
                     : _mm512_setzero_ps();
            for (int64_t m0 = first; m0 < end; m0 += pass) {
                const int64_t here = end - m0 < pass ? end - m0 : pass;
                const tile_config *config = here == pass ? &full_pass : &last_pass;
                if (config != loaded) _tile_loadconfig(loaded = config);
                const int full = (int)(here / 16), tail = (int)(here % 16);
                const int blocks = full + (tail > 0);
                if (0 < blocks) _tile_zero(0);
                if (1 < blocks) _tile_zero(1);
                if (2 < blocks) _tile_zero(2);
                if (3 < blocks) _tile_zero(3);
                /* the span's first pass widens as it goes, a group ahead of the products (which
                 * then overlap the widening); later passes reuse the widened groups */
                const int widening = m0 == first;
                if (widening) widen_group(codes, scales, minimums, ob * groups, widened);
                for (int64_t g = 0; g < groups; g++) {
                    if (widening && g + 1 < groups)
                        widen_group(codes, scales, minimums, ob * groups + g + 1, widened + (g + 1) * 512);
                    _tile_loadd(B_TILE, widened + g * 512, 64);
                    const uint16_t *a = x + m0 * x_stride + g * 32;
                    /* full blocks' x in two tiles by turns: one loads while a product reads
                     * the other */
                    LOAD_DP(0, A_TILE);
                    LOAD_DP(1, A_NEXT);
                    LOAD_DP(2, A_TILE);
                    LOAD_DP(3, A_NEXT);
                }
                STORE(0);
                STORE(1);
                STORE(2);
                STORE(3);
                for (int i = 0; i < blocks; i++) {
                    const int n = i < full ? 16 : tail;
                    for (int r = 0; r < n; r++) {
                        const __m512 v = _mm512_add_ps(_mm512_load_ps(sums[i] + 16 * r), bias16);
                        uint16_t *out = y + (m0 + 16 * i + r) * y_stride + ob * 16;
                        _mm256_storeu_si256((__m256i *)out, (__m256i)_mm512_cvtneps_pbh(v));
                    }
                }
            }
        }
        _tile_release();
        free(widened);
    }
    return failed ? -1 : 0;
}
#else
int triode_int4_amx_available(void) { return 0; }

int triode_int4_matmul_amx(const uint16_t *x, int64_t x_stride, int64_t rows,
                           int64_t in_features, const uint8_t *codes, const uint16_t *scales,
                           const uint16_t *minimums, const uint16_t *bias, int64_t out_features,
                           uint16_t *y, int64_t y_stride) {
    (void)x, (void)x_stride, (void)rows, (void)in_features, (void)codes, (void)scales;
    (void)minimums, (void)bias, (void)out_features, (void)y, (void)y_stride;
    return -1;
}
#endif
