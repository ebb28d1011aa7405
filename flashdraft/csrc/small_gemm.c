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
#include <string.h>

#define LANES 16
#define TILE_ROWS 4 /* weight rows per tile, and input rows per tile */

/* Pins a value to a vector register. Without it GCC folds each weight load into every multiply-add that uses it,
 * loading a weight once per input row: twice the loads, and split ones on weights that are not 64-byte aligned. */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define IN_REGISTER(v) ((void)0)
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
