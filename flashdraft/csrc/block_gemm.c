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
#define ROW_CHUNK 128

/* Each activation row rounded to int8 codes, one scale per 32 values (their largest magnitude to 127), laid out
 * block-major, [K/32][rows][32], so that every row's codes of one block sit at a fixed distance from the first
 * row's (a constant offset in the instruction that broadcasts them); with each block's scale and the scale times
 * the sum of its codes ([K/32][rows]), and the sum of every 16 codes ([K/16][rows]); `rows` is the layouts' row
 * count (M or more). The scalar routine is the definition; the AVX-512 one gives its codes exactly (the largest
 * magnitude is exact in any order, the product and the rounding to nearest even are the same instructions' work),
 * and matters at 8 and 16 rows, where the scalar one cost a tenth of a verification. */
static void quantize_block_scalar(const float *v, signed char *c, float *scale, int halves[2]) {
    float largest = 0.0f;
    for (int j = 0; j < X_BLOCK; j++) largest = fabsf(v[j]) > largest ? fabsf(v[j]) : largest;
    const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    halves[0] = halves[1] = 0;
    for (int j = 0; j < X_BLOCK; j++) {
        long q = lrintf(v[j] * inverse);
        q = q > 127 ? 127 : q < -127 ? -127 : q;
        c[j] = (signed char)q;
        halves[j / 16] += (int)q;
    }
    *scale = largest / 127.0f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline void quantize_block_avx512(const float *v, signed char *c, float *scale, int halves[2]) {
    const __m512 low = _mm512_loadu_ps(v), high = _mm512_loadu_ps(v + 16);
    /* max(|v|, acc) keeps acc where |v| is NaN, as the scalar comparison does */
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(high), _mm512_max_ps(_mm512_abs_ps(low),
                                                                                                   _mm512_setzero_ps())));
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    const __m512i q0 = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(low, inverse))));
    const __m512i q1 = _mm512_max_epi32(bottom, _mm512_min_epi32(top, _mm512_cvtps_epi32(_mm512_mul_ps(high, inverse))));
    _mm_storeu_si128((__m128i *)c, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(c + 16), _mm512_cvtepi32_epi8(q1));
    halves[0] = _mm512_reduce_add_epi32(q0);
    halves[1] = _mm512_reduce_add_epi32(q1);
    *scale = largest / 127.0f;
}
#elif defined(__AVX2__)
static inline void quantize_block_avx2(const float *v, signed char *c, float *scale, int halves[2]) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 x[4], most = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) { /* max(|v|, most) keeps `most` where |v| is NaN, as the scalar comparison does */
        x[j] = _mm256_loadu_ps(v + 8 * j);
        most = _mm256_max_ps(_mm256_and_ps(x[j], magnitude), most);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float largest = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
    __m256i q[4];
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_max_epi32(bottom, _mm256_min_epi32(top, _mm256_cvtps_epi32(_mm256_mul_ps(x[j], inverse))));
    /* the packs interleave 128-bit lanes: 4-code groups come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ... */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)c, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    for (int h = 0; h < 2; h++) {
        const __m256i pair = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(pair), _mm256_extracti128_si256(pair, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
        halves[h] = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1)));
    }
    *scale = largest / 127.0f;
}
#endif

void quantize_rows_q8(const float *x, long M, long K, long rows, signed char *codes, float *scales, int *sums16,
                      float *scaled_sums, int portable) {
    for (long m = 0; m < M; m++)
        for (long b = 0; b < K / X_BLOCK; b++) {
            const float *v = x + m * K + b * X_BLOCK;
            signed char *c = codes + (b * rows + m) * X_BLOCK;
            float scale;
            int halves[2];
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (!portable) quantize_block_avx512(v, c, &scale, halves);
            else
#elif defined(__AVX2__)
            if (!portable) quantize_block_avx2(v, c, &scale, halves);
            else
#endif
                quantize_block_scalar(v, c, &scale, halves);
            (void)portable;
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
    const int *corrections;    /* [K/block][rows]: minus the weight's offset times the sum of the block's codes */
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
                    sum += x->corrections[b * x->rows + i];
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

/* sum + the 4-code dot products of the weight's unsigned codes with the 4 signed codes at p, broadcast from memory
 * by the instruction itself: compilers issue a separate broadcast for _mm512_set1_epi32(*p), one more vector
 * instruction beside every multiply-add. */
static inline __m512i dot_broadcast4(__m512i sum, __m512i codes, const signed char *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(codes), "m"(*(const aliased_int *)p));
    return sum;
}

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
                if (BITS == 5) { /* the fifth bit: 16 added where its mask bit is set (bit 4 is clear) */
                    unsigned long long masks[2];
                    memcpy(masks, w->high + ((p * blocks + b) * 4 + g) * 16, sizeof masks);
                    wv[2 * g] = _mm512_mask_add_epi8(wv[2 * g], masks[0], wv[2 * g], fifth);
                    wv[2 * g + 1] = _mm512_mask_add_epi8(wv[2 * g + 1], masks[1], wv[2 * g + 1], fifth);
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
        /* each row's sum starts at minus its correction: the same integer, one subtraction fewer */
        for (int i = 0; i < MR; i++) {
            sums[i][0] = w->offset ? _mm512_set1_epi32(corrections[i]) : _mm512_setzero_si512();
            sums[i][1] = _mm512_setzero_si512();
        }
        for (int t = 0; t < vectors; t++)
            for (int i = 0; i < MR; i++)
                sums[i][t % split] = dot_broadcast4(sums[i][t % split], wv[t], codes + X_BLOCK * i + 4 * t);
        for (int i = 0; i < MR; i++) {
            const __m512i sum = split == 2 ? _mm512_add_epi32(sums[i][0], sums[i][1]) : sums[i][0];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(scales[i])), acc[i]);
            if (w->minimum) acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(scaled_sums[i]), acc[i]);
        }
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(y + (i0 + i) * ldy + p * PANEL, acc[i]);
}

#define PANELS_AVX512(BITS, BLOCK)                                                                                 \
    static void panels_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, \
                                        long from, long first, long end) {                                         \
        for (long p = first; p < end; p++)                                                                         \
            for (long i = from; i < M; i += MAX_ROWS) switch (M - i < MAX_ROWS ? M - i : MAX_ROWS) {               \
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

/* ---- AMX: up to 16 rows of a panel's block in one tile product ----
 * Why: at 8 and 16 rows the VNNI panels are bound by their multiply instructions (8 a row a block), so a
 * verification costs 1.4-2.3 one-token steps. One TDPBSUD multiplies a block's codes of up to 16 activation rows
 * (tile A: rows x 32 signed codes, the layout quantize_rows_q8 writes) by its codes of 16 weight rows (tile B:
 * the panel layout, 4 codes of 16 rows a 64-byte row) into 16 x 16 int32 sums, the same sums VNNI forms; the float
 * work per output is the same sequence, so the bits are the VNNI panels' (tests/test_block_gemm.py). Linux grants
 * the tile registers on request (arch_prctl); where it does not, the VNNI panels run. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_TILES
#define TILE_ROWS 16
#define TILE_MIN_ROWS 9 /* fewer rows run the VNNI panels: one pass of theirs takes 8 rows, and below 9 rows a tile
                          * product costs as much or more (BENCHMARKS.md, "AMX tiles") */

typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short bytes[16]; /* bytes a row, per tile */
    unsigned char rows[16];
} tile_config;

static int tiles_granted = -1; /* -1: not asked yet; 0: refused (an old kernel, a hypervisor); 1: granted */
static int tiles_allowed = 1;  /* block_gemm_use_tiles(0) turns them off (tests compare both ways) */

static int tiles_usable(void) {
    if (tiles_granted < 0) /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once a process, for all its threads */
        tiles_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return tiles_allowed && tiles_granted;
}

/* Two sets of tiles, so that one block's product runs while the other's sums are scaled (a set's tiles are not
 * renamed: its next product waits for its sums to be stored). Set s: tile 3s the sums (rows x 16 int32), 3s + 1
 * the activation codes (rows x block bytes), 3s + 2 the weight codes (block / 4 rows of 64 bytes). */
static void configure_tiles(int rows, int block) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int set = 0; set < 2; set++) {
        config.rows[3 * set] = config.rows[3 * set + 1] = (unsigned char)rows;
        config.bytes[3 * set] = 64;
        config.bytes[3 * set + 1] = (unsigned short)block;
        config.rows[3 * set + 2] = (unsigned char)(block / 4);
        config.bytes[3 * set + 2] = 64;
    }
    _tile_loadconfig(&config);
}

/* Block b of panel p as one byte a code (4- and 5-bit forms): row t of a weight tile holds codes 4t..4t+3 of the
 * 16 rows. Written a few blocks before its tile load reads it: a tile load waits for stores still in flight to
 * reach the cache, where a vector load would take them from the store buffer. */
static inline __attribute__((always_inline)) void unpack_block(const int BITS, const int BLOCK, const block_weight *w,
                                                              long p, long b, unsigned char *unpacked) {
    const long blocks = w->cols / BLOCK;
    const __m512i low4 = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    const unsigned char *c = w->codes + (p * blocks + b) * 4 * 64;
    for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512((const void *)(c + 64 * g));
        __m512i even = _mm512_and_si512(v, low4), odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (BITS == 5) {
            unsigned long long masks[2];
            memcpy(masks, w->high + ((p * blocks + b) * 4 + g) * 16, sizeof masks);
            even = _mm512_or_si512(even, _mm512_maskz_mov_epi8(masks[0], fifth));
            odd = _mm512_or_si512(odd, _mm512_maskz_mov_epi8(masks[1], fifth));
        }
        _mm512_store_si512((void *)(unpacked + 128 * g), even);
        _mm512_store_si512((void *)(unpacked + 128 * g + 64), odd);
    }
}

#define UNPACK_SLOTS 8 /* unpacked blocks in flight: block b + UNPACK_AHEAD is unpacked while b is multiplied */
#define UNPACK_AHEAD 4

/* Block b's integer sums of rows i0.. (up to 16) against panel p into `sums` ([rows][16]), by tile set SET, from
 * the packed codes (8-bit) or the slots of unpacked blocks. */
static inline __attribute__((always_inline)) void tile_sums(const int SET, const int BITS, const int BLOCK,
                                                           const block_weight *w, const quantized_rows *x, long i0,
                                                           long p, long b, unsigned char (*slots)[8 * 64],
                                                           int *sums) {
    const long K = w->cols, blocks = K / BLOCK;
    prefetch_block(w, BITS, BLOCK, p * blocks + b + PREFETCH_BLOCKS);
    if (BITS != 8 && b + UNPACK_AHEAD < blocks)
        unpack_block(BITS, BLOCK, w, p, b + UNPACK_AHEAD, slots[(b + UNPACK_AHEAD) % UNPACK_SLOTS]);
    const unsigned char *weight_codes =
        BITS == 8 ? w->codes + (p * (K / 4) + b * (BLOCK / 4)) * 64 : slots[b % UNPACK_SLOTS];
    const signed char *codes = row_codes(x, i0, BLOCK, b);
    if (SET) {
        _tile_loadd(5, weight_codes, 64);
        _tile_loadd(4, codes, X_BLOCK);
        _tile_zero(3);
        _tile_dpbsud(3, 4, 5);
        _tile_stored(3, sums, 64);
    } else {
        _tile_loadd(2, weight_codes, 64);
        _tile_loadd(1, codes, X_BLOCK);
        _tile_zero(0);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, sums, 64);
    }
}

/* The float work of block b for rows i0..i0 + MR - 1, from their integer sums: the VNNI panels' sequence. */
static inline __attribute__((always_inline)) void scale_sums(const int MR, const int BLOCK, const block_weight *w,
                                                            const quantized_rows *x, long i0, long p, long b,
                                                            const int *sums, __m512 *acc) {
    const long blocks = w->cols / BLOCK;
    const __m512 scale = _mm512_loadu_ps(w->scale + (p * blocks + b) * PANEL);
    const __m512 minimum = w->minimum ? _mm512_loadu_ps(w->minimum + (p * blocks + b) * PANEL) : scale;
    const int *corrections = x->corrections + b * x->rows + i0;
    const float *scales = row_scales(x, i0, BLOCK, b), *scaled_sums = x->scaled_sums + b * x->rows + i0;
    for (int i = 0; i < MR; i++) {
        __m512i sum = _mm512_load_si512((const void *)(sums + 16 * i));
        if (w->offset) sum = _mm512_add_epi32(sum, _mm512_set1_epi32(corrections[i]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, _mm512_set1_ps(scales[i])), acc[i]);
        if (w->minimum) acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(scaled_sums[i]), acc[i]);
    }
}

static inline __attribute__((always_inline)) void panel_tiles(const int MR, const int BITS, const int BLOCK,
                                                             const block_weight *w, const quantized_rows *x,
                                                             long i0, long p, float *y, long ldy) {
    const long blocks = w->cols / BLOCK;
    unsigned char slots[UNPACK_SLOTS][8 * 64] __attribute__((aligned(64)));
    int sums[2][TILE_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[TILE_ROWS];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    if (BITS != 8)
        for (long b = 0; b < UNPACK_AHEAD && b < blocks; b++) unpack_block(BITS, BLOCK, w, p, b, slots[b]);
    long b = 0;
    for (; b + 1 < blocks; b += 2) {
        tile_sums(0, BITS, BLOCK, w, x, i0, p, b, slots, sums[0]);
        tile_sums(1, BITS, BLOCK, w, x, i0, p, b + 1, slots, sums[1]);
        scale_sums(MR, BLOCK, w, x, i0, p, b, sums[0], acc);
        scale_sums(MR, BLOCK, w, x, i0, p, b + 1, sums[1], acc);
    }
    if (b < blocks) {
        tile_sums(0, BITS, BLOCK, w, x, i0, p, b, slots, sums[0]);
        scale_sums(MR, BLOCK, w, x, i0, p, b, sums[0], acc);
    }
    for (int i = 0; i < MR; i++) _mm512_storeu_ps(y + (i0 + i) * ldy + p * PANEL, acc[i]);
}

#define TILE_CASE(MR, BITS, BLOCK) \
    case MR: panel_tiles(MR, BITS, BLOCK, w, x, i, p, y, ldy); break;
/* Rows in groups of `rows` (16, or M when fewer), configured once; the rows past the last group: VNNI. */
#define PANELS_TILES(BITS, BLOCK)                                                                                  \
    static void tiles_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M,  \
                                       long first, long end) {                                                     \
        const int rows = M < TILE_ROWS ? (int)M : TILE_ROWS;                                                       \
        const long grouped = M / rows * rows;                                                                      \
        configure_tiles(rows, BLOCK);                                                                              \
        for (long p = first; p < end; p++)                                                                         \
            for (long i = 0; i < grouped; i += rows) switch (rows) {                                               \
                    TILE_CASE(2, BITS, BLOCK) TILE_CASE(3, BITS, BLOCK) TILE_CASE(4, BITS, BLOCK)                   \
                    TILE_CASE(5, BITS, BLOCK) TILE_CASE(6, BITS, BLOCK) TILE_CASE(7, BITS, BLOCK)                   \
                    TILE_CASE(8, BITS, BLOCK) TILE_CASE(9, BITS, BLOCK) TILE_CASE(10, BITS, BLOCK)                  \
                    TILE_CASE(11, BITS, BLOCK) TILE_CASE(12, BITS, BLOCK) TILE_CASE(13, BITS, BLOCK)                \
                    TILE_CASE(14, BITS, BLOCK) TILE_CASE(15, BITS, BLOCK) TILE_CASE(16, BITS, BLOCK)                \
                }                                                                                                  \
        _tile_release();                                                                                           \
        if (grouped < M) panels_##BITS##_##BLOCK(w, x, y, ldy, M, grouped, first, end);                            \
    }
PANELS_TILES(4, 32)
PANELS_TILES(5, 32)
PANELS_TILES(8, 32)
PANELS_TILES(8, 16)
#endif /* AMX */

/* ---- AVX2: each panel as two halves of 8 rows, a half block unpacked once for all the activation rows; u8 x s8
 * pairs summed in int16, then in int32 ---- */
#elif defined(__AVX2__)
static inline __m256i broadcast4(const signed char *p) { return _mm256_set1_epi32(*(const aliased_int *)p); }

static inline __m256i widen_pairs(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

/* A maddubs pair of codes up to c with activation codes within +-127 stays within 2 * 127 * c, so that 8 pairs' sums
 * of 4-bit codes, 4 of 5-bit codes or 2 of 6-bit codes (Q6_K's, in bytes) fit int16 exactly: summed there, they need
 * one widening to int32 a run of this many weight vectors instead of one a vector. Other 8-bit codes go in two 4-bit
 * halves (SPLIT). */
static inline int int16_run(const int BITS, const int SPLIT) { return BITS == 5 ? 4 : BITS == 8 && !SPLIT ? 2 : 8; }

/* Weight vector t of block b of panel p for this half's 8 rows, 4 codes each: the codes, or with SPLIT the low
 * nibbles of 8-bit codes (and their high nibbles in *high). A 5-bit code's fifth bit, for byte k of the vector, is
 * bit k % 8 of byte 4 half + k / 8 of the group's first mask (the low nibbles' codes, t even) or of its second. */
static inline __attribute__((always_inline)) __m256i weight_vector_avx2(const int BITS, const int BLOCK,
                                                                       const int SPLIT, const block_weight *w,
                                                                       long p, long b, int t, int half,
                                                                       __m256i *high) {
    const long K = w->cols, blocks = K / BLOCK;
    const __m256i low4 = _mm256_set1_epi8(15);
    if (BITS == 8) {
        const __m256i v = _mm256_loadu_si256(
            (const __m256i *)(w->codes + (p * (K / 4) + b * (BLOCK / 4) + t) * 64 + 32 * half));
        if (!SPLIT) return v;
        *high = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        return _mm256_and_si256(v, low4);
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)(w->codes + ((p * blocks + b) * 4 + t / 2) * 64 + 32 * half));
    __m256i codes = _mm256_and_si256(t % 2 ? _mm256_srli_epi16(v, 4) : v, low4);
    if (BITS == 5) {
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i masks = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(w->high + ((p * blocks + b) * 4 + t / 2) * 16)));
        const __m256i spread = _mm256_shuffle_epi8(
            masks, _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2,
                                                    2, 3, 3, 3, 3, 3, 3, 3, 3),
                                   _mm256_set1_epi8((char)(4 * half + 8 * (t % 2)))));
        codes = _mm256_or_si256(codes, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                                         _mm256_set1_epi8(16)));
    }
    return codes;
}

static inline __attribute__((always_inline)) void half_panel_avx2(const int BITS, const int BLOCK, const int SPLIT,
                                                                 const block_weight *w, const quantized_rows *x,
                                                                 long M, long from, long p, int half, float *y,
                                                                 long ldy) {
    const long blocks = w->cols / BLOCK;
    const int vectors = BLOCK / 4, run = int16_run(BITS, SPLIT);
    for (long b = 0; b < blocks; b++) {
        if (half == 0) prefetch_block(w, BITS, BLOCK, p * blocks + b + PREFETCH_BLOCKS); /* half 1 reads it again */
        /* the block's codes for this half's 8 rows: [t] as weight_vector_avx2 gives them, [8 + t] split codes' high
         * nibbles */
        __m256i unpacked[16];
        for (int t = 0; t < vectors; t++) unpacked[t] = weight_vector_avx2(BITS, BLOCK, SPLIT, w, p, b, t, half,
                                                                           &unpacked[8 + t]);
        const __m256 scale = _mm256_loadu_ps(w->scale + (p * blocks + b) * PANEL + 8 * half);
        const __m256 minimum = w->minimum ? _mm256_loadu_ps(w->minimum + (p * blocks + b) * PANEL + 8 * half) : scale;
        for (long i = from; i < M; i++) {
            const signed char *codes = row_codes(x, i, BLOCK, b);
            __m256i sum = w->offset ? _mm256_set1_epi32(x->corrections[b * x->rows + i]) : _mm256_setzero_si256();
            for (int first = 0; first < vectors; first += run) {
                __m256i low_pairs = _mm256_setzero_si256(), high_pairs = _mm256_setzero_si256();
                for (int t = first; t < first + run && t < vectors; t++) {
                    const __m256i xv = broadcast4(codes + 4 * t);
                    low_pairs = _mm256_add_epi16(low_pairs, _mm256_maddubs_epi16(unpacked[t], xv));
                    if (SPLIT) high_pairs = _mm256_add_epi16(high_pairs, _mm256_maddubs_epi16(unpacked[8 + t], xv));
                }
                sum = _mm256_add_epi32(sum, widen_pairs(low_pairs));
                if (SPLIT) sum = _mm256_add_epi32(sum, _mm256_slli_epi32(widen_pairs(high_pairs), 4));
            }
            float *out = y + i * ldy + p * PANEL + 8 * half;
            __m256 acc = b ? _mm256_loadu_ps(out) : _mm256_setzero_ps();
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(*row_scales(x, i, BLOCK, b))),
                                  acc);
            if (w->minimum) acc = _mm256_fmadd_ps(minimum, _mm256_set1_ps(x->scaled_sums[b * x->rows + i]), acc);
            _mm256_storeu_ps(out, acc);
        }
    }
}

/* One or two activation rows (a decoding step, a verification of two) through a whole panel: both halves at once,
 * their sums and accumulators in registers, each weight vector unpacked as it is used. The same operations per
 * output as half_panel_avx2. */
static inline __attribute__((always_inline)) void panel_rows_avx2(const int R, const int BITS, const int BLOCK,
                                                                 const int SPLIT, const block_weight *w,
                                                                 const quantized_rows *x, long i0, long p, float *y,
                                                                 long ldy) {
    const long blocks = w->cols / BLOCK;
    const int vectors = BLOCK / 4, run = int16_run(BITS, SPLIT);
    __m256 acc[2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        prefetch_block(w, BITS, BLOCK, p * blocks + b + PREFETCH_BLOCKS);
        __m256i sum[2][2];
        for (int r = 0; r < R; r++)
            sum[r][0] = sum[r][1] = w->offset ? _mm256_set1_epi32(x->corrections[b * x->rows + i0 + r])
                                              : _mm256_setzero_si256();
        for (int first = 0; first < vectors; first += run) {
            __m256i low_pairs[2][2], high_pairs[2][2];
            for (int r = 0; r < R; r++)
                low_pairs[r][0] = low_pairs[r][1] = high_pairs[r][0] = high_pairs[r][1] = _mm256_setzero_si256();
            for (int t = first; t < first + run && t < vectors; t++) {
                __m256i xv[2];
                for (int r = 0; r < R; r++) xv[r] = broadcast4(row_codes(x, i0 + r, BLOCK, b) + 4 * t);
                for (int half = 0; half < 2; half++) {
                    __m256i high = _mm256_setzero_si256();
                    const __m256i wt = weight_vector_avx2(BITS, BLOCK, SPLIT, w, p, b, t, half, &high);
                    for (int r = 0; r < R; r++) {
                        low_pairs[r][half] = _mm256_add_epi16(low_pairs[r][half], _mm256_maddubs_epi16(wt, xv[r]));
                        if (SPLIT)
                            high_pairs[r][half] = _mm256_add_epi16(high_pairs[r][half],
                                                                   _mm256_maddubs_epi16(high, xv[r]));
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int half = 0; half < 2; half++) {
                    sum[r][half] = _mm256_add_epi32(sum[r][half], widen_pairs(low_pairs[r][half]));
                    if (SPLIT)
                        sum[r][half] = _mm256_add_epi32(sum[r][half],
                                                        _mm256_slli_epi32(widen_pairs(high_pairs[r][half]), 4));
                }
        }
        for (int r = 0; r < R; r++) {
            const __m256 x_scale = _mm256_set1_ps(*row_scales(x, i0 + r, BLOCK, b));
            for (int half = 0; half < 2; half++) {
                const long at = (p * blocks + b) * PANEL + 8 * half;
                acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][half]),
                                               _mm256_mul_ps(_mm256_loadu_ps(w->scale + at), x_scale), acc[r][half]);
                if (w->minimum)
                    acc[r][half] = _mm256_fmadd_ps(_mm256_loadu_ps(w->minimum + at),
                                                   _mm256_set1_ps(x->scaled_sums[b * x->rows + i0 + r]), acc[r][half]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int half = 0; half < 2; half++) _mm256_storeu_ps(y + (i0 + r) * ldy + p * PANEL + 8 * half, acc[r][half]);
}

#define PANELS_AVX2(BITS, BLOCK)                                                                                   \
    static void panels_##BITS##_##BLOCK(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, \
                                        long from, long first, long end) {                                         \
        const int split = BITS == 8 && w->largest_code >= 64;                                                      \
        for (long p = first; p < end; p++) {                                                                       \
            if (M - from <= 2) { /* a step, or a verification of two */                                           \
                if (M - from == 1 && split) panel_rows_avx2(1, BITS, BLOCK, 1, w, x, from, p, y, ldy);             \
                else if (M - from == 1) panel_rows_avx2(1, BITS, BLOCK, 0, w, x, from, p, y, ldy);                 \
                else if (split) panel_rows_avx2(2, BITS, BLOCK, 1, w, x, from, p, y, ldy);                         \
                else panel_rows_avx2(2, BITS, BLOCK, 0, w, x, from, p, y, ldy);                                    \
                continue;                                                                                          \
            }                                                                                                      \
            for (int half = 0; half < 2; half++) {                                                                 \
                if (split) half_panel_avx2(BITS, BLOCK, 1, w, x, M, from, p, half, y, ldy);                        \
                else half_panel_avx2(BITS, BLOCK, 0, w, x, M, from, p, half, y, ldy);                              \
            }                                                                                                      \
        }                                                                                                          \
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

/* The fast versions' panels by weight form (tiles where granted and worth it); 0 where there are none (the
 * portable build) or none for the form. */
#ifdef FAST_PANELS
static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end, int tiles) {
#ifdef HAVE_TILES
    if (tiles && M >= TILE_MIN_ROWS) {
        if (w->block == 32 && w->bits == 4) tiles_4_32(w, x, y, ldy, M, first, end);
        else if (w->block == 32 && w->bits == 5) tiles_5_32(w, x, y, ldy, M, first, end);
        else if (w->block == 32 && w->bits == 8) tiles_8_32(w, x, y, ldy, M, first, end);
        else if (w->block == 16 && w->bits == 8) tiles_8_16(w, x, y, ldy, M, first, end);
        else return 0;
        return 1;
    }
#endif
    if (w->block == 32 && w->bits == 4) panels_4_32(w, x, y, ldy, M, 0, first, end);
    else if (w->block == 32 && w->bits == 5) panels_5_32(w, x, y, ldy, M, 0, first, end);
    else if (w->block == 32 && w->bits == 8) panels_8_32(w, x, y, ldy, M, 0, first, end);
    else if (w->block == 16 && w->bits == 8) panels_8_16(w, x, y, ldy, M, 0, first, end);
    else return 0;
    return 1;
}
#else
static int panels_fast(const block_weight *w, const quantized_rows *x, float *y, long ldy, long M, long first,
                       long end, int tiles) {
    return 0;
}
#endif

#ifndef HAVE_TILES
static int tiles_usable(void) { return 0; }
#endif

/* "avx512-vnni", "avx2" or "portable", with "+amx" where the tile products run. */
const char *block_gemm_version(void) { return tiles_usable() ? "avx512-vnni+amx" : VERSION; }

/* Whether the tile products may run (they do where the CPU and the kernel allow); returns whether they now do. */
int block_gemm_use_tiles(int allowed) {
#ifdef HAVE_TILES
    tiles_allowed = allowed;
#else
    (void)allowed;
#endif
    return tiles_usable();
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
    if (M > ROW_CHUNK) { /* a prefill's rows in chunks whose codes stay in the caches across the weight's panels */
        for (long r = 0; r < M; r += ROW_CHUNK)
            block_gemm(parts, count, x + r * K, M - r < ROW_CHUNK ? M - r : ROW_CHUNK, K, y + r * ldy, ldy, parallel,
                       portable);
        return;
    }
    const long rows = M, blocks32 = K / X_BLOCK;
    const size_t code_bytes = (size_t)(rows * K + 63) / 64 * 64, per_block = (size_t)(rows * blocks32);
    char *buffer = rows_scratch(code_bytes + sizeof(float) * 2 * per_block + sizeof(int) * 4 * per_block);
    signed char *codes = (signed char *)buffer;
    float *scales = (float *)(buffer + code_bytes), *scaled_sums = scales + per_block;
    int *sums16 = (int *)(scaled_sums + per_block), *corrections = sums16 + 2 * per_block;
    quantize_rows_q8(x, M, K, rows, codes, scales, sums16, scaled_sums, portable);
    const quantized_rows q = {codes, scales, scaled_sums, corrections, rows};
    const int tiles = !portable && tiles_usable(); /* asked here, before the threads start */
    long column = 0;
    for (long c = 0; c < count; c++) {
        const block_weight *w = &parts[c];
        const long panels = w->rows / PANEL, blocks = K / w->block;
        for (long b = 0; b < blocks; b++) /* minus the weight's integer offset times each block's sum of codes */
            for (long m = 0; m < rows; m++)
                corrections[b * rows + m] = -w->offset * (w->block == 16 ? sums16[b * rows + m]
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
            if (portable || !panels_fast(w, &q, out, ldy, M, first, end, tiles))
                panels_portable(w, &q, out, ldy, M, first, end);
        }
        column += w->rows;
    }
}
