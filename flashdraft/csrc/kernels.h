/* What the kernel files share: the quantized-block weight (`block_gemm.c`), the packed weights' format codes
 * (`f32_products.c`, native/packing.py's FORMATS), and the kernels one file calls from another (the fused layers of
 * `fused_layers.c` run all of them). */
#ifndef FLASHDRAFT_KERNELS_H
#define FLASHDRAFT_KERNELS_H

typedef struct {
    int bits;                   /* 4, 5 or 8: the width of a code */
    int block;                  /* weights per scale along K: 32, or 16 */
    int offset;                 /* an integer every code is taken from: w = scale * (code - offset) (+ minimum) */
    int largest_code;           /* the largest code a weight may hold: 2^bits - 1, or 63 for Q6_K's 6-bit codes */
    long rows, cols;            /* N (a multiple of 16) and K (a multiple of 32) */
    const unsigned char *codes; /* the panel layout of block_gemm.c */
    const unsigned char *high;  /* 5-bit codes: their fifth bits; else NULL */
    const float *scale;         /* [N/16][K/block][16] */
    const float *minimum;       /* the same layout, or NULL */
} block_weight;

void block_gemm(const block_weight *parts, long count, const float *x, long M, long K, float *y, long ldy,
                int parallel, int portable);

/* f32_products.c */
enum { BF16 = 1, Q8_0 = 2, Q4_1 = 3 }; /* a packed weight's format */
void small_gemm(const float *x, const float *w, float *y, long M, long N, long K);
void small_gemm_parallel(const float *x, const float *w, float *y, long M, long N, long K);
void packed_gemm(int format, const float *x, const void *data, const float *scale, const float *minimum, float *y,
                 long M, long N, long K);
void packed_gemm_parallel(int format, const float *x, const void *data, const float *scale, const float *minimum,
                          float *y, long M, long N, long K);

/* layer_ops.c */
void rms_norm(const float *x, long stride, const float *w, long groups, float *y, long M, long D, float eps);
void norm_rotary(const float *x, long stride, const float *w, long groups, float eps, const float *cos,
                 const float *sin, float *y, long M, long D);
void swiglu(const float *x, float *y, long M, long F);

/* attention.c */
void causal_attention(const float *q, const float *k, const float *v, float *out, long batch, long n, long heads,
                      long kv_heads, long head_dim, long query_stride, long capacity, long start, const long *first_key,
                      const long *positions, float scale, int causal, int parallel);

#endif
