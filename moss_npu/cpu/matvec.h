/* What matvec.c, the per-target tiles (matvec_tiles.c) and the fused one-row block (fused_block.c) share. */
#ifndef MOSS_MATVEC_H
#define MOSS_MATVEC_H

/* Output columns per tile: matrices are padded to a multiple. 64 keeps a tile's sums in registers on every
 * target, one stream per tile, and cuts even a 768-column product into enough tiles for two or more threads to
 * share evenly (docs/native.md#threads). */
#define TILE 64

enum { PORTABLE, AVX2, AVX512, NEON, TARGETS };
enum { F32, BF16, INT8, FORMATS };

/* Bytes a stored weight value takes in `format`'s tiles. */
static inline long value_bytes(int format) { return format == F32 ? 4 : format == BF16 ? 2 : 1; }
enum { BAD_CALL = -1 };

/* One tile of a product for `rows` rows: y[r · y_stride + 0..TILE) = x[r · x_stride ..] · tile, then finished with
 * the tile's columns of scale (int8 only), bias and residual (either may be NULL; residual rows y_stride apart). */
typedef void (*TileFunction)(const float *x, long x_stride, long rows, const void *tile, float *y, long y_stride,
                             const float *scale, const float *bias, const float *residual, long in);

/* A function's loops in the widest vectors the CPU has (a clone per instruction set, picked when the library
 * loads). The files outside the tiles are compiled with -ffp-contract=off (native/build.py): no clone fuses a
 * multiply into an add, so every clone does the same float operations in the same order and a row gets the
 * same bits on every CPU. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST
#endif

/* e^x = 2^n · e^r for x already clamped to where e^x is a normal float (or just overflows): x = n ln 2 + r (ln 2 in
 * two parts, n rounded to nearest), e^r by Cephes' expf polynomial, to about an ulp and without a branch. Defines
 * `static inline T name(T x, T *n)` returning e^r, for T a float or a GCC vector of floats (the caller puts 2^n
 * into the exponent bits): matvec.c's GELU and window_attention.c's softmax share one polynomial. */
#define EXP_PARTS(name, T)                                                       \
    static inline T name(T x, T *n) {                                            \
        *n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;             \
        const T r = (x - *n * 0.693359375f) - *n * -2.12194440e-4f;              \
        T p = r * 1.9875691500e-4f + 1.3981999507e-3f;                           \
        p = p * r + 8.3334519073e-3f;                                            \
        p = p * r + 4.1665795894e-2f;                                            \
        p = p * r + 1.6666665459e-1f;                                            \
        p = p * r + 5.0000001201e-1f;                                            \
        return p * r * r + r + 1.0f;                                             \
    }

/* Bit t set: target t is in this library and this CPU runs it. */
int moss_targets(void);

/* One unit of a task shared over the pool: a product's tile, a block's attention head. */
typedef void (*UnitFunction)(const void *task, long unit);

/* Run unit(task, j) for j in [0, units) over the pool's threads (alone where `pool` is NULL, busy or set to one
 * thread); returns when every unit is done. */
void moss_share(void *pool, UnitFunction unit, const void *task, long units);

/* moss_matvec, with the tanh GELU on every finished column where `gelu` is set. */
int moss_product(void *pool, int target, int format, const float *x, const void *w, const float *scale,
                 const float *bias, const float *residual, float *y, long rows, long in, long out, int gelu);

#endif
