/* The operators between a layer's products, each in one native pass where torch runs a chain of small ones:
 * RMSNorm (`rms_norm`), the q and k heads' norm and rotary position embedding (`norm_rotary`) and SwiGLU
 * (`swiglu`). Each is torch's result within float32 rounding, not bit for bit; the engine and the fused layers
 * (fused_layers.c) call the same kernels, so their results agree bit for bit. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vectors.h"

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
