/* Whole passes in one native call, where Python's operators around the kernels cost a fifth of a target's
 * one-token step and half a draft's pass: a decoder layer (`decoder_layer`, the target's and the draft's) and a
 * DFlash draft's whole pass (`draft_block`). Each runs the same kernels in the same order as the pass operator by
 * operator (f32_products.c, block_gemm.c, layer_ops.c, attention.c): the same result bit for bit. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "vectors.h"

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
 * alone. `positions` [batch * block] (or NULL): each row's own position, where a cache holds each sequence at its
 * own positions (continuous batching): its keys and values go there and its query sees the cache up to it.
 * Bits of `parallel` share among threads: 1 q/k/v, 2 o, 4 gate/up, 8 down, 16 attention. */
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
                   const float *cos, const float *sin, long capacity, long start, const long *first_key,
                   const long *positions, float eps, int causal, int parallel) {
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
        const long b = m / (width + block);
        const long position = positions != NULL ? positions[m] : start + m % (width + block);
        for (long g = 0; g < kv_heads; g++) {
            const size_t at = (size_t)((((b * kv_heads) + g) * capacity + position) * head_dim);
            memcpy(keys + at, qk + (m * qk_heads + heads + g) * head_dim, sizeof(float) * (size_t)head_dim);
            memcpy(values + at, qkv + m * qkv_width + (heads + kv_heads + g) * head_dim,
                   sizeof(float) * (size_t)head_dim);
        }
    }
    const float scale = (float)(1.0 / __builtin_sqrt((double)head_dim)); /* as Python's head_dim ** -0.5 */
    causal_attention(qk + width * qk_heads * head_dim, keys, values, attended, batch, block, heads, kv_heads,
                     head_dim, qk_heads * head_dim, capacity, start + width, first_key, positions, scale, causal,
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
                      head_dim, cos, sin, capacity, start, NULL, NULL, eps, 0, parallel & 31);
    rms_norm(h + first * d, d, draft->norm, 1, spare_rows, rows, d, eps);
    layer_product(spare_rows, &draft->head, logits, rows, d, parallel >> 6 & 1);
    for (long m = 0; m < rows; m++) {
        const long best = first_largest(logits + m * draft->head.rows, draft->head.rows);
        tokens[m] = vocab_ids != NULL ? vocab_ids[best] : best;
    }
}
