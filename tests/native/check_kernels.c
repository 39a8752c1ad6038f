/* The library's one-row products and fused block checked on their own, for the kernel tests where Python cannot
 * run (an aarch64 build under qemu-user): every target this CPU runs, the three formats, odd shapes, with and
 * without bias and residual, on one thread and shared over a pool of two; each column against a float64 sum of
 * the same stored values, and the pool's result bit for bit the one thread's; then the fused block (check_fused)
 * against the same block in float64; then the pool's product number across its 2^24 wrap (check_ticket_wrap).
 * Built with the library's objects (moss_npu/native/build.py); prints one line per target and exits 1 on any
 * failure. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../moss_npu/cpu/fused_block.h"  /* TILE, the targets and formats, Product, Block, Places, the pool */

static const char *TARGET_NAMES[TARGETS] = {"portable", "avx2", "avx512", "neon"};
static const char *FORMAT_NAMES[FORMATS] = {"float32", "bfloat16", "int8"};

/* The entries no header declares: the callers are Python's (moss_npu/cpu/matvec.py, fused_block.py). */
void *moss_pool_new(int threads);
void moss_pool_free(void *pool);
void moss_pool_use(void *pool, int threads);
void moss_pool_set_product(void *pool, unsigned long long number);
int moss_matvec(void *pool, int target, int format, const float *x, const void *w, const float *scale,
                const float *bias, const float *residual, float *y, long rows, long in, long out);
int moss_row_block(void *pool, const Block *b, float *x, const float *rotation, float *keys, float *values,
                   long rows, long position, long attended, const float *qkv, float *scratch);
long moss_local_decide(const float *logits, long v, const uint8_t *seen, int do_sample, float temperature,
                       int64_t top_k, float top_p, float penalty, float uniform, const float *exponential,
                       float *scratch);

static uint32_t state = 12345u;
static float uniform(void) { /* in [-1, 1) */
    state = state * 1664525u + 1013904223u;
    return (float)(state >> 8) / (float)(1u << 23) - 1.0f;
}

static float bf16_round(float v) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &bits, 4);
    return v;
}

/* Where column c (of `columns`), row i of the weight goes in the tiles, counted in values. */
static long place(int format, long c, long i, long in) {
    long tile = c / TILE, col = c % TILE;
    if (format == 1) {
        long g = col / 32, r = col % 32;
        col = 32 * g + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
    }
    return tile * in * TILE + i * TILE + col;
}

static int check(int target, int format, long rows, long in, long out, int with_bias, int with_residual,
                 void *pool) {
    long columns = (out + TILE - 1) / TILE * TILE;
    float *w = calloc((size_t)(in * columns), sizeof(float));
    uint16_t *w16 = calloc((size_t)(in * columns), sizeof(uint16_t));
    int8_t *w8 = calloc((size_t)(in * columns), 1);
    float *x = malloc(sizeof(float) * (size_t)(rows * in));
    float *scale = calloc((size_t)columns, sizeof(float)), *bias = calloc((size_t)columns, sizeof(float));
    float *residual = calloc((size_t)(rows * columns), sizeof(float));
    float *y = malloc(sizeof(float) * (size_t)(rows * columns)), *y2 = malloc(sizeof(float) * (size_t)(rows * columns));
    double *value = malloc(sizeof(double) * (size_t)(in * out));
    int bad = 0;
    for (long c = 0; c < out; c++) {
        scale[c] = 0.01f + 0.02f * (uniform() + 1.0f);
        bias[c] = uniform();
        for (long i = 0; i < in; i++) {
            float v = uniform() * 3.0f;
            long at = place(format, c, i, in);
            if (format == 0) {
                w[at] = v;
                value[c * in + i] = v;
            } else if (format == 1) {
                float r = bf16_round(v);
                uint32_t bits;
                memcpy(&bits, &r, 4);
                w16[at] = (uint16_t)(bits >> 16);
                value[c * in + i] = r;
            } else {
                int q = (int)lrintf(v * 40.0f);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                w8[at] = (int8_t)q;
                value[c * in + i] = (double)q * scale[c];
            }
        }
    }
    for (long k = 0; k < rows * in; k++) x[k] = uniform();
    for (long k = 0; k < rows * columns; k++) residual[k] = uniform();
    const void *table = format == 0 ? (const void *)w : format == 1 ? (const void *)w16 : (const void *)w8;
    const float *b = with_bias ? bias : NULL, *res = with_residual ? residual : NULL;
    moss_pool_use(pool, 1);
    int status = moss_matvec(pool, target, format, x, table, scale, b, res, y, rows, in, columns);
    moss_pool_use(pool, 2);
    int shared = moss_matvec(pool, target, format, x, table, scale, b, res, y2, rows, in, columns);
    if (status != 0 || shared != 0) {
        printf("  %s %ldx%ld->%ld: refused (%d, %d)\n", FORMAT_NAMES[format], rows, in, out, status, shared);
        bad = 1;
    }
    for (long r = 0; r < rows && !bad; r++)
        for (long c = 0; c < out; c++) {
            double sum = 0, size = 0;
            for (long i = 0; i < in; i++) {
                double term = (double)x[r * in + i] * value[c * in + i];
                sum += term;
                size += fabs(term);
            }
            sum += (with_bias ? bias[c] : 0.0) + (with_residual ? residual[r * columns + c] : 0.0);
            double got = y[r * columns + c];
            if (fabs(got - sum) > 1e-5 * (size + 1.0)) {
                printf("  %s %ldx%ld->%ld row %ld column %ld: %.9g, expected %.9g\n", FORMAT_NAMES[format], rows, in,
                       out, r, c, got, sum);
                bad = 1;
                break;
            }
            if (memcmp(&y[r * columns + c], &y2[r * columns + c], sizeof(float)) != 0) {
                printf("  %s %ldx%ld->%ld: two threads differ from one at row %ld column %ld\n", FORMAT_NAMES[format],
                       rows, in, out, r, c);
                bad = 1;
                break;
            }
        }
    for (long r = 0; r < rows && !bad && rows > 1; r++) {  /* a row in a group gets the bits it gets alone */
        moss_matvec(pool, target, format, x + r * in, table, scale, b, res ? res + r * columns : NULL, y2, 1, in,
                    columns);
        if (memcmp(y2, y + r * columns, sizeof(float) * (size_t)columns) != 0) {
            printf("  %s %ldx%ld->%ld: row %ld differs from the row alone\n", FORMAT_NAMES[format], rows, in, out, r);
            bad = 1;
        }
    }
    free(w), free(w16), free(w8), free(x), free(scale), free(bias), free(residual), free(y), free(y2), free(value);
    return bad;
}


/* The fused block (fused_block.c) against the same block computed here in double from the same values: a GPT-2
 * block of odd sizes (E 24, 3 heads of 8, F 40: no size a multiple of TILE), a new row at position 3 of a cache of
 * 6 rows, with the decoder's final norm; one thread and two, which must agree bit for bit. */
enum { E = 24, H = 3, D = E / H, F = 40, M = 6, AT = 3 };

typedef struct {
    double w[3 * E * F];  /* (out, in), room for the largest */
    float *tiles, bias[3 * E + TILE];
    long in, out;
} Linear;

static void make_linear(Linear *l, long in, long out) {
    long columns = (out + TILE - 1) / TILE * TILE;
    l->in = in, l->out = out;
    l->tiles = calloc((size_t)(in * columns), sizeof(float));
    memset(l->bias, 0, sizeof l->bias);
    for (long c = 0; c < out; c++) {
        l->bias[c] = 0.1f * uniform();
        for (long i = 0; i < in; i++) {
            float v = uniform() * 0.4f;
            l->tiles[place(0, c, i, in)] = v;
            l->w[c * in + i] = v;
        }
    }
}

static Product product_of_linear(const Linear *l) {
    return (Product){l->tiles, NULL, l->bias, l->in, (l->out + TILE - 1) / TILE * TILE};
}

static void apply(const Linear *l, const double *x, double *y) {
    for (long c = 0; c < l->out; c++) {
        double sum = l->bias[c];
        for (long i = 0; i < l->in; i++) sum += l->w[c * l->in + i] * x[i];
        y[c] = sum;
    }
}

static void norm64(const double *x, const float *w, const float *b, double *y) {
    double mean = 0, var = 0;
    for (int i = 0; i < E; i++) mean += x[i] / E;
    for (int i = 0; i < E; i++) var += (x[i] - mean) * (x[i] - mean) / E;
    for (int i = 0; i < E; i++) y[i] = (x[i] - mean) / sqrt(var + 1e-5) * w[i] + b[i];
}

static int check_fused(int target, void *pool) {
    Linear attn, proj, fc_in, fc_out;
    make_linear(&attn, E, 3 * E), make_linear(&proj, E, E), make_linear(&fc_in, E, F), make_linear(&fc_out, F, E);
    float ln[6][E], x[E], rotation[D], keys[H * M * D], values[H * M * D];
    for (int k = 0; k < 6; k++)
        for (int i = 0; i < E; i++) ln[k][i] = (k % 2 == 0 ? 1.0f : 0.0f) + 0.2f * uniform();
    for (int i = 0; i < E; i++) x[i] = uniform();
    for (int i = 0; i < D / 2; i++) {
        double angle = 0.7 * (i + 1);
        rotation[2 * i] = (float)cos(angle), rotation[2 * i + 1] = (float)sin(angle);
    }
    for (int k = 0; k < H * M * D; k++) keys[k] = uniform(), values[k] = uniform();
    const float scale = 1.0f / sqrtf((float)D);
    Block block = {target, 0, E, H, F, 1e-5f, scale, ln[0], ln[1], ln[2], ln[3], product_of_linear(&attn),
                   product_of_linear(&proj), product_of_linear(&fc_in), product_of_linear(&fc_out), ln[4], ln[5]};
    /* the reference, in double */
    double h[E], n[E], qkv[3 * E], a[E] = {0}, h2[E], f[F], out[E], expected[E], k64[H][M][D], v64[H][M][D];
    for (int i = 0; i < E; i++) h[i] = x[i];
    norm64(h, ln[0], ln[1], n);
    apply(&attn, n, qkv);
    for (int part = 0; part < 2; part++)
        for (int i = 0; i < E / 2; i++) {
            double *pair = qkv + part * E + 2 * i, re = pair[0], im = pair[1];
            double c = rotation[2 * (i % (D / 2))], s = rotation[2 * (i % (D / 2)) + 1];
            pair[0] = re * c - im * s, pair[1] = re * s + im * c;
        }
    for (int hd = 0; hd < H; hd++)
        for (int t = 0; t < M; t++)
            for (int d = 0; d < D; d++) {
                k64[hd][t][d] = t == AT ? qkv[E + hd * D + d] : keys[(hd * M + t) * D + d];
                v64[hd][t][d] = t == AT ? qkv[2 * E + hd * D + d] : values[(hd * M + t) * D + d];
            }
    for (int hd = 0; hd < H; hd++) {
        double score[AT + 1], top = -1e300, total = 0;
        for (int t = 0; t <= AT; t++) {
            score[t] = 0;
            for (int d = 0; d < D; d++) score[t] += qkv[hd * D + d] * k64[hd][t][d];
            score[t] *= scale;
            top = score[t] > top ? score[t] : top;
        }
        for (int t = 0; t <= AT; t++) total += score[t] = exp(score[t] - top);
        for (int t = 0; t <= AT; t++)
            for (int d = 0; d < D; d++) a[hd * D + d] += score[t] / total * v64[hd][t][d];
    }
    apply(&proj, a, h2);
    for (int i = 0; i < E; i++) h2[i] += h[i];
    norm64(h2, ln[2], ln[3], n);
    apply(&fc_in, n, f);
    for (int i = 0; i < F; i++) f[i] = 0.5 * f[i] * (1.0 + tanh(sqrt(2.0 / M_PI) * (f[i] + 0.044715 * f[i] * f[i] * f[i])));
    apply(&fc_out, f, out);
    for (int i = 0; i < E; i++) out[i] += h2[i];
    norm64(out, ln[4], ln[5], expected);
    /* the library, on one thread and on two */
    float got[2][E], cache_keys[2][H * M * D], cache_values[2][H * M * D];
    float *scratch = malloc(sizeof(float) * (size_t)moss_row_block_scratch(&block, AT + 1));
    int bad = 0;
    for (int threads = 1; threads <= 2; threads++) {
        memcpy(got[threads - 1], x, sizeof x);
        memcpy(cache_keys[threads - 1], keys, sizeof keys), memcpy(cache_values[threads - 1], values, sizeof values);
        moss_pool_use(pool, threads);
        if (moss_row_block(pool, &block, got[threads - 1], rotation, cache_keys[threads - 1], cache_values[threads - 1],
                           M, AT, AT + 1, NULL, scratch) != 0) {
            printf("  fused block: refused\n");
            bad = 1;
        }
    }
    for (int i = 0; i < E && !bad; i++)
        if (fabs(got[0][i] - expected[i]) > 1e-4 * (1.0 + fabs(expected[i]))) {
            printf("  fused block output %d: %.7g, expected %.7g\n", i, got[0][i], expected[i]);
            bad = 1;
        }
    for (int hd = 0; hd < H && !bad; hd++)
        for (int d = 0; d < D; d++)
            if (fabs(cache_keys[0][(hd * M + AT) * D + d] - k64[hd][AT][d]) > 1e-5 * (1.0 + fabs(k64[hd][AT][d])) ||
                fabs(cache_values[0][(hd * M + AT) * D + d] - v64[hd][AT][d]) > 1e-5 * (1.0 + fabs(v64[hd][AT][d]))) {
                printf("  fused block: head %d's new cache row is wrong\n", hd);
                bad = 1;
                break;
            }
    if (!bad && (memcmp(got[0], got[1], sizeof got[0]) || memcmp(cache_keys[0], cache_keys[1], sizeof keys))) {
        printf("  fused block: two threads differ from one\n");
        bad = 1;
    }
    /* two rows, the second its own x, cache, position and rotation: each the bits of its one-row call */
    float pair[2][E], pair_keys[2][H * M * D], pair_values[2][H * M * D], alone[E], alone_keys[H * M * D];
    float alone_values[H * M * D], *pair_scratch = malloc(sizeof(float) * (size_t)(2 * moss_row_block_scratch(&block, AT + 1)));
    for (int i = 0; i < E; i++) pair[0][i] = x[i], pair[1][i] = uniform(), alone[i] = pair[1][i];
    for (int k = 0; k < H * M * D; k++) {
        pair_keys[0][k] = keys[k], pair_values[0][k] = values[k];
        pair_keys[1][k] = alone_keys[k] = uniform(), pair_values[1][k] = alone_values[k] = uniform();
    }
    float rotations[2][D];
    for (int i = 0; i < D; i++) rotations[0][i] = rotation[i], rotations[1][i] = uniform();
    const long positions[2] = {AT, AT - 2}, attended[2] = {AT + 1, AT - 1};
    const Places places = {positions, attended, rotations[0], 1};
    moss_pool_use(pool, 1);
    if (moss_block_rows(pool, &block, 2, pair[0], &places, pair_keys[0], pair_values[0], H * M * D, M, NULL,
                        pair_scratch) != 0 ||
        moss_row_block(pool, &block, alone, rotations[1], alone_keys, alone_values, M, AT - 2, AT - 1, NULL,
                       scratch) != 0 ||
        memcmp(pair[0], got[0], sizeof got[0]) || memcmp(pair[1], alone, sizeof alone) ||
        memcmp(pair_keys[1], alone_keys, sizeof alone_keys) || memcmp(pair_values[0], cache_values[0], sizeof values)) {
        printf("  fused block: two rows in one call differ from each row alone\n");
        bad = 1;
    }
    free(pair_scratch);
    if (moss_row_block(pool, &block, got[0], rotation, cache_keys[0], cache_values[0], M, M, M, NULL, scratch) == 0) {
        printf("  fused block: a row past the cache was not refused\n");
        bad = 1;
    }
    free(scratch), free(attn.tiles), free(proj.tiles), free(fc_in.tiles), free(fc_out.tiles);
    return bad;
}

/* The pool's product number wraps at 2^24: the product that wraps is shared like any other, the calling thread
 * taking its part. Each unit a worker runs waits (a bounded while) until the caller has run one, so the check
 * does not depend on who is scheduled first. */
typedef struct {
    pthread_t caller;
    atomic_int caller_units, waits_over;
} WrapTask;

static void wrap_unit(const void *task, long unit) {
    WrapTask *t = (WrapTask *)task;
    (void)unit;
    if (pthread_equal(pthread_self(), t->caller)) {
        atomic_fetch_add(&t->caller_units, 1);
        return;
    }
    for (long spins = 0; !atomic_load(&t->caller_units) && !atomic_load(&t->waits_over); spins++)
        if (spins > 200000000L) atomic_store(&t->waits_over, 1);  /* the caller never came: the check fails */
}

static int check_ticket_wrap(void *pool) {
    static const unsigned long long LAST[] = {(1ull << 24) - 2, (1ull << 24) - 1};
    int bad = 0;
    moss_pool_use(pool, 2);
    for (size_t k = 0; k < sizeof LAST / sizeof LAST[0]; k++) {
        moss_pool_set_product(pool, LAST[k]);
        for (int product = 0; product < 3; product++) {  /* the product before the wrap, the wrap, the one after */
            WrapTask task = {.caller = pthread_self()};
            moss_share(pool, wrap_unit, &task, 8);
            if (atomic_load(&task.caller_units) == 0) {
                printf("  product %llu after %llu: the calling thread ran none of its units\n",
                       (LAST[k] + 1 + product) % (1ull << 24), LAST[k]);
                bad = 1;
            }
        }
    }
    return bad;
}

/* The sampling chain in float64 (sampling.py's order): repetition penalty, temperature, top-k keeping ties at the
 * k-th score, top-p keeping the crossing token, then the first id whose cumulative probability exceeds u. */
static long chain64(const float *logits, const uint8_t *seen, long v, double temperature, long k, double top_p,
                    double penalty, double u) {
    double s[16], sorted[16], p[16], mass = 0, total = 0;
    for (long i = 0; i < v; i++) {
        double x = seen[i] ? (logits[i] < 0 ? logits[i] * penalty : logits[i] / penalty) : logits[i];
        s[i] = x / temperature, sorted[i] = s[i];
    }
    for (long i = 0; i < v; i++) /* descending */
        for (long j = i + 1; j < v; j++)
            if (sorted[j] > sorted[i]) {
                double t = sorted[i];
                sorted[i] = sorted[j], sorted[j] = t;
            }
    const double threshold = sorted[(k > 0 && k < v ? k : v) - 1];
    for (long i = 0; i < v; i++) total += p[i] = s[i] >= threshold ? exp(s[i] - sorted[0]) : 0;
    /* top-p in descending order (ties by id): drop each id whose predecessors' mass already exceeds top_p */
    int order[16], n = 0;
    for (long i = 0; i < v; i++) order[n++] = (int)i;
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (s[order[j]] > s[order[i]] || (s[order[j]] == s[order[i]] && order[j] < order[i])) {
                int t = order[i];
                order[i] = order[j], order[j] = t;
            }
    for (int j = 0; j < n; j++) {
        if (top_p < 1 && mass > top_p) p[order[j]] = 0;
        mass += (s[order[j]] >= threshold ? exp(s[order[j]] - sorted[0]) : 0) / total;
    }
    total = 0;
    for (long i = 0; i < v; i++) total += p[i];
    double cdf = 0;
    for (long i = 0; i < v; i++)
        if ((cdf += p[i] / total) > u) return i;
    return v - 1;
}

/* moss_local_decide against chain64 on a 12-id distribution (ties, a penalized id leaving the top k, a top-p
 * cut), for uniforms on a grid, and greedy argmax after the penalty (the first of tied maxima). */
static int check_decide(void) {
    const float logits[12] = {4.0f, 3.6f, 3.5f, 3.5f, 3.0f, 2.9f, 2.9f, 1.0f, -1.0f, 3.9f, 0.5f, 2.0f};
    const uint8_t seen[12] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0};
    const float settings[][4] = {{0.9f, 6, 0.9f, 1.5f}, {0.9f, 6, 0.95f, 1.5f}, {1.3f, 0, 0.5f, 2.0f},
                                 {0.7f, 3, 1.0f, 1.0f}};
    float scratch[4 * 12];
    for (size_t c = 0; c < sizeof settings / sizeof settings[0]; c++)
        for (int step = 1; step < 400; step++) {
            const float *set = settings[c], u = (float)step / 400.0f;
            long want = chain64(logits, seen, 12, set[0], (long)set[1], set[2], set[3], u);
            long off = chain64(logits, seen, 12, set[0], (long)set[1], set[2], set[3], u + 1e-4);
            long got = moss_local_decide(logits, 12, seen, 1, set[0], (int64_t)set[1], set[2], set[3], u, NULL,
                                         scratch);
            if (want == off && got != want) { /* u not within rounding of a boundary */
                printf("  decision %zu at u=%.4f: %ld, expected %ld\n", c, u, got, want);
                return 1;
            }
        }
    const float tied[5] = {1.0f, 3.0f, -2.0f, 3.0f, 2.9f};
    const uint8_t once[5] = {0, 1, 0, 0, 0};
    float more[4 * 5];
    if (moss_local_decide(tied, 5, once, 0, 1.0f, 0, 1.0f, 1.2f, 0.5f, NULL, more) != 3 ||
        moss_local_decide(tied, 5, once, 0, 1.0f, 0, 1.0f, 1.0f, 0.5f, NULL, more) != 1) {
        printf("  greedy decision after the penalty is wrong\n");
        return 1;
    }
    return 0;
}

int main(void) {
    static const long SHAPES[][3] = {{1, 16, 64}, {1, 24, 40}, {1, 33, 17}, {1, 200, 300}, {3, 7, 513}, {2, 768, 1024},
                                      {5, 40, 130}, {8, 33, 64}, {13, 96, 200}, {17, 768, 256},
                                      /* past SUMS_ROWS (32): a chunk of one row, and chunks of 32 and 2 */
                                      {33, 70, 130}, {66, 40, 64}};
    void *pool = moss_pool_new(2);
    int mask = moss_targets(), failed = 0;
    if (pool == NULL) {
        printf("no pool\n");
        return 1;
    }
    for (int t = 0; t < TARGETS; t++) {
        if (!(mask >> t & 1)) continue;
        int bad = 0, cases = 0;
        for (int f = 0; f < FORMATS; f++)
            for (size_t s = 0; s < sizeof SHAPES / sizeof SHAPES[0]; s++)
                for (int variant = 0; variant < 4; variant++, cases++)
                    bad += check(t, f, SHAPES[s][0], SHAPES[s][1], SHAPES[s][2], variant & 1, variant >> 1, pool);
        bad += check_fused(t, pool), cases++;
        bad += check_decide(), cases++;
        printf("%s: %d of %d cases agree\n", TARGET_NAMES[t], cases - bad, cases);
        failed += bad;
    }
    if (check_ticket_wrap(pool)) {
        printf("the pool's product number does not wrap cleanly\n");
        failed++;
    }
    if (moss_matvec(pool, TARGETS, 0, NULL, NULL, NULL, NULL, NULL, NULL, 1, 1, TILE) == 0) {
        printf("an unknown target was not refused\n");
        failed++;
    }
    moss_pool_free(pool);
    return failed != 0;
}
