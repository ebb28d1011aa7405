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

typedef int i32v __attribute__((vector_size(LANES * sizeof(int))));

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

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

static inline vec lanes_max(vec a, vec b) { return select_lanes(a > b, a, b); }

static inline float lane_max(vec v) {
    v = lanes_max(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = lanes_max(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = lanes_max(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = lanes_max(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

#endif
