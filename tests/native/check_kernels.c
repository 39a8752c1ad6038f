/* The library's one-row products checked on their own, for the kernel tests where Python cannot run (an aarch64
 * build under qemu-user): every target this CPU runs, the three formats, odd shapes, with and without bias and
 * residual, on one thread and shared over a pool of two; each column against a float64 sum of the same stored
 * values, and the pool's result bit for bit the one thread's. Built with the library's objects
 * (moss_npu/cpu/native_build.py); prints one line per target and exits 1 on any failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TILE 256
enum { FORMATS = 3, TARGETS = 4 };
static const char *TARGET_NAMES[TARGETS] = {"portable", "avx2", "avx512", "neon"};
static const char *FORMAT_NAMES[FORMATS] = {"float32", "bfloat16", "int8"};

int moss_targets(void);
void *moss_pool_new(int threads);
void moss_pool_free(void *pool);
void moss_pool_use(void *pool, int threads);
int moss_matvec(void *pool, int target, int format, const float *x, const void *w, const float *scale,
                const float *bias, const float *residual, float *y, long rows, long in, long out);

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
    free(w), free(w16), free(w8), free(x), free(scale), free(bias), free(residual), free(y), free(y2), free(value);
    return bad;
}

int main(void) {
    static const long SHAPES[][3] = {{1, 16, 64}, {1, 24, 40}, {1, 33, 17}, {1, 200, 300}, {3, 7, 513}, {2, 768, 1024}};
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
        printf("%s: %d of %d cases agree\n", TARGET_NAMES[t], cases - bad, cases);
        failed += bad;
    }
    if (moss_matvec(pool, TARGETS, 0, NULL, NULL, NULL, NULL, NULL, NULL, 1, 1, TILE) == 0) {
        printf("an unknown target was not refused\n");
        failed++;
    }
    moss_pool_free(pool);
    return failed != 0;
}
