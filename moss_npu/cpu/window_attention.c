/* The codec's streamed attention: a chunk of T queries per row and head against the keys of its sliding-window
 * ring, for one instruction set (compiled once per target like matvec_tiles.c; window_attention.py picks one).
 *
 * torch's CPU flash attention runs this at well under the core's FMA rate for the codec's shapes (32 queries, a
 * ring of ~1,900 keys of 64 values) and attends every ring slot, the ones out of every query's window too. Here a
 * head's live keys (those some query of the chunk sees) are listed first, then taken in blocks of KEYS: the scores
 * of a block for a panel of PANEL queries in registers (a key's value broadcast against a vector of queries), an
 * online softmax over the blocks, and the probabilities times the values, again a key's probability broadcast
 * against vectors of the values. Query t of row b sees key slot j when 0 <= qpos[b, t] - kpos[b, j] < context and
 * kpos[b, j] >= 0 (an empty slot is -1), as in modules.MultiheadAttention. The sums run in another order than
 * torch's, so the result agrees with it to float rounding, not bit for bit.
 */
#include <stdint.h>
#include <string.h>

#include "matvec.h"

#define JOIN(a, b) a##_##b
#define NAMED(a, b) JOIN(a, b)
#define NAME(base) NAMED(base, MOSS_TARGET)

/* VW floats per vector (a head's size must be a multiple); SUMS vectors of scores in registers per score step (keys
 * × the panel's vectors); TR queries · DH vectors of a value row per output step. */
#if defined(MOSS_AVX512)
#define VW 16
#define SUMS 16
#define TR 4
#define DH 4
#elif defined(MOSS_AVX2)
#define VW 8
#define SUMS 8
#define TR 2
#define DH 4
#else
#define VW 4
#define SUMS 16
#define TR 4
#define DH 4
#endif

#define PANEL 32 /* queries attended together: PANEL / VW vectors of scores per key */
#define STEP_KEYS(vectors) (SUMS / (vectors) < 16 ? SUMS / (vectors) : 16) /* keys per score step */
#define KEYS 64  /* keys per block of the online softmax */
#define LOW -1.0e30f /* below every score: the running maximum before any key */

typedef float Vector __attribute__((vector_size(VW * 4)));
typedef int32_t Mask __attribute__((vector_size(VW * 4)));

static inline Vector load(const float *p) {
    Vector v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, Vector v) { memcpy(p, &v, sizeof v); }

static inline Vector splat(float x) { return x - (Vector){0}; } /* a broadcast: x - 0 is x, also for x = -0 */

static inline Vector select(Mask m, Vector yes, Vector no) { return (Vector)((m & (Mask)yes) | (~m & (Mask)no)); }

static inline Vector maximum(Vector a, Vector b) { return select(a > b, a, b); }

EXP_PARTS(exp_parts, Vector)

/* e^x lane by lane (matvec.c's exp_float in vectors: the same clamp and EXP_PARTS). */
static inline Vector exp_vector(Vector x) {
    x = maximum(x, splat(-87.3f));
    x = select(x > splat(88.7f), splat(88.7f), x);
    Vector n;
    const Vector p = exp_parts(x, &n);
    const Mask bits = (__builtin_convertvector(n, Mask) + 127) << 23;
    return p * (Vector)bits;
}

typedef struct {
    const float *queries;     /* (B, H, T, D), rotated */
    const float *keys, *values; /* (B, H, N, D) rings; slots [0, filled) may hold keys */
    const int64_t *key_positions;   /* (B, N): -1 for an empty slot */
    const int64_t *query_positions; /* (B, T) */
    const int64_t *lengths;         /* (B,): queries t >= lengths[b] are padding, their output zero */
    float *out;                     /* (B, T, H, D) */
    long heads, steps, slots, filled, dim, context;
    float scale;
} Window;

/* Scores of keys keys[list[0 .. n)] (n a multiple of keys_per_step) for the panel's queries (PANEL / VW vectors of
 * qt per value index) into s[j · PANEL ..]: `vectors` of the panel's vectors; both constants where inlined. */
static inline __attribute__((always_inline)) void scores(int vectors, int keys_per_step, const float *qt,
                                                         const float *keys, const int *list, long n, long dim,
                                                         float *s) {
    for (long j = 0; j < n; j += keys_per_step) {
        Vector acc[16][PANEL / VW];
        const float *row[16];
        for (int k = 0; k < keys_per_step; k++) {
            row[k] = keys + (long)list[j + k] * dim;
            for (int v = 0; v < vectors; v++) acc[k][v] = splat(0.0f);
        }
        for (long d = 0; d < dim; d++) {
            Vector q[PANEL / VW];
            for (int v = 0; v < vectors; v++) q[v] = load(qt + d * PANEL + v * VW);
            for (int k = 0; k < keys_per_step; k++) {
                const Vector key = splat(row[k][d]);
                for (int v = 0; v < vectors; v++) acc[k][v] += key * q[v];
            }
        }
        for (int k = 0; k < keys_per_step; k++)
            for (int v = 0; v < vectors; v++) store(s + (j + k) * PANEL + v * VW, acc[k][v]);
    }
}

/* o[t · dim + c ..] += Σ_j p[j · PANEL + t] · values[list[j]][c ..] for the panel's first `rows` queries (a multiple
 * of TR) and the `blocks` vectors of columns from c: `blocks` a constant where inlined. */
static inline __attribute__((always_inline)) void weighted_columns(int blocks, const float *p, const float *values,
                                                                   const int *list, long n, long dim, long rows,
                                                                   long c, float *o) {
    for (long t = 0; t < rows; t += TR) {
        Vector acc[TR][DH];
        for (int r = 0; r < TR; r++)
            for (int h = 0; h < blocks; h++) acc[r][h] = load(o + (t + r) * dim + c + h * VW);
        for (long j = 0; j < n; j++) {
            const float *value = values + (long)list[j] * dim + c;
            Vector w[DH];
            for (int h = 0; h < blocks; h++) w[h] = load(value + h * VW);
            for (int r = 0; r < TR; r++) {
                const Vector pr = splat(p[j * PANEL + t + r]);
                for (int h = 0; h < blocks; h++) acc[r][h] += pr * w[h];
            }
        }
        for (int r = 0; r < TR; r++)
            for (int h = 0; h < blocks; h++) store(o + (t + r) * dim + c + h * VW, acc[r][h]);
    }
}

/* o += the block's probabilities times its values: DH vectors of columns at a time, then one. */
static void weighted_values(const float *p, const float *values, const int *list, long n, long dim, long rows,
                            float *o) {
    long c = 0;
    for (; c + DH * VW <= dim; c += DH * VW) weighted_columns(DH, p, values, list, n, dim, rows, c, o);
    for (; c < dim; c += VW) weighted_columns(1, p, values, list, n, dim, rows, c, o);
}

/* Panel [first, first + count) of head h of row b, its queries at positions low .. high: its output rows, softmax
 * over its live keys. */
static void attend_panel(const Window *w, long b, long h, long first, long count, int64_t low, int64_t high,
                         const int *list, long live) {
    const long dim = w->dim;
    const int vectors = (int)((count + VW - 1) / VW);
    const long rows = (count + TR - 1) / TR * TR;
    const float *q = w->queries + ((b * w->heads + h) * w->steps + first) * dim;
    const float *keys = w->keys + (b * w->heads + h) * w->slots * dim;
    const float *values = w->values + (b * w->heads + h) * w->slots * dim;
    const int64_t *qpos = w->query_positions + b * w->steps + first, *kpos = w->key_positions + b * w->slots;
    float qt[dim * PANEL];
    float s[KEYS * PANEL];
    float o[PANEL * dim];
    float place[PANEL], top[PANEL], total[PANEL], scale_rows[PANEL];
    memset(qt, 0, sizeof qt);
    memset(o, 0, sizeof o);
    for (long t = 0; t < count; t++)
        for (long d = 0; d < dim; d++) qt[d * PANEL + t] = q[t * dim + d] * w->scale;
    /* positions relative to the panel's first query: small exact floats; padding lanes see no key */
    for (long t = 0; t < PANEL; t++) {
        place[t] = t < count ? (float)(qpos[t] - qpos[0]) : -1.0e9f;
        top[t] = LOW, total[t] = 0.0f;
    }
    for (long start = 0; start < live; start += KEYS) {
        const long n = live - start < KEYS ? live - start : KEYS;
        const int *block = list + start;
        /* keys and values a block ahead (the first two at once), on their way from memory while this block is
         * computed (the rings of a stage's layers are read once per call each: they come from memory) */
        for (long j = start ? start + KEYS : 0; j < start + 2 * KEYS && j < live; j++)
            for (long c = 0; c < dim; c += 16) { /* a 64-byte line */
                __builtin_prefetch(keys + (long)list[j] * dim + c);
                __builtin_prefetch(values + (long)list[j] * dim + c);
            }
        switch (vectors) {
#define SCORES(v)                                                                                  \
    case v: {                                                                                      \
        const long whole = n / STEP_KEYS(v) * STEP_KEYS(v);                                        \
        scores(v, STEP_KEYS(v), qt, keys, block, whole, dim, s);                                   \
        scores(v, 1, qt, keys, block + whole, n - whole, dim, s + whole * PANEL);                  \
        break;                                                                                     \
    }
            SCORES(1)
            SCORES(2)
#if PANEL / VW > 2
            SCORES(3)
            SCORES(4)
#endif
#if PANEL / VW > 4
            SCORES(5)
            SCORES(6)
            SCORES(7)
            SCORES(8)
#endif
        }
        /* Most blocks lie inside every query's window: no mask (a padding lane's scores are then those of a
         * zero query, harmless: its row is never written). */
        int inside = 1;
        for (long j = 0; j < n && inside; j++)
            inside = kpos[block[j]] <= low && kpos[block[j]] > high - w->context;
        for (int v = 0; v < vectors; v++) {
            const Vector at = load(place + v * VW), old = load(top + v * VW);
            Vector best = old;
            if (inside) {
                for (long j = 0; j < n; j++) best = maximum(best, load(s + j * PANEL + v * VW));
            } else {
                for (long j = 0; j < n; j++) {
                    const float key = (float)(kpos[block[j]] - qpos[0]);
                    const Vector delta = at - key;
                    const Mask seen = (delta >= 0.0f) & (delta < (float)w->context);
                    const Vector score = select(seen, load(s + j * PANEL + v * VW), splat(LOW));
                    store(s + j * PANEL + v * VW, score);
                    best = maximum(best, score);
                }
            }
            const Vector rescale = exp_vector(old - best);
            Vector sum = load(total + v * VW) * rescale;
            store(scale_rows + v * VW, rescale);
            for (long j = 0; j < n; j++) {
                const Vector score = load(s + j * PANEL + v * VW);
                const Vector p = inside ? exp_vector(score - best)
                                        : select(score > splat(LOW), exp_vector(score - best), splat(0.0f));
                store(s + j * PANEL + v * VW, p);
                sum += p;
            }
            store(top + v * VW, best);
            store(total + v * VW, sum);
        }
        for (long t = 0; t < rows; t++)
            if (scale_rows[t] != 1.0f)
                for (long d = 0; d < dim; d++) o[t * dim + d] *= scale_rows[t];
        weighted_values(s, values, block, n, dim, rows, o);
    }
    for (long t = 0; t < count; t++) {
        float *out = w->out + (((b * w->steps + first + t) * w->heads) + h) * dim;
        const float inverse = total[t] > 0.0f ? 1.0f / total[t] : 0.0f;
        for (long d = 0; d < dim; d++) out[d] = o[t * dim + d] * inverse;
    }
}

/* Unit u = b · H + h: every query panel of head h of row b. */
static void attend_head(const void *task, long unit) {
    const Window *w = task;
    const long b = unit / w->heads, h = unit % w->heads;
    const long valid = w->lengths[b] < 0 ? 0 : w->lengths[b] > w->steps ? w->steps : w->lengths[b];
    const int64_t *qpos = w->query_positions + b * w->steps, *kpos = w->key_positions + b * w->slots;
    for (long t = valid; t < w->steps; t++) memset(w->out + ((b * w->steps + t) * w->heads + h) * w->dim, 0,
                                                   sizeof(float) * (size_t)w->dim);
    if (valid <= 0) return;
    int list[w->filled > 0 ? w->filled : 1];
    for (long first = 0; first < valid; first += PANEL) {
        const long count = valid - first < PANEL ? valid - first : PANEL;
        int64_t low = qpos[first], high = qpos[first];
        for (long t = first; t < first + count; t++) {
            low = qpos[t] < low ? qpos[t] : low;
            high = qpos[t] > high ? qpos[t] : high;
        }
        long live = 0;
        for (long j = 0; j < w->filled; j++)
            if (kpos[j] >= 0 && kpos[j] <= high && kpos[j] > low - w->context) list[live++] = (int)j;
        attend_panel(w, b, h, first, count, low, high, list, live);
    }
}

/* out (B, T, H, D) = the chunk's attention; BAD_CALL for sizes this target's kernel cannot take: a head size of
 * no whole vectors or over 128, or over 16,384 filled slots (a head's panel and key list live on the stack). */
int NAME(moss_window_attention)(void *pool, const float *queries, const float *keys, const float *values,
                                 const int64_t *key_positions, const int64_t *query_positions, const int64_t *lengths,
                                 float *out, long batch, long heads, long steps, long slots, long filled, long dim,
                                 long context, float scale) {
    if (batch <= 0 || heads <= 0 || steps <= 0 || dim <= 0 || dim % VW != 0 || dim > 128 || filled < 0 ||
        filled > slots || filled > 16384 || context <= 0)
        return BAD_CALL;
    const Window w = {queries, keys, values, key_positions, query_positions, lengths, out, heads, steps, slots,
                      filled, dim, context, scale};
    moss_share(pool, attend_head, &w, batch * heads);
    return 0;
}
