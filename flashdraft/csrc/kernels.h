/* What the kernel files share: the quantized-block weight (`block_gemm.c`), read by the layer kernels
 * (`small_gemm.c`) too. */
#ifndef FLASHDRAFT_KERNELS_H
#define FLASHDRAFT_KERNELS_H

typedef struct {
    int bits;                   /* 4, 5 or 8: the width of a code */
    int block;                  /* weights per scale along K: 32, or 16 */
    int offset;                 /* an integer every code is taken from: w = scale * (code - offset) (+ minimum) */
    int reserved;
    long rows, cols;            /* N (a multiple of 16) and K (a multiple of 32) */
    const unsigned char *codes; /* the panel layout of block_gemm.c */
    const unsigned char *high;  /* 5-bit codes: their fifth bits; else NULL */
    const float *scale;         /* [N/16][K/block][16] */
    const float *minimum;       /* the same layout, or NULL */
} block_weight;

void block_gemm(const block_weight *parts, long count, const float *x, long M, long K, float *y, long ldy,
                int parallel, int portable);

#endif
