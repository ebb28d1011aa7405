/* y[M, N] = x[M, K] @ w[N, K]^T with w in a GGUF checkpoint's own quantized blocks and x rounded to 8-bit codes:
 * the engine's "int8" path, the products llama.cpp computes on a CPU.
 *
 * Why: a verification of 8 rows in float32 is bound by multiply-adds (16 a vector instruction), a one-token step by
 * the weight's bytes. Here the weight stays in its quantized form (4, 5 or 8 bits a weight, plus a float scale per
 * block of 16 or 32) and each activation row is rounded to int8 codes with one scale per 32 values, so that 64
 * products go into one AVX-512 VNNI instruction and a step reads a fifth of float32's bytes.
 *
 * Exact where it matters: the products of codes are summed in int32 (exactly, in any order), and the float work per
 * output is always the same sequence: for each weight block b in turn, acc = fma(float(isum_b - offset * xsum_b),
 * w_scale_b * x_scale_b, acc), then acc = fma(w_min_b, x_scale_b * xsum_b, acc) where the format has minimums. So a
 * row's result never depends on the other rows of the call, nor on the thread count, nor on the instruction set:
 * the AVX-512 VNNI, AVX2 and portable versions below give the same bits (tests/test_block_gemm.py). That makes a
 * verification of 8 tokens give each token exactly what a one-token step gives: lossless against its own plain
 * decoding, though not bit-equal to the float32 product.
 *
 * Weight layout (`quantized.py` makes it from GGUF blocks): rows in panels of 16, so that one 64-byte vector holds 4
 * consecutive codes of each of 16 rows and a VNNI instruction against 4 broadcast activation codes yields 16
 * outputs' partial sums, one per lane, with no horizontal reduction.
 *   8-bit codes:   [N/16][K/4][16 rows][4 codes]
 *   4- or 5-bit:   [N/16][K/32][4 groups][16 rows][4 bytes], byte j of a row = code(8g + j) | code(8g + 4 + j) << 4
 *   5-bit's fifth bits: [N/16][K/32][4 groups][2 halves] 64-bit masks, bit 4r + j = bit 4 of code(8g + 4 half + j)
 *   scales, minimums: float [N/16][K/block][16 rows]
 * A weight w = scale * (code - offset) (+ minimum), the codes unsigned.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

#define PANEL 16
#define X_BLOCK 32 /* activation codes per scale */

/* Each activation row rounded to int8 codes, one scale per 32 values (their largest magnitude to 127), with the
 * sum of the codes of every 16 and the scale times the sum of every 32. One scalar routine for every instruction
 * set, so that every version multiplies the same codes. */
void quantize_rows_q8(const float *x, long M, long K, signed char *codes, float *scales, int *sums16,
                      float *scaled_sums) {
    for (long m = 0; m < M; m++)
        for (long b = 0; b < K / X_BLOCK; b++) {
            const float *v = x + m * K + b * X_BLOCK;
            signed char *c = codes + m * K + b * X_BLOCK;
            float largest = 0.0f;
            for (int j = 0; j < X_BLOCK; j++) largest = fabsf(v[j]) > largest ? fabsf(v[j]) : largest;
            const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
            int halves[2] = {0, 0};
            for (int j = 0; j < X_BLOCK; j++) {
                long q = lrintf(v[j] * inverse);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                c[j] = (signed char)q;
                halves[j / 16] += (int)q;
            }
            const float scale = largest / 127.0f;
            scales[m * (K / X_BLOCK) + b] = scale;
            sums16[m * (K / 16) + 2 * b] = halves[0];
            sums16[m * (K / 16) + 2 * b + 1] = halves[1];
            scaled_sums[m * (K / X_BLOCK) + b] = scale * (float)(halves[0] + halves[1]);
        }
}

typedef struct {
    const signed char *codes;
    const float *scales;
    const int *sums16;
    const float *scaled_sums;
    long K;
} quantized_rows;

static inline int block_sum(const quantized_rows *x, long row, int block, long b) {
    const int *s = x->sums16 + row * (x->K / 16);
    return block == 16 ? s[b] : s[2 * b] + s[2 * b + 1];
}

/* ---- the portable version: every version's definition ---- */

static inline int code_at(const block_weight *w, long n, long k) {
    const long p = n / PANEL, r = n % PANEL, K = w->cols;
    if (w->bits == 8) return w->codes[((p * (K / 4) + k / 4) * PANEL + r) * 4 + k % 4];
    const long b = k / 32, g = k % 32 / 8, half = k % 8 / 4, j = k % 4;
    const unsigned char byte = w->codes[(((p * (K / 32) + b) * 4 + g) * PANEL + r) * 4 + j];
    int code = half ? byte >> 4 : byte & 15;
    if (w->bits == 5) {
        unsigned long long mask;
        memcpy(&mask, w->high + ((((p * (K / 32) + b) * 4 + g) * 2 + half) * 8), sizeof mask);
        code |= (int)((mask >> (4 * r + j)) & 1) << 4;
    }
    return code;
}

static void panels_portable(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M,
                            long first, long end) {
    const long K = w->cols, blocks = K / w->block;
    for (long p = first; p < end; p++)
        for (long r = 0; r < PANEL; r++) {
            const long n = p * PANEL + r;
            for (long i = 0; i < M; i++) {
                float acc = 0.0f;
                for (long b = 0; b < blocks; b++) {
                    int sum = 0;
                    for (long k = b * w->block; k < (b + 1) * w->block; k++)
                        sum += code_at(w, n, k) * x->codes[i * K + k];
                    sum -= w->offset * block_sum(x, i, w->block, b);
                    const long at = (p * blocks + b) * PANEL + r, xb = i * (K / X_BLOCK) + b * w->block / X_BLOCK;
                    acc = fmaf((float)sum, w->scale[at] * x->scales[xb], acc);
                    if (w->minimum) acc = fmaf(w->minimum[at], x->scaled_sums[xb], acc);
                }
                y[i * ldy + n] = acc;
            }
        }
}

/* ---- AVX-512 VNNI: a panel's 16 outputs in one vector per activation row ---- */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MAX_ROWS 6 /* activation rows per pass over a panel's block: 8 weight vectors, 6 sums and 6 accumulators in
                    * registers, with room to spare (8 rows spilled) */

static inline __m512i broadcast4(const signed char *p) {
    int v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) void panel_avx512(const int MR, const int BITS, const int BLOCK,
                                                              const block_weight *w, const quantized_rows *x,
                                                              long i0, long p, float *y, long ldy) {
    const long K = w->cols, blocks = K / BLOCK;
    const int vectors = BLOCK / 4; /* 64-byte weight vectors a block: 4 codes of 16 rows each */
    const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    __m512 acc[MAX_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i wv[8];
        if (BITS == 8) {
            const unsigned char *c = w->codes + (p * (K / 4) + b * (BLOCK / 4)) * 64;
            for (int t = 0; t < vectors; t++) wv[t] = _mm512_loadu_si512((const void *)(c + 64 * t));
        } else {
            const unsigned char *c = w->codes + (p * blocks + b) * 4 * 64;
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * g));
                wv[2 * g] = _mm512_and_si512(v, low4);
                wv[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (BITS == 5) {
                    unsigned long long masks[2];
                    memcpy(masks, w->high + ((p * blocks + b) * 4 + g) * 16, sizeof masks);
                    wv[2 * g] = _mm512_or_si512(wv[2 * g], _mm512_maskz_mov_epi8(masks[0], fifth));
                    wv[2 * g + 1] = _mm512_or_si512(wv[2 * g + 1], _mm512_maskz_mov_epi8(masks[1], fifth));
                }
            }
        }
        const __m512 scale = _mm512_loadu_ps(w->scale + (p * blocks + b) * PANEL);
        const __m512 minimum = w->minimum ? _mm512_loadu_ps(w->minimum + (p * blocks + b) * PANEL) : scale;
        /* Rows innermost, so that their sums are independent chains of VNNI instructions (one row's chain of 8
         * would wait on each instruction's latency); with few rows, each row's sum in two halves as well. */
        const int split = MR <= 4 ? 2 : 1;
        __m512i sums[MAX_ROWS][2];
        for (int i = 0; i < MR; i++) sums[i][0] = sums[i][1] = _mm512_setzero_si512();
        for (int t = 0; t < vectors; t++)
            for (int i = 0; i < MR; i++)
                sums[i][t % split] = _mm512_dpbusd_epi32(sums[i][t % split], wv[t],
                                                         broadcast4(x->codes + (i0 + i) * K + b * BLOCK + 4 * t));
        for (int i = 0; i < MR; i++) {
            const long row = i0 + i, xb = row * (K / X_BLOCK) + b * BLOCK / X_BLOCK;
            __m512i sum = split == 2 ? _mm512_add_epi32(sums[i][0], sums[i][1]) : sums[i][0];
            if (w->offset) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(w->offset * block_sum(x, row, BLOCK, b)));
            const __m512 scales = _mm512_mul_ps(scale, _mm512_set1_ps(x->scales[xb]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scales, acc[i]);
            if (w->minimum) acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x->scaled_sums[xb]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(y + (i0 + i) * ldy + p * PANEL, acc[i]);
}

#define PANELS_AVX512(BITS, BLOCK)                                                                                 \
    static void panels_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, \
                                        long first, long end) {                                                    \
        for (long p = first; p < end; p++)                                                                         \
            for (long i = 0; i < M; i += MAX_ROWS) switch (M - i < MAX_ROWS ? M - i : MAX_ROWS) {                  \
                case 6: panel_avx512(6, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 5: panel_avx512(5, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 4: panel_avx512(4, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 3: panel_avx512(3, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 2: panel_avx512(2, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 1: panel_avx512(1, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                }                                                                                                  \
    }
PANELS_AVX512(4, 32)
PANELS_AVX512(5, 32)
PANELS_AVX512(8, 32)
PANELS_AVX512(8, 16)

/* ---- AMX (Intel's tile unit, where the CPU and the kernel offer it): from AMX_MIN_ROWS rows on, a weight block's
 * products for up to 16 rows in one tile instruction: A = the rows' codes of the block [rows][block], B = the panel's
 * codes in exactly the panel layout [block / 4][16 outputs][4], C = the int32 sums [rows][16 outputs]; the float work
 * after it is the VNNI version's, so the bits are too. Rows are read in tiles of TILE_ROWS, the quantized rows padded
 * with zero rows to a whole tile (`block_gemm`), so one tile shape serves a whole call. ---- */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_MIN_ROWS 4
#define TILE_ROWS 16

typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short bytes_per_row[16];
    unsigned char rows[16];
} tile_config;

static int amx_permitted(void) { /* Linux hands out the tile state only on request, once a process */
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* On every call, on every thread: another library (oneDNN inside torch) may have set other tile shapes since. */
static void amx_configure(int rows, int block) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = rows, config.bytes_per_row[0] = 64;        /* C: int32 sums of 16 outputs */
    config.rows[1] = rows, config.bytes_per_row[1] = block;     /* A: the rows' codes of one weight block */
    config.rows[2] = block / 4, config.bytes_per_row[2] = 64;   /* B: the panel's codes, 4 of 16 outputs a row */
    /* GCC does not count the instruction's read of `config`, and drops the stores above without this barrier. */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}

static inline __attribute__((always_inline)) void panel_amx(const int MR, const int BITS, const int BLOCK,
                                                           const block_weight *w, const quantized_rows *x, long i0,
                                                           long rows, long p, float *y, long ldy) {
    const long K = w->cols, blocks = K / BLOCK;
    const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    int sums[TILE_ROWS][PANEL] __attribute__((aligned(64)));
    unsigned char unpacked[8 * 64] __attribute__((aligned(64)));
    __m512 acc[TILE_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const unsigned char *codes;
        if (BITS == 8) {
            codes = w->codes + (p * (K / 4) + b * (BLOCK / 4)) * 64;
        } else { /* 4 or 5 bits: unpacked to bytes, where the tile load reads them */
            const unsigned char *c = w->codes + (p * blocks + b) * 4 * 64;
            for (int g = 0; g < 4; g++) {
                const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * g));
                __m512i low = _mm512_and_si512(v, low4), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                if (BITS == 5) {
                    unsigned long long masks[2];
                    memcpy(masks, w->high + ((p * blocks + b) * 4 + g) * 16, sizeof masks);
                    low = _mm512_or_si512(low, _mm512_maskz_mov_epi8(masks[0], fifth));
                    high = _mm512_or_si512(high, _mm512_maskz_mov_epi8(masks[1], fifth));
                }
                _mm512_store_si512((void *)(unpacked + 128 * g), low);
                _mm512_store_si512((void *)(unpacked + 128 * g + 64), high);
            }
            codes = unpacked;
        }
        _tile_zero(0);
        _tile_loadd(1, x->codes + i0 * K + b * BLOCK, K);
        _tile_loadd(2, codes, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums, 64);
        const __m512 scale = _mm512_loadu_ps(w->scale + (p * blocks + b) * PANEL);
        const __m512 minimum = w->minimum ? _mm512_loadu_ps(w->minimum + (p * blocks + b) * PANEL) : scale;
        for (int i = 0; i < MR; i++) {
            const long row = i0 + i, xb = row * (K / X_BLOCK) + b * BLOCK / X_BLOCK;
            __m512i sum = _mm512_load_si512((const void *)sums[i]);
            if (w->offset) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(w->offset * block_sum(x, row, BLOCK, b)));
            const __m512 scales = _mm512_mul_ps(scale, _mm512_set1_ps(x->scales[xb]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scales, acc[i]);
            if (w->minimum) acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(x->scaled_sums[xb]), acc[i]);
        }
    }
    for (int i = 0; i < MR && i0 + i < rows; i++) _mm512_storeu_ps(y + (i0 + i) * ldy + p * PANEL, acc[i]);
}

/* Tiles of 16 rows (the last one padded with zero rows, whose results are dropped); a call of 8 rows or fewer, one
 * of 8 (half the float work after each tile instruction). */
#define PANELS_AMX(BITS, BLOCK)                                                                                    \
    static void amx_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M,  \
                                     long first, long end) {                                                       \
        const int tile = M <= 8 ? 8 : TILE_ROWS;                                                                    \
        amx_configure(tile, BLOCK);                                                                                 \
        for (long p = first; p < end; p++)                                                                          \
            for (long i = 0; i < M; i += tile) {                                                                    \
                if (tile == 8) panel_amx(8, BITS, BLOCK, w, x, i, M, p, y, ldy);                                    \
                else panel_amx(TILE_ROWS, BITS, BLOCK, w, x, i, M, p, y, ldy);                                      \
            }                                                                                                       \
    }
PANELS_AMX(4, 32)
PANELS_AMX(5, 32)
PANELS_AMX(8, 32)
PANELS_AMX(8, 16)
#define PADDED_ROWS TILE_ROWS
#endif

static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (M >= AMX_MIN_ROWS && amx_permitted()) {
        if (w->block == 32 && w->bits == 4) amx_4_32(w, x, y, ldy, M, first, end);
        else if (w->block == 32 && w->bits == 5) amx_5_32(w, x, y, ldy, M, first, end);
        else if (w->block == 32 && w->bits == 8) amx_8_32(w, x, y, ldy, M, first, end);
        else if (w->block == 16 && w->bits == 8) amx_8_16(w, x, y, ldy, M, first, end);
        else return 0;
        return 1;
    }
#endif
    if (w->block == 32 && w->bits == 4) panels_4_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 5) panels_5_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 8) panels_8_32(w, x, y, ldy, M, first, end);
    else if (w->block == 16 && w->bits == 8) panels_8_16(w, x, y, ldy, M, first, end);
    else return 0;
    return 1;
}
static const char *VERSION = "avx512-vnni";

/* ---- AVX2: each panel as two halves of 8 rows; u8 x s8 pairs summed in int16 (never saturating: codes of up to
 * 5 bits; 8-bit codes go in two 4-bit halves), then in int32 ---- */
#elif defined(__AVX2__)
#define MAX_ROWS 4

static inline __m256i broadcast4(const signed char *p) {
    int v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline __m256i bytes_of_bits(unsigned int bits) { /* byte i: 0xFF where bit i is set */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                                                2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

static inline __m256i dot4(__m256i codes, __m256i x) { /* codes < 32: pairs fit int16 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void panel_avx2(const int MR, const int BITS, const int BLOCK,
                                                            const block_weight *w, const quantized_rows *x, long i0,
                                                            long p, int half, float *y, long ldy) {
    const long K = w->cols, blocks = K / BLOCK;
    const int vectors = BLOCK / 4;
    const __m256i low4 = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
    __m256 acc[MAX_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m256i wv[8];
        if (BITS == 8) {
            const unsigned char *c = w->codes + (p * (K / 4) + b * (BLOCK / 4)) * 64 + 32 * half;
            for (int t = 0; t < vectors; t++) wv[t] = _mm256_loadu_si256((const __m256i *)(c + 64 * t));
        } else {
            const unsigned char *c = w->codes + (p * blocks + b) * 4 * 64 + 32 * half;
            for (int g = 0; g < 4; g++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * g));
                wv[2 * g] = _mm256_and_si256(v, low4);
                wv[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if (BITS == 5) {
                    unsigned long long masks[2];
                    memcpy(masks, w->high + ((p * blocks + b) * 4 + g) * 16, sizeof masks);
                    wv[2 * g] = _mm256_or_si256(
                        wv[2 * g], _mm256_and_si256(bytes_of_bits((unsigned int)(masks[0] >> (32 * half))), fifth));
                    wv[2 * g + 1] = _mm256_or_si256(
                        wv[2 * g + 1],
                        _mm256_and_si256(bytes_of_bits((unsigned int)(masks[1] >> (32 * half))), fifth));
                }
            }
        }
        const __m256 scale = _mm256_loadu_ps(w->scale + (p * blocks + b) * PANEL + 8 * half);
        const __m256 minimum = w->minimum ? _mm256_loadu_ps(w->minimum + (p * blocks + b) * PANEL + 8 * half) : scale;
        __m256i sums[MAX_ROWS]; /* rows innermost: independent chains */
        for (int i = 0; i < MR; i++) sums[i] = _mm256_setzero_si256();
        for (int t = 0; t < vectors; t++) {
            /* 8-bit codes as 16 * high nibble + low nibble: each product pair within int16 */
            const __m256i high = BITS == 8 ? _mm256_and_si256(_mm256_srli_epi16(wv[t], 4), low4) : wv[t];
            const __m256i low = BITS == 8 ? _mm256_and_si256(wv[t], low4) : wv[t];
            for (int i = 0; i < MR; i++) {
                const __m256i xv = broadcast4(x->codes + (i0 + i) * K + b * BLOCK + 4 * t);
                sums[i] = BITS == 8 ? _mm256_add_epi32(sums[i], _mm256_add_epi32(_mm256_slli_epi32(dot4(high, xv), 4),
                                                                                 dot4(low, xv)))
                                    : _mm256_add_epi32(sums[i], dot4(low, xv));
            }
        }
        for (int i = 0; i < MR; i++) {
            const long row = i0 + i, xb = row * (K / X_BLOCK) + b * BLOCK / X_BLOCK;
            __m256i sum = sums[i];
            if (w->offset) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(w->offset * block_sum(x, row, BLOCK, b)));
            const __m256 scales = _mm256_mul_ps(scale, _mm256_set1_ps(x->scales[xb]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scales, acc[i]);
            if (w->minimum) acc[i] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x->scaled_sums[xb]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm256_storeu_ps(y + (i0 + i) * ldy + p * PANEL + 8 * half, acc[i]);
}

#define PANELS_AVX2(BITS, BLOCK)                                                                                   \
    static void panels_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, \
                                        long first, long end) {                                                    \
        for (long p = first; p < end; p++)                                                                         \
            for (int half = 0; half < 2; half++)                                                                   \
                for (long i = 0; i < M; i += MAX_ROWS) switch (M - i < MAX_ROWS ? M - i : MAX_ROWS) {              \
                    case 4: panel_avx2(4, BITS, BLOCK, w, x, i, p, half, y, ldy); break;                           \
                    case 3: panel_avx2(3, BITS, BLOCK, w, x, i, p, half, y, ldy); break;                           \
                    case 2: panel_avx2(2, BITS, BLOCK, w, x, i, p, half, y, ldy); break;                           \
                    case 1: panel_avx2(1, BITS, BLOCK, w, x, i, p, half, y, ldy); break;                           \
                    }                                                                                              \
    }
PANELS_AVX2(4, 32)
PANELS_AVX2(5, 32)
PANELS_AVX2(8, 32)
PANELS_AVX2(8, 16)

static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end) {
    if (w->block == 32 && w->bits == 4) panels_4_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 5) panels_5_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 8) panels_8_32(w, x, y, ldy, M, first, end);
    else if (w->block == 16 && w->bits == 8) panels_8_16(w, x, y, ldy, M, first, end);
    else return 0;
    return 1;
}
static const char *VERSION = "avx2";

#else
static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end) {
    return 0;
}
static const char *VERSION = "portable";
#endif

#ifndef PADDED_ROWS
#define PADDED_ROWS 1
#endif

const char *block_gemm_version(void) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
    if (amx_permitted()) return "amx";
#endif
    return VERSION;
}

/* The calling thread's buffers for the quantized rows, kept and grown between calls. */
static void *rows_scratch(size_t bytes) {
    static __thread void *buffer;
    static __thread size_t held;
    if (bytes > held) {
        free(buffer);
        buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        held = bytes;
    }
    return buffer;
}

/* y[M, sum of the parts' rows] (row stride ldy) = x[M, K] @ [part 0 ; part 1 ; ...]^T: weights of one input fused
 * (q/k/v, gate/up), each part in its own format. `portable` forces the portable version (for tests); `parallel`
 * shares each part's panels among the OpenMP threads. */
void block_gemm(const block_weight *parts, long count, const float *x, long M, long K, float *y, long ldy,
                int parallel, int portable) {
    /* Room for whole tiles of rows where AMX reads them: the padding rows' codes and scales are zeros. */
    const long padded = (M + PADDED_ROWS - 1) / PADDED_ROWS * PADDED_ROWS;
    const size_t codes = (size_t)(padded * K), scales = (size_t)(padded * (K / X_BLOCK));
    char *buffer = rows_scratch(codes + 64 + sizeof(float) * 2 * scales + sizeof(int) * 2 * scales + 192);
    quantized_rows q = {(const signed char *)buffer, NULL, NULL, NULL, K};
    float *x_scales = (float *)(buffer + (codes + 63) / 64 * 64);
    float *scaled = x_scales + (scales + 15) / 16 * 16;
    int *sums = (int *)(scaled + (scales + 15) / 16 * 16);
    quantize_rows_q8(x, M, K, (signed char *)buffer, x_scales, sums, scaled);
    memset(buffer + M * K, 0, (size_t)((padded - M) * K));
    q.scales = x_scales, q.sums16 = sums, q.scaled_sums = scaled;
    long column = 0;
    for (long c = 0; c < count; c++) {
        const block_weight *w = &parts[c];
        const long panels = w->rows / PANEL;
        float *out = y + column;
        long chunks = 1;
#ifdef _OPENMP
        if (parallel) chunks = omp_get_max_threads();
#endif
#pragma omp parallel for schedule(static) if (parallel)
        for (long t = 0; t < chunks; t++) {
            const long first = t * panels / chunks, end = (t + 1) * panels / chunks;
            if (portable || !panels_fast(w, &q, out, ldy, M, first, end))
                panels_portable(w, &q, out, ldy, M, first, end);
        }
        column += w->rows;
    }
}
