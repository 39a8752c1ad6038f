/* One pre-norm GPT-2 block on one slot's one new row, in one call: cpu/blocks.py's row_block, whose ~25 small
 * numpy operations between the four products cost as much time as a third of the products at batch 1 and ran on
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

#include "matvec.h"

typedef struct {
    const void *w;               /* the weight's tiles (matvec.c) */
    const float *scale, *bias;  /* per padded column: scale (int8 only), bias */
    long in, columns;           /* `columns`: the outputs padded to a multiple of TILE */
} Product;

typedef struct {
    int target, format;         /* the tiles' instruction set and format (matvec.c) */
    long embed, heads, inner;   /* E, H, F */
    float eps, scale;           /* layer norm epsilon, attention scale */
    const float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    Product attn, proj, fc_in, fc_out;
    const float *final_w, *final_b;  /* the decoder's final norm, on its last block's output; NULL otherwise */
} Block;

static long padded(long n) { return (n + TILE - 1) / TILE * TILE; }

/* Floats of scratch a call attending `attended` rows needs (moss_row_block's `scratch`). */
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

static float dot(const float *a, const float *b, long n) {
    float lanes[8] = {0};
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += a[i + l] * b[i + l];
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

typedef struct {
    const float *queries, *keys, *values;  /* (H, D) rotated; the cache's (H, M, D) */
    float *scores, *out;                  /* (H, attended) scratch; (H, D) */
    long rows, attended, dim;
    float scale;
} Attention;

/* Head h's softmax attention of its query over the first `attended` cached rows. */
static void attend(const void *task, long h) {
    const Attention *a = task;
    const float *q = a->queries + h * a->dim, *keys = a->keys + h * a->rows * a->dim;
    const float *values = a->values + h * a->rows * a->dim;
    float *scores = a->scores + h * a->attended, *out = a->out + h * a->dim;
    float top = -INFINITY;
    for (long t = 0; t < a->attended; t++) {
        scores[t] = dot(q, keys + t * a->dim, a->dim) * a->scale;
        if (scores[t] > top) top = scores[t];
    }
    double total = 0.0;
    for (long t = 0; t < a->attended; t++) {
        scores[t] = expf(scores[t] - top);
        total += scores[t];
    }
    memset(out, 0, sizeof(float) * (size_t)a->dim);
    for (long t = 0; t < a->attended; t++) {
        const float p = scores[t] / (float)total, *row = values + t * a->dim;
        for (long d = 0; d < a->dim; d++) out[d] += p * row[d];
    }
}

static int product(void *pool, const Block *b, const Product *p, const float *x, const float *residual, float *y,
                   int gelu) {
    return moss_product(pool, b->target, b->format, x, p->w, p->scale, p->bias, residual, y, 1, p->in, p->columns,
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

/* x (E) becomes the block's output for one new row at `position` of the slot's cache `keys`/`values` (H, M, D),
 * attending to its first `attended` rows; `rotation` (D / 2 pairs cos, sin) is RoPE at the row's position;
 * `qkv` (3E) a ready-made c_attn(ln_1(x)) or NULL; `scratch` moss_row_block_scratch floats. Returns 0, or
 * BAD_CALL for shapes that do not fit or a target or format the products refuse (x is then unchanged). */
int moss_row_block(void *pool, const Block *b, float *x, const float *rotation, float *keys, float *values,
                   long rows, long position, long attended, const float *qkv, float *scratch) {
    if (!fits(b) || (b->final_w == NULL) != (b->final_b == NULL)) return BAD_CALL;
    if (position < 0 || position >= rows || attended <= position || attended > rows) return BAD_CALL;
    const long e = b->embed, heads = b->heads, dim = e / heads;
    float *h = scratch, *h2 = h + padded(e), *out = h2 + padded(e), *attended_rows = out + padded(e);
    float *normed = attended_rows + padded(e), *q = normed + e, *f = q + padded(3 * e);  /* normed: ln_1, ln_2 */
    float *scores = f + padded(b->inner);
    memset(h, 0, sizeof(float) * (size_t)padded(e));  /* the padding is a residual's: zero */
    memcpy(h, x, sizeof(float) * (size_t)e);
    if (qkv != NULL) {
        memcpy(q, qkv, sizeof(float) * (size_t)(3 * e));
    } else {
        layer_norm(h, b->ln1_w, b->ln1_b, normed, e, b->eps);
        if (product(pool, b, &b->attn, normed, NULL, q, 0)) return BAD_CALL;
    }
    rotate(q, rotation, 2 * heads, dim);
    for (long head = 0; head < heads; head++) {
        memcpy(keys + (head * rows + position) * dim, q + e + head * dim, sizeof(float) * (size_t)dim);
        memcpy(values + (head * rows + position) * dim, q + 2 * e + head * dim, sizeof(float) * (size_t)dim);
    }
    const Attention attention = {q, keys, values, scores, attended_rows, rows, attended, dim, b->scale};
    moss_share(pool, attend, &attention, heads);
    if (product(pool, b, &b->proj, attended_rows, h, h2, 0)) return BAD_CALL;
    layer_norm(h2, b->ln2_w, b->ln2_b, normed, e, b->eps);
    if (product(pool, b, &b->fc_in, normed, NULL, f, 1)) return BAD_CALL;
    if (product(pool, b, &b->fc_out, f, h2, out, 0)) return BAD_CALL;
    if (b->final_w != NULL)
        layer_norm(out, b->final_w, b->final_b, x, e, b->eps);
    else
        memcpy(x, out, sizeof(float) * (size_t)e);
    return 0;
}
