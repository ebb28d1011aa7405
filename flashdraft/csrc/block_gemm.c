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

/* Each activation row rounded to int8 codes, one scale per 32 values (their largest magnitude to 127), laid out
 * block-major, [K/32][rows][32], so that every row's codes of one block sit at a fixed distance from the first
 * row's (a constant offset in the instruction that broadcasts them); with each block's scale and the scale times
 * the sum of its codes ([K/32][rows]), and the sum of every 16 codes ([K/16][rows]); `rows` is the layouts' row
 * count (M or more). One scalar routine for every instruction set, so that every version multiplies the same codes. */
void quantize_rows_q8(const float *x, long M, long K, long rows, signed char *codes, float *scales, int *sums16,
                      float *scaled_sums) {
    for (long m = 0; m < M; m++)
        for (long b = 0; b < K / X_BLOCK; b++) {
            const float *v = x + m * K + b * X_BLOCK;
            signed char *c = codes + (b * rows + m) * X_BLOCK;
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
            scales[b * rows + m] = scale;
            sums16[(2 * b) * rows + m] = halves[0];
            sums16[(2 * b + 1) * rows + m] = halves[1];
            scaled_sums[b * rows + m] = scale * (float)(halves[0] + halves[1]);
        }
}

typedef struct {
    const signed char *codes;  /* [K/32][rows][32] */
    const float *scales;       /* [K/32][rows] */
    const float *scaled_sums;  /* [K/32][rows] */
    const int *corrections;    /* [K/block][rows]: the weight's offset times the sum of the block's codes */
    long rows;
} quantized_rows;

/* Row `row`'s codes of weight block b (of `block` values). */
static inline const signed char *row_codes(const quantized_rows *x, long row, int block, long b) {
    const long k = b * block;
    return x->codes + ((k / X_BLOCK) * x->rows + row) * X_BLOCK + k % X_BLOCK;
}

/* The activation scales of weight block b for rows from `row` on (one a row). */
static inline const float *row_scales(const quantized_rows *x, long row, int block, long b) {
    return x->scales + (b * block / X_BLOCK) * x->rows + row;
}

/* A 32-bit lane of four codes, loaded so that the compiler may fold it into the instruction that broadcasts it. */
typedef int aliased_int __attribute__((may_alias, aligned(1)));

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
                    const signed char *codes = row_codes(x, i, w->block, b);
                    int sum = 0;
                    for (long k = 0; k < w->block; k++) sum += code_at(w, n, b * w->block + k) * codes[k];
                    sum -= x->corrections[b * x->rows + i];
                    const long at = (p * blocks + b) * PANEL + r;
                    acc = fmaf((float)sum, w->scale[at] * *row_scales(x, i, w->block, b), acc);
                    if (w->minimum) acc = fmaf(w->minimum[at], x->scaled_sums[b * x->rows + i], acc);
                }
                y[i * ldy + n] = acc;
            }
        }
}

#if defined(__AVX512F__) || defined(__AVX2__)
/* Ask for the weight block `ahead` (counted over the whole weight: panels follow one another) while this one is
 * computed. The weight streams from memory once a call; without this, the loads of a block wait for its lines and
 * a step of several rows costs the memory time plus the multiply time, where with it the two overlap (an 8-row
 * verification of Qwen2.5-Coder-0.5B: 1.3-1.4 steps instead of 1.5-1.6; BENCHMARKS.md, "The CPU engine"). */
#define PREFETCH_BLOCKS 8
static inline __attribute__((always_inline)) void prefetch_block(const block_weight *w, const int BITS,
                                                                const int BLOCK, long ahead) {
    const int code_lines = BITS == 8 ? BLOCK / 4 : 4; /* 64-byte lines of codes a block */
    for (int line = 0; line < code_lines; line++)
        _mm_prefetch((const char *)(w->codes + (ahead * code_lines + line) * 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(w->scale + ahead * PANEL), _MM_HINT_T0);
    if (w->minimum) _mm_prefetch((const char *)(w->minimum + ahead * PANEL), _MM_HINT_T0);
    if (BITS == 5) _mm_prefetch((const char *)(w->high + ahead * 64), _MM_HINT_T0);
}
#endif

/* ---- AVX-512 VNNI: a panel's 16 outputs in one vector per activation row ---- */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MAX_ROWS 8 /* activation rows per pass over a panel's block */

static inline __m512i broadcast4(const signed char *p) { return _mm512_set1_epi32(*(const aliased_int *)p); }

static inline __attribute__((always_inline)) void panel_avx512(const int MR, const int BITS, const int BLOCK,
                                                              const block_weight *w, const quantized_rows *x,
                                                              long i0, long p, float *y, long ldy) {
    const long K = w->cols, blocks = K / BLOCK;
    const int vectors = BLOCK / 4; /* 64-byte weight vectors a block: 4 codes of 16 rows each */
    const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    __m512 acc[8];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        __m512i wv[8];
        prefetch_block(w, BITS, BLOCK, p * blocks + b + PREFETCH_BLOCKS);
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
        const signed char *codes = row_codes(x, i0, BLOCK, b); /* row i's at codes + 32 i */
        const int *corrections = x->corrections + b * x->rows + i0;
        const float *scales = row_scales(x, i0, BLOCK, b), *scaled_sums = x->scaled_sums + b * x->rows + i0;
        __m512i sums[8][2];
        for (int i = 0; i < MR; i++) sums[i][0] = sums[i][1] = _mm512_setzero_si512();
        for (int t = 0; t < vectors; t++)
            for (int i = 0; i < MR; i++)
                sums[i][t % split] = _mm512_dpbusd_epi32(sums[i][t % split], wv[t],
                                                         broadcast4(codes + X_BLOCK * i + 4 * t));
        for (int i = 0; i < MR; i++) {
            __m512i sum = split == 2 ? _mm512_add_epi32(sums[i][0], sums[i][1]) : sums[i][0];
            if (w->offset) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(corrections[i]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(scales[i])), acc[i]);
            if (w->minimum) acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(scaled_sums[i]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(y + (i0 + i) * ldy + p * PANEL, acc[i]);
}

#define PANELS_AVX512(BITS, BLOCK)                                                                                 \
    static void panels_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, \
                                        long first, long end) {                                                    \
        for (long p = first; p < end; p++)                                                                         \
            for (long i = 0; i < M; i += MAX_ROWS) switch (M - i < MAX_ROWS ? M - i : MAX_ROWS) {                  \
                case 8: panel_avx512(8, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
                case 7: panel_avx512(7, BITS, BLOCK, w, x, i, p, y, ldy); break;                                   \
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

#define FAST_PANELS
static const char *VERSION = "avx512-vnni";

/* ---- AVX2: each panel as two halves of 8 rows; u8 x s8 pairs summed in int16 (never saturating: codes of up to
 * 5 bits; 8-bit codes go in two 4-bit halves), then in int32 ---- */
#elif defined(__AVX2__)
#define MAX_ROWS 4

static inline __m256i broadcast4(const signed char *p) { return _mm256_set1_epi32(*(const aliased_int *)p); }

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
        if (half == 0) prefetch_block(w, BITS, BLOCK, p * blocks + b + PREFETCH_BLOCKS); /* half 1 reads it again */
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
        const signed char *codes = row_codes(x, i0, BLOCK, b); /* row i's at codes + 32 i */
        const int *corrections = x->corrections + b * x->rows + i0;
        const float *scales = row_scales(x, i0, BLOCK, b), *scaled_sums = x->scaled_sums + b * x->rows + i0;
        __m256i sums[MAX_ROWS]; /* rows innermost: independent chains */
        for (int i = 0; i < MR; i++) sums[i] = _mm256_setzero_si256();
        for (int t = 0; t < vectors; t++) {
            /* 8-bit codes as 16 * high nibble + low nibble: each product pair within int16 */
            const __m256i high = BITS == 8 ? _mm256_and_si256(_mm256_srli_epi16(wv[t], 4), low4) : wv[t];
            const __m256i low = BITS == 8 ? _mm256_and_si256(wv[t], low4) : wv[t];
            for (int i = 0; i < MR; i++) {
                const __m256i xv = broadcast4(codes + X_BLOCK * i + 4 * t);
                sums[i] = BITS == 8 ? _mm256_add_epi32(sums[i], _mm256_add_epi32(_mm256_slli_epi32(dot4(high, xv), 4),
                                                                                 dot4(low, xv)))
                                    : _mm256_add_epi32(sums[i], dot4(low, xv));
            }
        }
        for (int i = 0; i < MR; i++) {
            __m256i sum = sums[i];
            if (w->offset) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(corrections[i]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(scales[i])), acc[i]);
            if (w->minimum) acc[i] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(scaled_sums[i]), acc[i]);
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

#define FAST_PANELS
static const char *VERSION = "avx2";

#else
static const char *VERSION = "portable";
#endif

/* The fast versions' panels by weight form; 0 where there are none (the portable build) or none for the form. */
#ifdef FAST_PANELS
static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end) {
    if (w->block == 32 && w->bits == 4) panels_4_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 5) panels_5_32(w, x, y, ldy, M, first, end);
    else if (w->block == 32 && w->bits == 8) panels_8_32(w, x, y, ldy, M, first, end);
    else if (w->block == 16 && w->bits == 8) panels_8_16(w, x, y, ldy, M, first, end);
    else return 0;
    return 1;
}
#else
static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end) {
    return 0;
}
#endif

const char *block_gemm_version(void) { return VERSION; }

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
    const long rows = M, blocks32 = K / X_BLOCK;
    const size_t code_bytes = (size_t)(rows * K + 63) / 64 * 64, per_block = (size_t)(rows * blocks32);
    char *buffer = rows_scratch(code_bytes + sizeof(float) * 2 * per_block + sizeof(int) * 4 * per_block);
    signed char *codes = (signed char *)buffer;
    float *scales = (float *)(buffer + code_bytes), *scaled_sums = scales + per_block;
    int *sums16 = (int *)(scaled_sums + per_block), *corrections = sums16 + 2 * per_block;
    quantize_rows_q8(x, M, K, rows, codes, scales, sums16, scaled_sums);
    const quantized_rows q = {codes, scales, scaled_sums, corrections, rows};
    long column = 0;
    for (long c = 0; c < count; c++) {
        const block_weight *w = &parts[c];
        const long panels = w->rows / PANEL, blocks = K / w->block;
        for (long b = 0; b < blocks; b++) /* the weight's integer offset times each block's sum of codes */
            for (long m = 0; m < rows; m++)
                corrections[b * rows + m] = w->offset * (w->block == 16 ? sums16[b * rows + m]
                                                                          : sums16[2 * b * rows + m] +
                                                                                sums16[(2 * b + 1) * rows + m]);
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
