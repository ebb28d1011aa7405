/* The vector helpers the float32 kernel files share (f32_products.c, layer_ops.c, attention.c, fused_layers.c):
 * 16 float lanes in GCC's vector extensions, so one source compiles to AVX-512, AVX2 or NEON by -march=native.
 * All static inline: each file gets its own copy, as when they were one file. */
#ifndef FLASHDRAFT_VECTORS_H
#define FLASHDRAFT_VECTORS_H

#include <string.h>

#define LANES 16

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
typedef int i32v __attribute__((vector_size(LANES * sizeof(int))));
typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef int i32v8 __attribute__((vector_size(8 * sizeof(int))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

/* One register's vector: 16 lanes with AVX-512, else 8 (one AVX2 register; two of NEON's). GCC computes a 16-lane
 * vector in two registers well enough for arithmetic, but lowers its comparisons and shuffles lane by lane, in scalar
 * code, and moves arrays of them through memory in pieces: the attention kernel, which is made of those, runs in
 * `rvec`s (4-8 times faster on AVX2), and the 16-lane helpers below are their register-width versions applied to
 * halves. */
#if defined(__AVX512F__)
#define WHOLE_VECTORS 1
#define REGISTER_LANES 16
typedef vec rvec;
typedef i32v ri32v;
#else
#define REGISTER_LANES 8
typedef vec8 rvec;
typedef i32v8 ri32v;
#endif

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline rvec load_register(const float *p) {
    rvec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_register(float *p, rvec v) { memcpy(p, &v, sizeof v); }

/* A 16-lane vector's halves, through a union: GCC keeps each in its register. */
typedef union {
    vec whole;
    vec8 half[2];
} vec_halves;
static inline vec8 low_half(vec v) { return ((vec_halves){.whole = v}).half[0]; }
static inline vec8 high_half(vec v) { return ((vec_halves){.whole = v}).half[1]; }
static inline vec join_halves(vec8 low, vec8 high) { return ((vec_halves){.half = {low, high}}).whole; }

/* The same 8-lane shuffle of each 8-lane half of a register (the register itself on AVX2): lane j of the result's
 * low half is lane p_j of a's low half (p_j < 8) or of b's (p_j - 8), and likewise from the high halves. */
#define FROM_LOW(p) ((p) < 8 ? (p) : (p) + 8)
#define FROM_HIGH(p) ((p) < 8 ? (p) + 8 : (p) + 16)
#ifdef WHOLE_VECTORS
#define SHUFFLE_HALVES(a, b, p0, p1, p2, p3, p4, p5, p6, p7)                                                      \
    __builtin_shufflevector(a, b, FROM_LOW(p0), FROM_LOW(p1), FROM_LOW(p2), FROM_LOW(p3), FROM_LOW(p4),          \
                            FROM_LOW(p5), FROM_LOW(p6), FROM_LOW(p7), FROM_HIGH(p0), FROM_HIGH(p1), FROM_HIGH(p2),  \
                            FROM_HIGH(p3), FROM_HIGH(p4), FROM_HIGH(p5), FROM_HIGH(p6), FROM_HIGH(p7))
#else
#define SHUFFLE_HALVES(a, b, p0, p1, p2, p3, p4, p5, p6, p7)                                                      \
    __builtin_shufflevector(a, b, p0, p1, p2, p3, p4, p5, p6, p7)
#endif

/* The sum of the lanes, in the same order at every width: the two 8-lane halves added, then 4, 2, 1. */
static inline float sum_of_8(vec8 h) {
    vec4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static inline float lane_sum(vec v) { return sum_of_8(low_half(v) + high_half(v)); }

#ifdef WHOLE_VECTORS
static inline float register_lane_sum(rvec v) { return lane_sum(v); }
#else
static inline float register_lane_sum(rvec v) { return sum_of_8(v); }
#endif

/* Lane by lane, `mask` (all ones or zero per lane, from a comparison) ? a : b. */
static inline rvec select_register(ri32v mask, rvec a, rvec b) {
    ri32v ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const ri32v chosen = (mask & ia) | (~mask & ib);
    rvec result;
    memcpy(&result, &chosen, sizeof result);
    return result;
}

/* e^x in float32 lanes, within ~2 ulp of expf: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact;
 * n rounded to nearest by adding and removing 1.5 * 2^23), e^r by its Taylor series to r^7 in Horner form, 2^n put
 * straight into the exponent bits. Below -87 it is 0 (softmax weights that small vanish beside the largest, 1). */
static inline rvec exp_register(rvec x) {
    const rvec zero = {0}, low = zero - 87.0f, high = zero + 88.0f, round = zero + 12582912.0f;
    const ri32v underflow = x < low;
    x = select_register(underflow, low, select_register(x > high, high, x));
    const rvec n = (x * 1.44269504088896341f + round) - round;
    const rvec r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    rvec p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ri32v bits = (__builtin_convertvector(n, ri32v) + 127) << 23;
    rvec scale;
    memcpy(&scale, &bits, sizeof scale);
    return select_register(underflow, zero, p * scale);
}

#ifdef WHOLE_VECTORS
static inline vec exp_lanes(vec x) { return exp_register(x); }
#else
static inline vec exp_lanes(vec x) { return join_halves(exp_register(low_half(x)), exp_register(high_half(x))); }
#endif

static inline rvec register_max(rvec a, rvec b) { return select_register(a > b, a, b); }

/* The largest lane (exact: a maximum does not depend on the order). */
static inline float register_lane_max(rvec v) {
#ifdef WHOLE_VECTORS
    v = register_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
#endif
    v = register_max(v, SHUFFLE_HALVES(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = register_max(v, SHUFFLE_HALVES(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = register_max(v, SHUFFLE_HALVES(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

#ifdef WHOLE_VECTORS
static inline vec lanes_max(vec a, vec b) { return register_max(a, b); }
static inline float lane_max(vec v) { return register_lane_max(v); }
#else
static inline vec lanes_max(vec a, vec b) {
    return join_halves(register_max(low_half(a), low_half(b)), register_max(high_half(a), high_half(b)));
}
static inline float lane_max(vec v) { return register_lane_max(register_max(low_half(v), high_half(v))); }
#endif

#endif
