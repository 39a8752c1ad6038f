/* One pre-norm GPT-2 block on one new row of one slot (or of each of n slots), in one call: cpu/blocks.py's
 * row_block, whose ~25 small numpy operations between the four products cost as much time as a third of the products at batch 1 and ran on
 * one thread whatever the pool's size. Here they are a few loops each, the products go through the pool
 * (moss_product, the GELU fused into fc_in's tiles) and the attention is shared out over it head by head.
 *
 * The steps and their order are row_block's: ln_1, c_attn (or a ready-made qkv), RoPE on the queries and keys
 * (pairs (2i, 2i+1) times cos + i·sin), the new key and value written into the slot's cache at `position`,
 * softmax attention over the first `attended` rows, x + c_proj, ln_2, the tanh-GELU MLP added, and on a
 * decoder's last block its final norm (ln_f). Norm statistics are summed in double, every other sum in float,
 * so results agree with row_block to float rounding.
 * Shapes: E hidden, H heads, D = E / H head dim, F inner, M cache rows.
 */
#include <math.h>
#include <string.h>

#include "fused_block.h"

static long padded(long n) { return (n + TILE - 1) / TILE * TILE; }

/* Floats of scratch a call of one row attending `attended` rows needs (moss_row_block's `scratch`; n rows: n times
 * as many, moss_block_rows). */
long moss_row_block_scratch(const Block *b, long attended) {
    return 4 * padded(b->embed) + b->embed + padded(3 * b->embed) + padded(b->inner) + b->heads * attended;
}

static void layer_norm(const float *x, const float *weight, const float *bias, float *out, long n, float eps) {
    double sum = 0.0, squares = 0.0;
    for (long i = 0; i < n; i++) sum += x[i];
    const float mean = (float)(sum / (double)n);
    for (long i = 0; i < n; i++) {
        out[i] = x[i] - mean;
        squares += (double)out[i] * out[i];
    }
    const float inverse = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (long i = 0; i < n; i++) out[i] = out[i] * inverse * weight[i] + bias[i];
}

/* Pairs (2i, 2i+1) of each of `heads` rows of `dim` values times the complex rotation[i] = (cos, sin). */
static void rotate(float *v, const float *rotation, long heads, long dim) {
    for (long h = 0; h < heads; h++)
        for (long i = 0; i < dim / 2; i++) {
            float *pair = v + h * dim + 2 * i;
            const float re = pair[0], im = pair[1], c = rotation[2 * i], s = rotation[2 * i + 1];
            pair[0] = re * c - im * s;
            pair[1] = re * s + im * c;
        }
}

static inline __attribute__((always_inline)) float dot(const float *a, const float *b, long n) {
    float lanes[8] = {0};
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* out[0 .. dim) = Σ_t (scores[t] / total) · values[t], t in order. With `dim` a constant (64, the model's head
 * size) the sums stay in registers across t; summed in memory, each step waited for the last one's store. */
static inline __attribute__((always_inline)) void weighted_sum(long dim, const float *scores, float total,
                                                               const float *values, long attended, float *out) {
    float sums[dim];
    for (long d = 0; d < dim; d++) sums[d] = 0.0f;
    for (long t = 0; t < attended; t++) {
        const float p = scores[t] / total, *row = values + t * dim;
        for (long d = 0; d < dim; d++) sums[d] += p * row[d];
    }
    memcpy(out, sums, sizeof(float) * (size_t)dim);
}

typedef struct {
    const float *queries, *keys, *values;  /* row r's (H, D) rotated at r · query_stride; its cache's (H, M, D) */
    float *scores, *out;                  /* (n, H, width) scratch; (n, H, D) */
    const Places *at;
    long rows, width, dim, heads, query_stride, cache_stride;
    float scale;
} Attention;

#define KEYS_AHEAD 8  /* rows: 4 and 16 measured slower */

/* The attention's loops in the widest vectors the CPU has (WIDEST, matvec.h). */
/* Unit u = r · H + h: head h of row r, its softmax attention over the first rows of its cache it attends. */
WIDEST static void attend(const void *task, long unit) {
    const Attention *a = task;
    const long r = unit / a->heads, h = unit % a->heads, attended = a->at->attended[r * a->at->stride];
    const float *q = a->queries + r * a->query_stride + h * a->dim;
    const float *keys = a->keys + r * a->cache_stride + h * a->rows * a->dim;
    const float *values = a->values + r * a->cache_stride + h * a->rows * a->dim;
    float *scores = a->scores + unit * a->width, *out = a->out + unit * a->dim;
    float top = -INFINITY;
    const long row_bytes = a->dim * (long)sizeof(float);
    for (long t = 0; t < attended; t++) {
        /* Each unit's keys and values are short streams (one head's cached rows) that the hardware prefetcher
         * meets cold: ask for the keys KEYS_AHEAD rows on, and for this row's values, which the weighted sum
         * reads once the scores are done (docs/performance.md). */
        const char *ahead = t + KEYS_AHEAD < attended ? (const char *)(keys + (t + KEYS_AHEAD) * a->dim) : NULL;
        const char *value = (const char *)(values + t * a->dim);
        for (long line = 0; line < row_bytes; line += 64) {
            if (ahead) __builtin_prefetch(ahead + line, 0, 3);
            __builtin_prefetch(value + line, 0, 3);
        }
        scores[t] = dot(q, keys + t * a->dim, a->dim) * a->scale;
        if (scores[t] > top) top = scores[t];
    }
    double total = 0.0;
    for (long t = 0; t < attended; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    if (a->dim == 64)
        weighted_sum(64, scores, (float)total, values, attended, out);
    else
        weighted_sum(a->dim, scores, (float)total, values, attended, out);
}

static int product(void *pool, const Block *b, const Product *p, const float *x, const float *residual, float *y,
                   long n, int gelu) {
    return moss_product(pool, b->target, b->format, x, p->w, p->scale, p->bias, residual, y, n, p->in, p->columns,
                        gelu);
}

static int fits(const Block *b) {
    const long e = b->embed, f = b->inner;
    if (b->target < 0 || b->target >= TARGETS || !(moss_targets() >> b->target & 1)) return 0;
    if (b->format < 0 || b->format >= FORMATS) return 0;
    if (b->format == INT8 && !(b->attn.scale && b->proj.scale && b->fc_in.scale && b->fc_out.scale)) return 0;
    if (e < 1 || f < 1 || b->heads < 1 || e % b->heads != 0 || (e / b->heads) % 2 != 0) return 0;
    return b->attn.in == e && b->attn.columns == padded(3 * e) && b->proj.in == e && b->proj.columns == padded(e) &&
           b->fc_in.in == e && b->fc_in.columns == padded(f) && b->fc_out.in == f && b->fc_out.columns == padded(e);
}

/* Rows (n, E) of x become the block's outputs for n new rows at their places `at` of their own caches: row r's keys
 * and values (H, M, D) at `keys`/`values` + r · cache_stride floats; `qkv` (n, 3E) ready-made c_attn(ln_1(x)) rows
 * or NULL; `scratch` n · moss_row_block_scratch floats for the most rows a row attends. Each row's products are
 * the tiles' (moss_product over n rows), so row r gets the bits it gets alone. Returns 0, or BAD_CALL for shapes
 * that do not fit or a target or format the products refuse (x is then unchanged). */
int moss_block_rows(void *pool, const Block *b, long n, float *x, const Places *at, float *keys, float *values,
                    long cache_stride, long rows, const float *qkv, float *scratch) {
    if (!fits(b) || (b->final_w == NULL) != (b->final_b == NULL) || n < 1) return BAD_CALL;
    if (at->stride < 0 || at->stride > 1) return BAD_CALL;
    long width = 0;
    for (long r = 0; r < n; r++) {
        const long position = at->positions[r * at->stride], attended = at->attended[r * at->stride];
        if (position < 0 || position >= rows || attended <= position || attended > rows) return BAD_CALL;
        width = attended > width ? attended : width;
    }
    const long e = b->embed, heads = b->heads, dim = e / heads, pe = padded(e), p3e = padded(3 * e);
    const long pf = padded(b->inner), f_in = b->inner;
    if (n > 1 && cache_stride < heads * rows * dim) return BAD_CALL;
    /* per row: h, h2, out (padded E: the products' rows), attended_rows and normed (E: the products' inputs), q
     * (padded 3E), f (padded F, packed to F before fc_out reads it), scores (H · width) */
    float *h = scratch, *h2 = h + n * pe, *out = h2 + n * pe, *attended_rows = out + n * pe;
    float *normed = attended_rows + n * pe, *q = normed + n * e, *f = q + n * p3e, *scores = f + n * pf;
    memset(h, 0, sizeof(float) * (size_t)(n * pe));  /* the padding is a residual's: zero */
    for (long r = 0; r < n; r++) memcpy(h + r * pe, x + r * e, sizeof(float) * (size_t)e);
    if (qkv != NULL) {
        for (long r = 0; r < n; r++) memcpy(q + r * p3e, qkv + r * 3 * e, sizeof(float) * (size_t)(3 * e));
    } else {
        for (long r = 0; r < n; r++) layer_norm(h + r * pe, b->ln1_w, b->ln1_b, normed + r * e, e, b->eps);
        if (product(pool, b, &b->attn, normed, NULL, q, n, 0)) return BAD_CALL;
    }
    for (long r = 0; r < n; r++) {
        float *row_q = q + r * p3e, *row_keys = keys + r * cache_stride, *row_values = values + r * cache_stride;
        const long position = at->positions[r * at->stride];
        rotate(row_q, at->rotation + r * at->stride * dim, 2 * heads, dim);
        for (long head = 0; head < heads; head++) {
            memcpy(row_keys + (head * rows + position) * dim, row_q + e + head * dim, sizeof(float) * (size_t)dim);
            memcpy(row_values + (head * rows + position) * dim, row_q + 2 * e + head * dim,
                   sizeof(float) * (size_t)dim);
        }
    }
    const Attention attention = {q, keys, values, scores, attended_rows, at, rows, width, dim, heads, p3e,
                                 cache_stride, b->scale};
    moss_share(pool, attend, &attention, n * heads);  /* attended_rows: (n, H, D) = (n, E) */
    if (product(pool, b, &b->proj, attended_rows, h, h2, n, 0)) return BAD_CALL;
    for (long r = 0; r < n; r++) layer_norm(h2 + r * pe, b->ln2_w, b->ln2_b, normed + r * e, e, b->eps);
    if (product(pool, b, &b->fc_in, normed, NULL, f, n, 1)) return BAD_CALL;
    for (long r = 1; r < n && pf != f_in; r++) memmove(f + r * f_in, f + r * pf, sizeof(float) * (size_t)f_in);
    if (product(pool, b, &b->fc_out, f, h2, out, n, 0)) return BAD_CALL;
    for (long r = 0; r < n; r++) {
        if (b->final_w != NULL)
            layer_norm(out + r * pe, b->final_w, b->final_b, x + r * e, e, b->eps);
        else
            memcpy(x + r * e, out + r * pe, sizeof(float) * (size_t)e);
    }
    return 0;
}

/* moss_block_rows for one row: x (E) at `position` of the cache `keys`/`values` (H, M, D). */
int moss_row_block(void *pool, const Block *b, float *x, const float *rotation, float *keys, float *values,
                   long rows, long position, long attended, const float *qkv, float *scratch) {
    const Places at = {&position, &attended, rotation, 0};
    return moss_block_rows(pool, b, 1, x, &at, keys, values, 0, rows, qkv, scratch);
}
