/* A streamed codec chunk's new steps into what window_attention.c reads, in one pass over the layer's in_proj rows:
 * the queries rotated, the keys rotated and the values written into the layer's ring at each step's slot, and the
 * slot's position (-1 for a padded step). It is codec/modules.py's rotate_pairs and codec/streaming.py's
 * KVCache.write without their ~40 tensor operations per layer, which took a seventh of an 8-stream codec call.
 * The rotation does their float operations in their order (re·cos − im·sin, re·sin + im·cos, each product rounded:
 * this file is compiled with -ffp-contract=off), so queries, keys and values are bit for bit theirs.
 * Shapes: B rows, T steps, H heads, D head size, E = H·D, N ring slots (of R >= B rows).
 */
#include <stdint.h>
#include <string.h>

#include "matvec.h"

/* Pairs (2i, 2i+1) of x times (cos[i], sin[i]) into out. */
static void rotate(const float *x, const float *cos, const float *sin, long pairs, float *out) {
    for (long i = 0; i < pairs; i++) {
        const float re = x[2 * i], im = x[2 * i + 1];
        out[2 * i] = re * cos[i] - im * sin[i];
        out[2 * i + 1] = re * sin[i] + im * cos[i];
    }
}

/* qkv (B, T, 3, H, D): the in_proj rows. cos, sin (B, T, D / 2): each step's angles. positions (B, T) >= 0: the
 * steps' stream positions, step t of row b at ring slot positions % N; lengths (B,): steps t >= lengths[b] are
 * padding, their slot's position -1. queries (B, H, T, D) out; keys, values (R, H, N, D) and slot_positions (R, N)
 * the ring, of which rows [0, B) are written. Returns 0, or BAD_CALL (nothing written) for sizes that do not fit or
 * a negative position. */
int moss_codec_chunk(const float *qkv, const float *cos, const float *sin, const int64_t *positions,
                     const int64_t *lengths, float *queries, float *keys, float *values, int64_t *slot_positions,
                     long batch, long steps, long heads, long dim, long rows, long slots) {
    if (batch < 1 || steps < 1 || heads < 1 || dim < 2 || dim % 2 != 0 || rows < batch || slots < steps)
        return BAD_CALL;
    for (long i = 0; i < batch * steps; i++)
        if (positions[i] < 0) return BAD_CALL;
    const long e = heads * dim, pairs = dim / 2;
    for (long b = 0; b < batch; b++)
        for (long t = 0; t < steps; t++) {
            const long step = b * steps + t, slot = (long)(positions[step] % slots);
            const float *row = qkv + step * 3 * e, *c = cos + step * pairs, *s = sin + step * pairs;
            for (long h = 0; h < heads; h++) {
                const long at = (b * heads + h) * slots + slot;
                rotate(row + h * dim, c, s, pairs, queries + ((b * heads + h) * steps + t) * dim);
                rotate(row + e + h * dim, c, s, pairs, keys + at * dim);
                memcpy(values + at * dim, row + 2 * e + h * dim, sizeof(float) * (size_t)dim);
            }
            slot_positions[b * slots + slot] = t < lengths[b] ? positions[step] : -1;
        }
    return 0;
}
