/* Attention for the few queries of a decoding step over a KV cache (`causal_attention`): causal over the step,
 * grouped-query, by an online softmax in float32 lanes; or non-causal over a DFlash draft's block. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "vectors.h"

#define KEYS REGISTER_LANES /* keys scored at once: one register's lanes (rvec, vectors.h) */
#define MAX_HEAD_VECTORS (128 / REGISTER_LANES) /* head_dim 64 or 128, a constant in each compiled copy */
#define TILE_QUERIES 4 /* queries that share each key and value read */

/* Lane t of the result = the sum of the lanes of d[t], for a register's worth of vectors at once: a tree of
 * shuffles and adds (one per lane of each, against ~6 per vector one at a time). With 16 lanes the two 8-lane halves
 * of each vector are added first; then, at either width, 4-lane halves, pairs, single lanes. The tree leaves the sums
 * in bit-reversed lane order, so the caller stores the vector for key t in d[REVERSED[t]]. */
#ifdef WHOLE_VECTORS
static const int REVERSED[KEYS] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static const rvec KEY_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#else
static const int REVERSED[KEYS] = {0, 4, 2, 6, 1, 5, 3, 7};
static const rvec KEY_INDEX = {0, 1, 2, 3, 4, 5, 6, 7};
#endif

static inline rvec sums_of_lanes(const rvec *d) {
    rvec e[8], f[4], g[2];
    for (int k = 0; k < 8; k++)
#ifdef WHOLE_VECTORS /* the halves of d[2k] added, then those of d[2k + 1] */
        e[k] = __builtin_shufflevector(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(d[2 * k], d[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
#else
        e[k] = d[k];
#endif
    for (int k = 0; k < 4; k++)
        f[k] = SHUFFLE_HALVES(e[2 * k], e[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SHUFFLE_HALVES(e[2 * k], e[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int k = 0; k < 2; k++)
        g[k] = SHUFFLE_HALVES(f[2 * k], f[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               SHUFFLE_HALVES(f[2 * k], f[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE_HALVES(g[0], g[1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE_HALVES(g[0], g[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

/* Up to TILE_QUERIES query heads that read the same key/value head, against its cached keys and values
 * ([position, head_dim] rows): query r sees keys 0..limit[r]-1. softmax(q k^T * scale) v by the online softmax over
 * chunks of KEYS keys (the running maximum rescales what was summed before), so no score buffer grows with the
 * context; each key and value row is read once for all the tile's queries. */
static inline __attribute__((always_inline)) void attend_tile(const int MQ, const int HEAD_DIM, const float *const *q,
                                                              const float *k, const float *v, float *const *out,
                                                              const long *limit, float scale) {
    const long vectors = HEAD_DIM / REGISTER_LANES;
    rvec query[TILE_QUERIES][MAX_HEAD_VECTORS], acc[TILE_QUERIES][MAX_HEAD_VECTORS];
    float running_max[TILE_QUERIES], total[TILE_QUERIES];
    long keys = 0;
    for (int r = 0; r < MQ; r++) {
        for (long d = 0; d < vectors; d++) {
            query[r][d] = load_register(q[r] + d * REGISTER_LANES) * scale;
            acc[r][d] = (rvec){0};
        }
        running_max[r] = -__builtin_inff();
        total[r] = 0.0f;
        keys = limit[r] > keys ? limit[r] : keys;
    }
    for (long first = 0; first < keys; first += KEYS) {
        const long count = keys - first < KEYS ? keys - first : KEYS;
        rvec dots[TILE_QUERIES][KEYS];
        for (long t = 0; t < KEYS; t++) {
            const float *key = k + (first + (t < count ? t : 0)) * HEAD_DIM;
            for (int r = 0; r < MQ; r++) dots[r][REVERSED[t]] = query[r][0] * load_register(key);
            for (long d = 1; d < vectors; d++) {
                const rvec kd = load_register(key + d * REGISTER_LANES);
                for (int r = 0; r < MQ; r++) dots[r][REVERSED[t]] += query[r][d] * kd;
            }
        }
        float weights[TILE_QUERIES][KEYS];
        for (int r = 0; r < MQ; r++) {
            rvec scores = sums_of_lanes(dots[r]);
            if (limit[r] - first < KEYS) /* keys of this chunk that query r does not see */
                scores = select_register(KEY_INDEX >= (float)(limit[r] - first), (rvec){0} - __builtin_inff(), scores);
            const float chunk_max = register_lane_max(scores);
            if (chunk_max > running_max[r]) {
                const float rescale = exp_register((rvec){0} + (running_max[r] - chunk_max))[0];
                for (long d = 0; d < vectors; d++) acc[r][d] *= rescale;
                total[r] *= rescale;
                running_max[r] = chunk_max;
            }
            const rvec weight = exp_register(scores - running_max[r]); /* 0 where the score is -inf */
            store_register(weights[r], weight);
            total[r] += register_lane_sum(weight);
        }
        /* Each slice of the output in registers over the chunk's values (the same sums, key by key, as any order
         * of the loops: one running sum per lane) */
        for (long d = 0; d < vectors; d++) {
            rvec sums[TILE_QUERIES];
            for (int r = 0; r < MQ; r++) sums[r] = acc[r][d];
            for (long t = 0; t < count; t++) {
                const rvec vd = load_register(v + (first + t) * HEAD_DIM + d * REGISTER_LANES);
                for (int r = 0; r < MQ; r++) sums[r] += weights[r][t] * vd;
            }
            for (int r = 0; r < MQ; r++) acc[r][d] = sums[r];
        }
    }
    for (int r = 0; r < MQ; r++)
        for (long d = 0; d < vectors; d++) store_register(out[r] + d * REGISTER_LANES, acc[r][d] / total[r]);
}

/* Causal attention for the few queries of a decoding step over a cache laid out [batch, kv_heads, capacity,
 * head_dim]: query i of each row sits at position start + i and sees keys 0..start+i (a block sees the cache and
 * itself up to its own position), or with `causal` 0 every key up to start+n-1 (a DFlash draft's block, which sees
 * all of itself); query head h reads key/value head h / (heads / kv_heads). Queries [batch * n,
 * heads, head_dim] with `query_stride` floats between rows; out [batch * n, heads * head_dim]. `first_key`
 * [batch] (or NULL: all 0): the first key each row sees, after its left padding; a query before it (a padding
 * query) gets zeros. `positions` [batch * n] (or NULL): each query's own position, for rows whose queries do not
 * sit at start + i (a cache by position); a causal query then sees keys up to it. Each query's result depends only
 * on its own keys: the same bits in any batch, chunk or tile (what makes batched decoding exact). The work goes in
 * tiles of up to TILE_QUERIES (query, head) pairs of one key/value head, shared among threads when `parallel`.
 * head_dim must be 64 or 128. */
void causal_attention(const float *q, const float *k, const float *v, float *out, long batch, long n, long heads,
                      long kv_heads, long head_dim, long query_stride, long capacity, long start, const long *first_key,
                      const long *positions, float scale, int causal, int parallel) {
    const long group = heads / kv_heads, per_head = n * group; /* the queries of one key/value head */
    const long tiles_per_head = (per_head + TILE_QUERIES - 1) / TILE_QUERIES;
    const long tiles = batch * kv_heads * tiles_per_head;
#pragma omp parallel for schedule(static) if (parallel)
    for (long tile = 0; tile < tiles; tile++) {
        const long b = tile / (kv_heads * tiles_per_head), kv = tile / tiles_per_head % kv_heads;
        const long first = tile % tiles_per_head * TILE_QUERIES;
        const int in_tile = per_head - first < TILE_QUERIES ? per_head - first : TILE_QUERIES;
        const float *queries[TILE_QUERIES];
        float *outs[TILE_QUERIES];
        long limits[TILE_QUERIES];
        /* A left-padded row's keys begin at its first token: the padding is never read, and the row's sums run
         * in the same chunks as the row's alone would. */
        const long begin = first_key != NULL ? first_key[b] : 0;
        int count = 0;
        for (int r = 0; r < in_tile; r++) { /* the tile's r-th query: query position i, head h */
            const long i = (first + r) / group, h = kv * group + (first + r) % group, row = b * n + i;
            const long position = positions != NULL ? positions[row] : start + i;
            const long limit = (causal ? position + 1 : start + n) - begin;
            float *const row_out = out + (row * heads + h) * head_dim;
            if (limit <= 0) { /* a padding query: it sees no key */
                memset(row_out, 0, (size_t)head_dim * sizeof(float));
                continue;
            }
            queries[count] = q + row * query_stride + h * head_dim;
            outs[count] = row_out;
            limits[count++] = limit;
        }
        const float *keys = k + ((b * kv_heads + kv) * capacity + begin) * head_dim;
        const float *values = v + ((b * kv_heads + kv) * capacity + begin) * head_dim;
        const int shape = count * 1000 + (int)head_dim; /* one compiled copy per (queries, head_dim) */
        switch (shape) {
        case 4064: attend_tile(4, 64, queries, keys, values, outs, limits, scale); break;
        case 3064: attend_tile(3, 64, queries, keys, values, outs, limits, scale); break;
        case 2064: attend_tile(2, 64, queries, keys, values, outs, limits, scale); break;
        case 1064: attend_tile(1, 64, queries, keys, values, outs, limits, scale); break;
        case 4128: attend_tile(4, 128, queries, keys, values, outs, limits, scale); break;
        case 3128: attend_tile(3, 128, queries, keys, values, outs, limits, scale); break;
        case 2128: attend_tile(2, 128, queries, keys, values, outs, limits, scale); break;
        case 1128: attend_tile(1, 128, queries, keys, values, outs, limits, scale); break;
        }
    }
}
