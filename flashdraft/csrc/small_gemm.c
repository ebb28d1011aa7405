/* y[M, N] = x[M, K] @ w[N, K]^T for the few rows of a speculative step (1 to 32): flashdraft's native kernel.
 *
 * BLAS libraries pack the weight matrix on every call with two rows or more, which costs as much as the product
 * itself at these shapes (BENCHMARKS.md, "CPU engine"). Here every weight is read from memory once, straight from
 * its row-major [N, K] layout: tiles of 4 weight rows against up to 4 input rows, accumulated in vector registers,
 * with the next tile prefetched so that the memory stream overlaps the arithmetic. Up to 4 rows cost what one
 * costs; above that the product is bound by arithmetic.
 *
 * Each output is summed in one fixed order (the K lanes of a vector in turn, a fixed tree across the lanes, then
 * the remainder of K), whatever M and whichever tile computes it: a row's result does not depend on the other rows
 * of the call (tests/test_native.py checks it).
 *
 * Written with GCC's vector extensions, so one source compiles to AVX-512, AVX2 or NEON by -march=native.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

#define LANES 16
#define TILE_ROWS 4 /* weight rows per tile, and input rows per tile */

/* Pins a value to a vector register. Without it GCC folds each weight load into every multiply-add that uses it,
 * loading a weight once per input row: twice the loads, and split ones on weights that are not 64-byte aligned.
 * Only where a whole vector of 16 floats fits one register (AVX-512); elsewhere a hint the compiler may ignore.
 * ROUNDED(v) makes v an opaque value, so that it is rounded before its next use: no fused multiply-add across it. */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#define ROUNDED(v) IN_REGISTER(v)
#else
#define IN_REGISTER(v) ((void)0)
#define ROUNDED(v) __asm__("" : "+m"(v))
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline float lane_sum(vec v) {
    vec8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vec4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* MR input rows against NR weight rows; MR and NR are constants at every call, so the loops unroll into
 * registers. */
static inline __attribute__((always_inline)) void tile(const int MR, const int NR, const float *x, const float *w,
                                                        float *y, size_t N, size_t K) {
    vec acc[TILE_ROWS][TILE_ROWS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (vec){0};
    const size_t whole = K / LANES * LANES;
    for (size_t k = 0; k < whole; k += LANES) {
        vec wv[TILE_ROWS];
        for (int j = 0; j < NR; j++) {
            wv[j] = load(w + j * K + k);
            IN_REGISTER(wv[j]);
            /* the same part of the next tile's rows; past the end of w it is a harmless hint */
            __builtin_prefetch(w + (j + TILE_ROWS) * K + k, 0, 0);
        }
        for (int i = 0; i < MR; i++) {
            const vec xv = load(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float sum = lane_sum(acc[i][j]);
            for (size_t k = whole; k < K; k++) sum += x[i * K + k] * w[j * K + k];
            y[i * N + j] = sum;
        }
}

#define ALL_INPUT_ROWS(NR)                                                                          \
    static void all_input_rows_##NR(const float *x, const float *w, float *y, size_t M, size_t N,   \
                                    size_t K) {                                                     \
        size_t m = 0;                                                                               \
        for (; m + TILE_ROWS <= M; m += TILE_ROWS) tile(TILE_ROWS, NR, x + m * K, w, y + m * N, N, K); \
        switch (M - m) {                                                                            \
        case 3: tile(3, NR, x + m * K, w, y + m * N, N, K); break;                                  \
        case 2: tile(2, NR, x + m * K, w, y + m * N, N, K); break;                                  \
        case 1: tile(1, NR, x + m * K, w, y + m * N, N, K); break;                                  \
        }                                                                                           \
    }
ALL_INPUT_ROWS(4)
ALL_INPUT_ROWS(1)

static void weight_tiles(const float *x, const float *w, float *y, long M, long N, long K, long first, long end) {
    for (long t = first; t < end; t++) all_input_rows_4(x, w + t * TILE_ROWS * K, y + t * TILE_ROWS, M, N, K);
}

static void remainder_rows(const float *x, const float *w, float *y, long M, long N, long K) {
    for (long n = N / TILE_ROWS * TILE_ROWS; n < N; n++) all_input_rows_1(x, w + n * K, y + n, M, N, K);
}

/* On the calling thread alone: on a machine whose other cores are busy, waking threads costs more than it saves. */
void small_gemm(const float *x, const float *w, float *y, long M, long N, long K) {
    weight_tiles(x, w, y, M, N, K, 0, N / TILE_ROWS);
    remainder_rows(x, w, y, M, N, K);
}

/* The weight tiles shared out among the process's OpenMP threads: torch's own pool, since torch loads its libgomp
 * first. Compiled without OpenMP, the same as small_gemm. */
void small_gemm_parallel(const float *x, const float *w, float *y, long M, long N, long K) {
    const long tiles = N / TILE_ROWS;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) weight_tiles(x, w, y, M, N, K, t, t + 1);
    remainder_rows(x, w, y, M, N, K);
}

/* Packed weights: the same float32 values in fewer bytes, for weights that hold them exactly (native.py's `pack`
 * checks every element). A weight loaded from a quantized checkpoint (GGUF's Q4_1 and Q8_0, dequantized to float32)
 * or a bfloat16 one is a fraction of its float32 bytes, and a product of a few rows is bound by those bytes. Each
 * vector of weights is unpacked into float32 in registers where `tile` would load it, and multiplied in the same
 * order: the result is the float32 kernel's, bit for bit.
 *
 *   bf16: the upper half of each float32 (uint16 [N, K]).
 *   q8_0: w = q * d, an int8 q per weight and a float32 d per 32 weights along K (GGUF's Q8_0 dequantized).
 *   q4_1: w = (d * q) + m, rounded after the product and after the sum as GGUF's dequantization does, never
 *         fused; a 4-bit q per weight (byte i of a block of 32: q[i] low, q[i + 16] high) and float32 d and m per
 *         32 weights. */
enum { BF16 = 1, Q8_0 = 2, Q4_1 = 3 };
#define BLOCK 32

typedef int i32v __attribute__((vector_size(LANES * sizeof(int))));

/* 16 narrow integers widened to 32 bits. GCC lowers __builtin_convertvector from 8- or 16-bit lanes to scalar code,
 * hence the intrinsics; other CPUs take the plain loop, which compilers vectorize well enough. */
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define WIDEN(NAME, TYPE, CVT512, LOAD512, CVT256, LOAD256)                                                        \
    static inline i32v NAME(const TYPE *p) {                                                                       \
        const __m512i wide = CVT512(LOAD512((const void *)p));                                                     \
        i32v v;                                                                                                    \
        memcpy(&v, &wide, sizeof v);                                                                               \
        return v;                                                                                                  \
    }
#elif defined(__AVX2__)
#define WIDEN(NAME, TYPE, CVT512, LOAD512, CVT256, LOAD256)                                                        \
    static inline i32v NAME(const TYPE *p) {                                                                       \
        const __m256i low = CVT256(LOAD256((const void *)p)), high = CVT256(LOAD256((const void *)(p + 8)));      \
        i32v v;                                                                                                    \
        memcpy(&v, &low, sizeof low);                                                                              \
        memcpy((char *)&v + sizeof low, &high, sizeof high);                                                       \
        return v;                                                                                                  \
    }
#else
#define WIDEN(NAME, TYPE, CVT512, LOAD512, CVT256, LOAD256)                                                        \
    static inline i32v NAME(const TYPE *p) {                                                                       \
        i32v v;                                                                                                    \
        for (int i = 0; i < LANES; i++) v[i] = p[i];                                                               \
        return v;                                                                                                  \
    }
#endif
WIDEN(widen_u8, unsigned char, _mm512_cvtepu8_epi32, _mm_loadu_si128, _mm256_cvtepu8_epi32, _mm_loadl_epi64)
WIDEN(widen_i8, signed char, _mm512_cvtepi8_epi32, _mm_loadu_si128, _mm256_cvtepi8_epi32, _mm_loadl_epi64)
WIDEN(widen_u16, unsigned short, _mm512_cvtepu16_epi32, _mm256_loadu_si256, _mm256_cvtepu16_epi32, _mm_loadu_si128)

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* Lanes k..k+15 of row n of a packed weight, as float32 (k a multiple of 16). FORMAT is a constant at every call. */
static inline __attribute__((always_inline)) vec weight_lanes(const int FORMAT, const void *data, const float *scale,
                                                             const float *minimum, long n, long k, long K) {
    if (FORMAT == BF16) {
        const i32v bits = widen_u16((const unsigned short *)data + n * K + k) << 16;
        vec v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    const long block = n * (K / BLOCK) + k / BLOCK;
    if (FORMAT == Q8_0)
        return __builtin_convertvector(widen_i8((const signed char *)data + n * K + k), vec) * scale[block];
    const i32v q = widen_u8((const unsigned char *)data + n * (K / 2) + k / BLOCK * (BLOCK / 2));
    vec w = __builtin_convertvector(k % BLOCK ? q >> 4 : q & 15, vec) * scale[block];
    ROUNDED(w); /* the product rounded before the sum, as GGUF's dequantization does */
    return w + minimum[block];
}

static size_t row_bytes(int format, long K) { return format == BF16 ? 2 * K : format == Q8_0 ? K : K / 2; }

/* Up to 4 input rows against 4 packed weight rows, unpacked straight into registers: `tile` with another load. */
static inline __attribute__((always_inline)) void packed_tile(const int FORMAT, const int MR, const float *x,
                                                             const void *data, const float *scale,
                                                             const float *minimum, long n, float *y, long N, long K) {
    vec acc[TILE_ROWS][TILE_ROWS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_ROWS; j++) acc[i][j] = (vec){0};
    const char *next = (const char *)data + (n + TILE_ROWS) * row_bytes(FORMAT, K);
    for (long k = 0; k < K; k += LANES) {
        vec wv[TILE_ROWS];
        for (int j = 0; j < TILE_ROWS; j++) {
            wv[j] = weight_lanes(FORMAT, data, scale, minimum, n + j, k, K);
            IN_REGISTER(wv[j]);
        }
        if (k % 64 == 0) /* the next tile's bytes; past the end of the weight a harmless hint */
            for (int j = 0; j < TILE_ROWS; j++)
                __builtin_prefetch(next + j * row_bytes(FORMAT, K) + k * row_bytes(FORMAT, K) / K, 0, 0);
        for (int i = 0; i < MR; i++) {
            const vec xv = load(x + i * K + k);
            for (int j = 0; j < TILE_ROWS; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < TILE_ROWS; j++) y[i * N + n + j] = lane_sum(acc[i][j]);
}

/* Weight tiles first..end-1 against all M rows, 4 at a time: each tile is unpacked again for every 4 rows, from
 * bytes in the L1 cache by then, which costs less than a trip through a float32 buffer. */
#define PACKED_TILES(FORMAT)                                                                                       \
    static void packed_tiles_##FORMAT(const float *x, const void *data, const float *scale, const float *minimum, \
                                      float *y, long M, long N, long K, long first, long end) {                   \
        for (long t = first; t < end; t++)                                                                         \
            for (long m = 0; m < M; m += TILE_ROWS) {                                                              \
                const float *xm = x + m * K;                                                                       \
                float *ym = y + m * N;                                                                             \
                switch (M - m < TILE_ROWS ? M - m : TILE_ROWS) {                                                   \
                case 4: packed_tile(FORMAT, 4, xm, data, scale, minimum, t * TILE_ROWS, ym, N, K); break;          \
                case 3: packed_tile(FORMAT, 3, xm, data, scale, minimum, t * TILE_ROWS, ym, N, K); break;          \
                case 2: packed_tile(FORMAT, 2, xm, data, scale, minimum, t * TILE_ROWS, ym, N, K); break;          \
                case 1: packed_tile(FORMAT, 1, xm, data, scale, minimum, t * TILE_ROWS, ym, N, K); break;          \
                }                                                                                                  \
            }                                                                                                      \
    }
PACKED_TILES(BF16)
PACKED_TILES(Q8_0)
PACKED_TILES(Q4_1)

static void packed_tiles(int format, const float *x, const void *data, const float *scale, const float *minimum,
                         float *y, long M, long N, long K, long first, long end) {
    if (format == BF16) packed_tiles_BF16(x, data, scale, minimum, y, M, N, K, first, end);
    else if (format == Q8_0) packed_tiles_Q8_0(x, data, scale, minimum, y, M, N, K, first, end);
    else packed_tiles_Q4_1(x, data, scale, minimum, y, M, N, K, first, end);
}

/* The last N % 4 weight rows, one at a time through a buffer. */
static void packed_remainder(int format, const float *x, const void *data, const float *scale, const float *minimum,
                             float *y, long M, long N, long K) {
    float buffer[K] __attribute__((aligned(64)));
    for (long n = N / TILE_ROWS * TILE_ROWS; n < N; n++) {
        for (long k = 0; k < K; k += LANES)
            store(buffer + k, format == BF16   ? weight_lanes(BF16, data, scale, minimum, n, k, K)
                              : format == Q8_0 ? weight_lanes(Q8_0, data, scale, minimum, n, k, K)
                                               : weight_lanes(Q4_1, data, scale, minimum, n, k, K));
        all_input_rows_1(x, buffer, y + n, M, N, K);
    }
}

/* y[M, N] = x[M, K] @ w[N, K]^T for a packed w; `scale` and `minimum` are NULL where the format has none. */
void packed_gemm(int format, const float *x, const void *data, const float *scale, const float *minimum, float *y,
                 long M, long N, long K) {
    packed_tiles(format, x, data, scale, minimum, y, M, N, K, 0, N / TILE_ROWS);
    packed_remainder(format, x, data, scale, minimum, y, M, N, K);
}

/* One contiguous run of weight tiles per thread, so that each prefetches its own next tile. */
static long thread_chunks(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

void packed_gemm_parallel(int format, const float *x, const void *data, const float *scale, const float *minimum,
                          float *y, long M, long N, long K) {
    const long tiles = N / TILE_ROWS;
    const long chunks = thread_chunks();
#pragma omp parallel for schedule(static)
    for (long c = 0; c < chunks; c++)
        packed_tiles(format, x, data, scale, minimum, y, M, N, K, c * tiles / chunks, (c + 1) * tiles / chunks);
    packed_remainder(format, x, data, scale, minimum, y, M, N, K);
}

/* Products in bfloat16 arithmetic, for a draft (whose proposals never change what is generated, only how many are
 * accepted): y[M, N] = x[M, K] @ w[N, K]^T with x already rounded to bfloat16 and a bfloat16 w, each pair of
 * products summed into float32 by AVX-512 BF16's dot-product instruction: twice the multiply-adds of a float32
 * vector instruction and no unpacking, where a draft's products of 8 rows are bound by arithmetic. K must be a
 * multiple of 32. Only built where the compiler targets AVX512_BF16; `bf16_dot_available` says so. */
#if defined(__AVX512BF16__)
int bf16_dot_available(void) { return 1; }

static inline __attribute__((always_inline)) void dot_tile(const int MR, const int NR, const unsigned short *x,
                                                          const unsigned short *w, long n, float *y, long N, long K) {
    __m512 acc[TILE_ROWS][TILE_ROWS];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 2 * LANES) {
        __m512bh wv[TILE_ROWS];
        for (int j = 0; j < NR; j++) {
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + (n + j) * K + k));
            __builtin_prefetch(w + (n + j + TILE_ROWS) * K + k, 0, 0);
        }
        for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * K + k));
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * N + n + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define DOT_ROWS(NR)                                                                                              \
    static void dot_rows_##NR(const unsigned short *x, const unsigned short *w, long n, float *y, long M, long N, \
                              long K) {                                                                           \
        for (long m = 0; m < M; m += TILE_ROWS) {                                                                 \
            const unsigned short *xm = x + m * K;                                                                 \
            float *ym = y + m * N;                                                                                \
            switch (M - m < TILE_ROWS ? M - m : TILE_ROWS) {                                                      \
            case 4: dot_tile(4, NR, xm, w, n, ym, N, K); break;                                                   \
            case 3: dot_tile(3, NR, xm, w, n, ym, N, K); break;                                                   \
            case 2: dot_tile(2, NR, xm, w, n, ym, N, K); break;                                                   \
            case 1: dot_tile(1, NR, xm, w, n, ym, N, K); break;                                                   \
            }                                                                                                     \
        }                                                                                                         \
    }
DOT_ROWS(4)
DOT_ROWS(1)

static void dot_tiles(const unsigned short *x, const unsigned short *w, float *y, long M, long N, long K, long first,
                      long end) {
    for (long t = first; t < end; t++) dot_rows_4(x, w, t * TILE_ROWS, y, M, N, K);
}

void bf16_dot_gemm(const unsigned short *x, const unsigned short *w, float *y, long M, long N, long K) {
    dot_tiles(x, w, y, M, N, K, 0, N / TILE_ROWS);
    for (long n = N / TILE_ROWS * TILE_ROWS; n < N; n++) dot_rows_1(x, w, n, y, M, N, K);
}

void bf16_dot_gemm_parallel(const unsigned short *x, const unsigned short *w, float *y, long M, long N, long K) {
    const long tiles = N / TILE_ROWS;
    const long chunks = thread_chunks();
#pragma omp parallel for schedule(static)
    for (long c = 0; c < chunks; c++) dot_tiles(x, w, y, M, N, K, c * tiles / chunks, (c + 1) * tiles / chunks);
    for (long n = tiles * TILE_ROWS; n < N; n++) dot_rows_1(x, w, n, y, M, N, K);
}
#else
int bf16_dot_available(void) { return 0; }
void bf16_dot_gemm(const unsigned short *x, const unsigned short *w, float *y, long M, long N, long K) {}
void bf16_dot_gemm_parallel(const unsigned short *x, const unsigned short *w, float *y, long M, long N, long K) {}
#endif

/* RMSNorm, the engine's one operator between products: for M positions of `groups` rows of D floats each (row g of
 * position m at x + m * stride + g * D: a model's hidden states with groups 1, or the q and k heads of a q/k/v
 * product, whose v heads sit between positions), y[m, g] = x * (1 / sqrt(mean(x^2) + eps)) * w[g], y contiguous.
 * torch's takes ~30 us for one row of 576 here (a chain of small kernels); this, a microsecond. The sum of squares
 * runs in float32 lanes, then across them: the result is torch's within float32 rounding, not bit for bit. */
void rms_norm(const float *x, long stride, const float *w, long groups, float *y, long M, long D, float eps) {
    for (long m = 0; m < M; m++)
        for (long g = 0; g < groups; g++) {
            const float *row = x + m * stride + g * D, *weight = w + g * D;
            float *out = y + (m * groups + g) * D;
            vec squares = {0};
            long d = 0;
            for (; d + LANES <= D; d += LANES) {
                const vec v = load(row + d);
                squares += v * v;
            }
            float sum = lane_sum(squares);
            for (; d < D; d++) sum += row[d] * row[d];
            const float scale = 1.0f / __builtin_sqrtf(sum / (float)D + eps);
            for (d = 0; d < D; d++) out[d] = weight[d] * (row[d] * scale);
        }
}

/* Lane by lane, `mask` (all ones or zero per lane, from a comparison) ? a : b. */
static inline vec select_lanes(i32v mask, vec a, vec b) {
    i32v ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const i32v chosen = (mask & ia) | (~mask & ib);
    vec result;
    memcpy(&result, &chosen, sizeof result);
    return result;
}

/* e^x in float32 lanes, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact;
 * n rounded to nearest by adding and removing 1.5 * 2^23), e^r by its Taylor series to r^7 in Horner form, 2^n put
 * straight into the exponent bits. Below -87 it is 0 (softmax weights that small vanish beside the largest, 1). */
static inline vec exp_lanes(vec x) {
    const vec zero = {0}, low = zero - 87.0f, high = zero + 88.0f, round = zero + 12582912.0f;
    const i32v underflow = x < low;
    x = select_lanes(underflow, low, select_lanes(x > high, high, x));
    const vec n = (x * 1.44269504088896341f + round) - round;
    const vec r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    vec p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i32v bits = (__builtin_convertvector(n, i32v) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return select_lanes(underflow, zero, p * scale);
}

#define MAX_HEAD_VECTORS 8 /* head_dim 64 or 128: vectors of 16 floats, a constant in each compiled copy */
#define TILE_QUERIES 4      /* queries that share each key and value read */

/* Lane t of the result = the sum of the lanes of d[t], for 16 vectors at once: a tree of shuffles and adds (15 of
 * each, against ~6 per vector one at a time). The tree leaves the sums in bit-reversed lane order, so the caller
 * stores the vector for key t in d[REVERSED[t]]. */
static const int REVERSED[LANES] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

#define SUMS_OF_16(NAME, TYPE)                                                                                    \
    static inline TYPE NAME(const TYPE *d) {                                                                      \
        TYPE e[8], f[4], g[2];                                                                                    \
        for (int k = 0; k < 8; k++)                                                                               \
            e[k] = __builtin_shufflevector(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, \
                                           22, 23) +                                                              \
                   __builtin_shufflevector(d[2 * k], d[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27,   \
                                           28, 29, 30, 31);                                                       \
        for (int k = 0; k < 4; k++)                                                                               \
            f[k] = __builtin_shufflevector(e[2 * k], e[2 * k + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24,   \
                                           25, 26, 27) +                                                          \
                   __builtin_shufflevector(e[2 * k], e[2 * k + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, \
                                           29, 30, 31);                                                           \
        for (int k = 0; k < 2; k++)                                                                               \
            g[k] = __builtin_shufflevector(f[2 * k], f[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12,   \
                                           13, 28, 29) +                                                          \
                   __builtin_shufflevector(f[2 * k], f[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, \
                                           15, 30, 31);                                                           \
        return __builtin_shufflevector(g[0], g[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +   \
               __builtin_shufflevector(g[0], g[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);    \
    }
SUMS_OF_16(sums_of_16, vec)

static const vec LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

static inline vec lanes_max(vec a, vec b) { return select_lanes(a > b, a, b); }

static inline float lane_max(vec v) {
    v = lanes_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = lanes_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = lanes_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = lanes_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

/* Up to TILE_QUERIES query heads that read the same key/value head, against its cached keys and values
 * ([position, head_dim] rows): query r sees keys 0..limit[r]-1. softmax(q k^T * scale) v by the online softmax over
 * chunks of LANES keys (the running maximum rescales what was summed before), so no score buffer grows with the
 * context; each key and value row is read once for all the tile's queries. */
static inline __attribute__((always_inline)) void attend_tile(const int MQ, const int VECTORS, const float *const *q,
                                                              const float *k, const float *v, float *const *out,
                                                              const long *limit, float scale) {
    const long vectors = VECTORS, head_dim = VECTORS * LANES;
    vec query[TILE_QUERIES][MAX_HEAD_VECTORS], acc[TILE_QUERIES][MAX_HEAD_VECTORS];
    float running_max[TILE_QUERIES], total[TILE_QUERIES];
    long keys = 0;
    for (int r = 0; r < MQ; r++) {
        for (long d = 0; d < vectors; d++) {
            query[r][d] = load(q[r] + d * LANES) * scale;
            acc[r][d] = (vec){0};
        }
        running_max[r] = -__builtin_inff();
        total[r] = 0.0f;
        keys = limit[r] > keys ? limit[r] : keys;
    }
    for (long first = 0; first < keys; first += LANES) {
        const long count = keys - first < LANES ? keys - first : LANES;
        vec dots[TILE_QUERIES][LANES];
        for (long t = 0; t < LANES; t++) {
            const float *key = k + (first + (t < count ? t : 0)) * head_dim;
            for (int r = 0; r < MQ; r++) dots[r][REVERSED[t]] = query[r][0] * load(key);
            for (long d = 1; d < vectors; d++) {
                const vec kd = load(key + d * LANES);
                for (int r = 0; r < MQ; r++) dots[r][REVERSED[t]] += query[r][d] * kd;
            }
        }
        vec weights[TILE_QUERIES];
        for (int r = 0; r < MQ; r++) {
            vec scores = sums_of_16(dots[r]);
            if (limit[r] - first < LANES) /* keys of this chunk that query r does not see */
                scores = select_lanes(LANE_INDEX >= (float)(limit[r] - first), (vec){0} - __builtin_inff(), scores);
            const float chunk_max = lane_max(scores);
            if (chunk_max > running_max[r]) {
                const float rescale = exp_lanes((vec){0} + (running_max[r] - chunk_max))[0];
                for (long d = 0; d < vectors; d++) acc[r][d] *= rescale;
                total[r] *= rescale;
                running_max[r] = chunk_max;
            }
            weights[r] = exp_lanes(scores - running_max[r]); /* 0 where the score is -inf */
            total[r] += lane_sum(weights[r]);
        }
        for (long t = 0; t < count; t++) {
            const float *value = v + (first + t) * head_dim;
            for (long d = 0; d < vectors; d++) {
                const vec vd = load(value + d * LANES);
                for (int r = 0; r < MQ; r++) acc[r][d] += weights[r][t] * vd;
            }
        }
    }
    for (int r = 0; r < MQ; r++)
        for (long d = 0; d < vectors; d++) store(out[r] + d * LANES, acc[r][d] / total[r]);
}

/* Causal attention for the few queries of a decoding step over a cache laid out [batch, kv_heads, capacity,
 * head_dim]: query i of each row sits at position start + i and sees keys 0..start+i (a block sees the cache and
 * itself up to its own position), or with `causal` 0 every key up to start+n-1 (a DFlash draft's block, which sees
 * all of itself); query head h reads key/value head h / (heads / kv_heads). Queries [batch * n,
 * heads, head_dim] with `query_stride` floats between rows; out [batch * n, heads * head_dim]. `first_key`
 * [batch] (or NULL: all 0): the first key each row sees, after its left padding. The work goes in
 * tiles of up to TILE_QUERIES (query, head) pairs of one key/value head, shared among threads when `parallel`.
 * head_dim must be 64 or 128. */
void causal_attention(const float *q, const float *k, const float *v, float *out, long batch, long n, long heads,
                      long kv_heads, long head_dim, long query_stride, long capacity, long start, const long *first_key,
                      float scale, int causal, int parallel) {
    const long group = heads / kv_heads, per_head = n * group; /* the queries of one key/value head */
    const long tiles_per_head = (per_head + TILE_QUERIES - 1) / TILE_QUERIES;
    const long tiles = batch * kv_heads * tiles_per_head;
#pragma omp parallel for schedule(static) if (parallel)
    for (long tile = 0; tile < tiles; tile++) {
        const long b = tile / (kv_heads * tiles_per_head), kv = tile / tiles_per_head % kv_heads;
        const long first = tile % tiles_per_head * TILE_QUERIES;
        const int count = per_head - first < TILE_QUERIES ? per_head - first : TILE_QUERIES;
        const float *queries[TILE_QUERIES];
        float *outs[TILE_QUERIES];
        long limits[TILE_QUERIES];
        for (int r = 0; r < count; r++) { /* the tile's r-th query: query position i, head h */
            const long i = (first + r) / group, h = kv * group + (first + r) % group, row = b * n + i;
            queries[r] = q + row * query_stride + h * head_dim;
            outs[r] = out + (row * heads + h) * head_dim;
            limits[r] = causal ? start + i + 1 : start + n;
        }
        /* A left-padded row's keys begin at its first token: the padding is never read, and the row's sums run
         * in the same chunks as the row's alone would. */
        const long begin = first_key != NULL ? first_key[b] : 0;
        for (int r = 0; r < count; r++) limits[r] -= begin;
        const float *keys = k + ((b * kv_heads + kv) * capacity + begin) * head_dim;
        const float *values = v + ((b * kv_heads + kv) * capacity + begin) * head_dim;
        const int shape = count * 10 + (int)(head_dim / LANES); /* one compiled copy per (queries, head_dim) */
        switch (shape) {
        case 44: attend_tile(4, 4, queries, keys, values, outs, limits, scale); break;
        case 34: attend_tile(3, 4, queries, keys, values, outs, limits, scale); break;
        case 24: attend_tile(2, 4, queries, keys, values, outs, limits, scale); break;
        case 14: attend_tile(1, 4, queries, keys, values, outs, limits, scale); break;
        case 48: attend_tile(4, 8, queries, keys, values, outs, limits, scale); break;
        case 38: attend_tile(3, 8, queries, keys, values, outs, limits, scale); break;
        case 28: attend_tile(2, 8, queries, keys, values, outs, limits, scale); break;
        case 18: attend_tile(1, 8, queries, keys, values, outs, limits, scale); break;
        }
    }
}

/* Rotary position embedding of the q and k heads, with their RMSNorm first where the model has one (`w` [groups,
 * D], or NULL): for M positions of `groups` rows of D floats (row g of position m at x + m * stride + g * D, as the
 * q and k heads sit in a q/k/v product), v the row (normalized), y[m, g, d] = v[d] cos[m, d] + v[d +- D/2]
 * sin[m, d], with the sine table's first half negated (rotate_half as a roll). One pass where torch runs three
 * or four operators; torch's result within float32 rounding. D even, at most 256. */
void norm_rotary(const float *x, long stride, const float *w, long groups, float eps, const float *cos,
                 const float *sin, float *y, long M, long D) {
    const long half = D / 2;
    float normed[256];
    for (long m = 0; m < M; m++)
        for (long g = 0; g < groups; g++) {
            const float *row = x + m * stride + g * D, *c = cos + m * D, *s = sin + m * D;
            float *out = y + (m * groups + g) * D;
            if (w != NULL) {
                rms_norm(row, D, w + g * D, 1, normed, 1, D, eps);
                row = normed;
            }
            for (long d = 0; d < half; d++) out[d] = row[d] * c[d] + row[d + half] * s[d];
            for (long d = half; d < D; d++) out[d] = row[d] * c[d] + row[d - half] * s[d];
        }
}

/* SwiGLU's product: y[m, j] = silu(g) * u with g = x[m, j], u = x[m, F + j] (a fused gate/up projection's output
 * [M, 2F]), silu(g) = g / (1 + e^-g). One pass where torch runs three operators (chunk, silu, mul); e^-g within
 * ~2 ulp of expf, so the result is torch's within float32 rounding. */
void swiglu(const float *x, float *y, long M, long F) {
    for (long m = 0; m < M; m++) {
        const float *gate = x + m * 2 * F, *up = gate + F;
        float *out = y + m * F;
        long j = 0;
        for (; j + LANES <= F; j += LANES) {
            const vec g = load(gate + j);
            store(out + j, g / (1.0f + exp_lanes(-g)) * load(up + j));
        }
        for (; j < F; j++) out[j] = gate[j] / (1.0f + __builtin_expf(-gate[j])) * up[j];
    }
}

/* A whole decoder layer in one call, for the few rows of a decoding step, where Python ran ~30 operators a layer
 * (their overhead was a fifth of a target's one-token step and half a draft's pass). Rows h [block, d] (updated in
 * place) over a window [context ; RMSNorm(h)]: `context` [width, d] rows already normalized that join the keys and
 * values but not the queries (a DFlash draft's new context; width 0 for a target). The window goes through q/k/v
 * (+ bias), q and k heads get their norms (`qk_norm` [heads + kv_heads, head_dim], or NULL) and rotary (`cos`,
 * `sin` [width + block, head_dim], the sine's first half negated), the window's keys and values are written to the
 * layer's cache [kv_heads, capacity, head_dim] at positions start..start+width+block-1, h's queries attend over the
 * cache up to their own position (`causal`) or to the window's end (a draft's block), then h += o(attended),
 * h += down(swiglu(gate_up(RMSNorm(h)))). The same kernels in the same order as the operator-by-operator pass: the
 * same result bit for bit. Several sequences (`batch`, without a context): h holds each one's block in turn, the
 * cache [batch, kv_heads, capacity, head_dim], `cos`/`sin` a row per window row, and `first_key` [batch] (or NULL)
 * the first cache position each sequence sees (after its left padding): each row's result is the one it would get
 * alone. Bits of `parallel` share among threads: 1 q/k/v, 2 o, 4 gate/up, 8 down, 16 attention. */
typedef struct { /* a product's weight in a form the kernels read */
    int format;          /* 0 float32 [rows, K]; BF16, Q8_0, Q4_1 packed exactly;
                            BLOCKS: `parts` GGUF-block weights (block_gemm.c), `data` pointing to them */
    const void *data;
    const float *scale;  /* the packed formats' scales */
    const void *extra;   /* Q4_1's minimums */
    long rows;
    long parts;
} layer_weight;

enum { FLOAT32 = 0, BLOCKS = 5 };

typedef struct {
    const float *input_norm, *post_norm, *qk_norm, *qkv_bias;
    layer_weight qkv, o, gate_up, down;
} decoder_layer_weights;

static void layer_product(const float *x, const layer_weight *w, float *y, long M, long K, int parallel) {
    if (w->format == FLOAT32) (parallel ? small_gemm_parallel : small_gemm)(x, w->data, y, M, w->rows, K);
    else if (w->format == BLOCKS) block_gemm(w->data, w->parts, x, M, K, y, w->rows, parallel, 0);
    else (parallel ? packed_gemm_parallel : packed_gemm)(w->format, x, w->data, w->scale, w->extra, y, M, w->rows, K);
}

/* The calling thread's scratch for a layer's intermediates, kept between calls and grown as needed: a buffer
 * malloc'd and freed every call was returned to the system and faulted in again page by page (~0.1 ms a layer).
 * On cache lines, each part too: a product's input rows are read once per weight tile, and vectors that straddle
 * two lines cost two loads (a step of 8 rows was slower than torch's 64-byte-aligned tensors). */
enum { LAYER_SCRATCH, PASS_SCRATCH, SCRATCHES }; /* a layer's intermediates; a whole draft pass's, around them */

static float *scratch(int slot, size_t floats) {
    static __thread float *buffers[SCRATCHES];
    static __thread size_t held[SCRATCHES];
    if (floats > held[slot]) {
        free(buffers[slot]);
        buffers[slot] = aligned_alloc(64, sizeof(float) * ((floats + LANES - 1) / LANES * LANES));
        held[slot] = floats;
    }
    return buffers[slot];
}

static void add_into(float *h, const float *update, long count) {
    for (long i = 0; i < count; i++) h[i] += update[i];
}

void decoder_layer(const decoder_layer_weights *layer, float *keys, float *values, float *h, const float *context,
                   long batch, long width, long block, long d, long heads, long kv_heads, long head_dim,
                   const float *cos, const float *sin, long capacity, long start, const long *first_key, float eps,
                   int causal, int parallel) {
    /* rows: the block's of every sequence; n: the window's (a context joins one sequence's block only) */
    const long rows = batch * block, n = width + rows, qk_heads = heads + kv_heads;
    const long qkv_width = (heads + 2 * kv_heads) * head_dim, features = layer->gate_up.rows / 2;
    const size_t sizes[7] = {n * d, n * qkv_width, n * qk_heads * head_dim, rows * heads * head_dim, rows * d,
                             rows * 2 * features, rows * features};
    float *parts[7];
    size_t total = 0;
    for (int i = 0; i < 7; i++) total += (sizes[i] + LANES - 1) / LANES * LANES;
    parts[0] = scratch(LAYER_SCRATCH, total);
    for (int i = 1; i < 7; i++) parts[i] = parts[i - 1] + (sizes[i - 1] + LANES - 1) / LANES * LANES;
    float *window = parts[0], *qkv = parts[1], *qk = parts[2], *attended = parts[3], *update = parts[4];
    float *gate_up = parts[5], *activated = parts[6];
    memcpy(window, context, sizeof(float) * (size_t)(width * d));
    rms_norm(h, d, layer->input_norm, 1, window + width * d, rows, d, eps);
    layer_product(window, &layer->qkv, qkv, n, d, parallel & 1);
    if (layer->qkv_bias != NULL)
        for (long m = 0; m < n; m++) add_into(qkv + m * qkv_width, layer->qkv_bias, qkv_width);
    norm_rotary(qkv, qkv_width, layer->qk_norm, qk_heads, eps, cos, sin, qk, n, head_dim);
    for (long m = 0; m < n; m++) {
        const long b = m / (width + block), position = start + m % (width + block);
        for (long g = 0; g < kv_heads; g++) {
            const size_t at = (size_t)((((b * kv_heads) + g) * capacity + position) * head_dim);
            memcpy(keys + at, qk + (m * qk_heads + heads + g) * head_dim, sizeof(float) * (size_t)head_dim);
            memcpy(values + at, qkv + m * qkv_width + (heads + kv_heads + g) * head_dim,
                   sizeof(float) * (size_t)head_dim);
        }
    }
    const float scale = (float)(1.0 / __builtin_sqrt((double)head_dim)); /* as Python's head_dim ** -0.5 */
    causal_attention(qk + width * qk_heads * head_dim, keys, values, attended, batch, block, heads, kv_heads,
                     head_dim, qk_heads * head_dim, capacity, start + width, first_key, scale, causal,
                     parallel >> 4 & 1);
    layer_product(attended, &layer->o, update, rows, heads * head_dim, parallel >> 1 & 1);
    add_into(h, update, rows * d);
    rms_norm(h, d, layer->post_norm, 1, window, rows, d, eps);
    layer_product(window, &layer->gate_up, gate_up, rows, d, parallel >> 2 & 1);
    swiglu(gate_up, activated, rows, features);
    layer_product(activated, &layer->down, update, rows, features, parallel >> 3 & 1);
    add_into(h, update, rows * d);
}

/* A DFlash draft's whole pass in one call, for one sequence (where Python's operators around the layers cost a
 * quarter of the pass, more once a target step has evicted the interpreter's own data from the caches): the
 * block's input embeddings (rows `block_ids` of the target's `embedding`), the new context (the target's features
 * [width, feature_size] through `fc`, then `hidden_norm`), the draft's layers (`decoder_layer`, non-causal, their
 * caches `keys[i]`/`values[i]`), the final norm of the block's rows first..first+rows-1, the head over them into
 * `logits` [rows, V], and each row's first largest logit into `tokens` (as an id of `vocab_ids` where given: a
 * drafting vocabulary's columns). The same kernels in the same order as the pass operator by operator.
 * `parallel`: the layers' bits (`decoder_layer`), 32 fc, 64 the head. */
typedef struct {
    const decoder_layer_weights *layers;
    long num_layers;
    layer_weight fc, head;
    const float *hidden_norm, *norm, *embedding;
} draft_weights;

static long first_largest(const float *row, long count) { /* NaNs never win (numpy's argmax picks the first) */
    float largest = row[0];
    long v = 0;
    if (count >= LANES) {
        vec best = load(row);
        for (v = LANES; v + LANES <= count; v += LANES) best = lanes_max(best, load(row + v));
        largest = lane_max(best);
    }
    for (; v < count; v++) largest = row[v] > largest ? row[v] : largest;
    for (v = 0; v < count; v++)
        if (row[v] == largest) return v;
    return 0;
}

static long padded(long floats) { return (floats + LANES - 1) / LANES * LANES; }

void draft_block(const draft_weights *draft, float *const *keys, float *const *values, const long *block_ids,
                 const float *features, long feature_size, long width, long block, long d, long heads,
                 long kv_heads, long head_dim, const float *cos, const float *sin, long capacity, long start,
                 float eps, int parallel, long first, long rows, float *logits, const long *vocab_ids, long *tokens) {
    const long spare = padded((width > block ? width : block) * d);
    float *h = scratch(PASS_SCRATCH, (size_t)(padded(block * d) + spare + padded(width * d)));
    float *spare_rows = h + padded(block * d), *context = spare_rows + spare;
    for (long m = 0; m < block; m++) memcpy(h + m * d, draft->embedding + block_ids[m] * d, sizeof(float) * (size_t)d);
    layer_product(features, &draft->fc, spare_rows, width, feature_size, parallel >> 5 & 1);
    rms_norm(spare_rows, d, draft->hidden_norm, 1, context, width, d, eps);
    for (long i = 0; i < draft->num_layers; i++)
        decoder_layer(&draft->layers[i], keys[i], values[i], h, context, 1, width, block, d, heads, kv_heads,
                      head_dim, cos, sin, capacity, start, NULL, eps, 0, parallel & 31);
    rms_norm(h + first * d, d, draft->norm, 1, spare_rows, rows, d, eps);
    layer_product(spare_rows, &draft->head, logits, rows, d, parallel >> 6 & 1);
    for (long m = 0; m < rows; m++) {
        const long best = first_largest(logits + m * draft->head.rows, draft->head.rows);
        tokens[m] = vocab_ids != NULL ? vocab_ids[best] : best;
    }
}
